"""When an update must take its plain, differentiable and vmappable math.

funcgrad's eager fast paths (``torch._foreach_*`` over lists of tensors, results
written into reused scratch buffers, Python branches on a device flag) are right for
a training step, where nothing differentiates through the update. Under a function
transform they are not: autograd through ``_foreach_sqrt`` followed by an in-place
``_foreach_mul_`` on its result gave silently wrong derivatives (torch 2.13 does not
check the version counter there), and ``vmap`` has no batching rule for most
``_foreach_*`` ops. So every fast path asks :func:`composing` first, and takes the
per-tensor math, written without in-place ops (the math ``torch.compile`` traces,
bit for bit the same values), whenever

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

_functorch = getattr(torch._C, "_functorch", None)
_peek = getattr(_functorch, "peek_interpreter_stack", None)
_wrapped = getattr(_functorch, "is_functorch_wrapped_tensor", None)


def transform_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ...) is active now.

    The interpreter stack is a private torch API (present from torch 2.0 through the
    tested releases). Should a torch release drop it, every update takes the plain
    per-tensor path: slower eagerly, never a wrong derivative.
    """
    return True if _peek is None else _peek() is not None


def is_transformed(t: Tensor) -> bool:
    """Whether ``t`` is a tensor wrapped by a ``torch.func`` transform (its value
    cannot be read with ``.item()`` under ``vmap``)."""
    return True if _wrapped is None else bool(_wrapped(t))


def plain_value(t: Tensor) -> float | None:
    """``t.item()`` for a plain 0-d tensor; ``None`` where reading it is impossible
    or would break a trace (compiled, wrapped by a transform, on the meta device)."""
    if torch.compiler.is_compiling() or t.is_meta or is_transformed(t):
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
    if torch.compiler.is_compiling() or transform_active():
        return True
    return torch.is_grad_enabled() and _records(inputs)
