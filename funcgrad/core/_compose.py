"""When an update must take its plain, differentiable and vmappable math.

funcgrad's eager fast paths (``torch._foreach_*`` over lists of tensors, results
written into reused scratch buffers, Python branches on a device flag) are right for
a training step, where nothing differentiates through the update. Under a function
transform they are not. Adam's multi-tensor path scales ``_foreach_sqrt``'s result in
place (``_foreach_mul_``), and sqrt's backward reads that result: plain autograd
notices (a version-counter error), but ``torch.func.grad`` does not (torch 2.13), and
returned derivatives that were silently wrong (half the true one for that term).
``vmap`` has no batching rule for ``_foreach_lerp`` and others. So every fast path
asks :func:`composing` first, and takes the per-tensor math instead (written
without in-place ops; what ``torch.compile`` traces; the same values bit for bit)
whenever

- a ``torch.func`` transform is active (``grad``, ``vjp``, ``jacrev``, ``jvp``,
  ``vmap``, ``functionalize``): its interpreter stack is not empty; or
- autograd is recording through the update: grad mode is on and some input
  tensor requires grad (``torch.autograd.grad(..., create_graph=True)`` loops,
  learnable hyperparameters as 0-d tensors).

Under ``torch.compile`` the traced path is taken anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from .. import _compat
from .._compat import compiling


def transform_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ...) is active now.

    The interpreter stack is a private torch API: a torch without it is a clear
    error (``funcgrad._compat``), not a guess (guessing "active" would refuse donated steps and
    collectives; guessing "not active" would give wrong derivatives).
    """
    return _compat.functorch_transform_active()


def is_transformed(t: Tensor) -> bool:
    """Whether ``t`` is a tensor wrapped by a ``torch.func`` transform (its value
    cannot be read with ``.item()`` under ``vmap``)."""
    return _compat.is_functorch_wrapped(t)


def plain_value(t: Tensor) -> float | None:
    """``t.item()`` for a plain 0-d tensor; ``None`` where reading it is impossible
    or would break a trace (compiled, wrapped by a transform, on the meta device)."""
    if compiling() or t.is_meta or is_transformed(t):
        return None
    return t.item()


def _records(trees: Iterable[object]) -> bool:
    for tree in trees:
        if isinstance(tree, Tensor):
            if tree.requires_grad:
                return True
        elif isinstance(tree, Mapping):
            if any(isinstance(t, Tensor) and t.requires_grad for t in tree.values()):
                return True
    return False


def composing(*inputs: object) -> bool:
    """Whether an update over ``inputs`` (tensors, or dicts of tensors) must take the
    plain per-tensor math: traced, under a ``torch.func`` transform, or recorded by
    autograd (see the module docstring)."""
    if compiling() or transform_active():
        return True
    return torch.is_grad_enabled() and _records(inputs)


def refuse_transforms(who: str, *inputs: object) -> None:
    """Raise a clear error if ``who`` (a transformation that talks to other ranks) runs
    under a ``torch.func`` transform or with autograd recording through it: the
    collectives have no derivative and no batching rule there, and torch's own errors
    do not say so. (Traced by ``torch.compile``, this check is not reached.)"""
    if compiling():
        return
    if composing(*inputs):
        raise RuntimeError(
            f"{who} runs collectives across torch.distributed ranks, which cannot be "
            "differentiated through or vmapped here (it was called under torch.func.grad/"
            "vmap/jacrev, or with inputs that require grad while grad mode is on). "
            "Differentiate or vmap each rank's update without it (e.g. fg.adam alone), "
            "then average the results across ranks yourself (torch.distributed."
            "all_reduce on the meta-gradients); a plain training step needs no change."
        )
