"""The gradient functions a step runs: ``torch.func.grad`` of the loss, per-sample
gradients (``vmap`` or ghost clipping), or plain autograd for the eager fast path, and
the ordering that makes a compiled step's writes wait for every gradient."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor
from torch.func import grad_and_value

from ..core._base import Gradients, GradientTransformation, LossFn, Params
from ..core._flat import Flat, leaves
from ..core._tree import tree_map
from ._ghost import ghost_gradients
from ._per_sample import vmapped_grads


def ghost_of(per_sample: GradientTransformation | None) -> Any:
    """``fg.ghost_clip``'s arguments where ``per_sample`` is one, else None."""
    return per_sample.facts.ghost if isinstance(per_sample, GradientTransformation) else None


def gradient_function(
    loss_fn: LossFn, has_aux: bool, per_sample: GradientTransformation | None, buffers: bool
) -> Callable[..., Gradients]:
    """``fn(params, [buffers,] *batch) -> (grads, loss, new_buffers, aux)`` (traced).

    With ``buffers``, the loss sees clones of the buffers made inside the transform:
    a forward that updates them in place (train-mode BatchNorm) writes to tensors
    that ``torch.func.grad`` owns, and the updated clones leave as an auxiliary
    output. The given buffers are never written here (donation copies them later).
    """
    if buffers:

        def with_buffers(params: Params, bufs: dict[str, Tensor], *batch: Any) -> Any:
            local = {k: b.clone() for k, b in bufs.items()}
            out = loss_fn(params, local, *batch)
            # torch.func's aux holds tensors only: no None placeholder without has_aux.
            return (out[0], (local, out[1])) if has_aux else (out, local)

        def stateful(params: Params, bufs: dict[str, Tensor], *batch: Any) -> Any:
            grads, (loss, extra) = grad_and_value(with_buffers, has_aux=True)(params, bufs, *batch)
            new_bufs, aux = extra if has_aux else (extra, None)
            return Gradients(grads, loss, new_bufs, aux)

        return stateful
    if per_sample is None:

        def plain(params: Params, *batch: Any) -> Gradients:
            grads, out = grad_and_value(loss_fn, has_aux=has_aux)(params, *batch)
            loss, aux = out if has_aux else (out, None)
            return Gradients(grads, loss, None, aux)

        return plain
    how = ghost_of(per_sample)
    if how is not None:  # fg.ghost_clip: from per-sample norms, no per-sample gradients
        return ghost_gradients(loss_fn, has_aux, *how)
    batched = vmapped_grads(loss_fn, has_aux, each=per_sample)

    def averaged(params: Params, *batch: Any) -> Gradients:
        g, losses, aux = batched(params, *batch)
        return Gradients({k: v.mean(0) for k, v in g.items()}, losses.mean(), None, aux)

    return averaged


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, Tensor) else x


def autograd_gradients(loss_fn: LossFn, has_aux: bool, buffers: bool) -> Callable[..., Gradients]:
    """The same as :func:`gradient_function` (without ``per_sample``), by plain autograd.

    Eagerly, ``torch.func.grad`` wraps every tensor and pytree on each call, which
    costs about twice the time of ``torch.autograd.grad`` over the same ``fg.call``
    (docs/compile-notes.md; the same values, bit for bit: it runs the same autograd
    engine). The eager step uses this once the first call
    with the inputs' structure has run through ``torch.func`` (whose checks give the
    clear errors: output not a scalar, aux, a write to a captured tensor). Writes to
    a module's own buffers are caught on both paths: the eager step runs under
    :func:`funcgrad.model._model.watching_buffers`, where ``fg.call`` compares the buffers'
    version counters.
    """

    def plain(params: Params, *args: Any) -> Gradients:
        with torch.enable_grad():
            leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
            if buffers:
                local = {k: b.clone() for k, b in args[0].items()}
                out = loss_fn(leaves, local, *args[1:])
            else:
                out = loss_fn(leaves, *args)
            loss = out[0] if has_aux else out
            if loss.requires_grad:
                g = torch.autograd.grad(loss, tuple(leaves.values()), materialize_grads=True)
            else:  # a loss that does not depend on the parameters: zeros, as torch.func
                g = tuple(torch.zeros_like(p) for p in leaves.values())
        grads = dict(zip(leaves, g, strict=True))
        new_bufs = {k: b.detach() for k, b in local.items()} if buffers else None
        aux = optree.tree_map(_detached, out[1], none_is_leaf=True) if has_aux else None
        return Gradients(grads, loss.detach(), new_bufs, aux)

    return plain


def after_gradients(grads: Params, old: Any, new: Any) -> Any:
    """``new``, made to depend on every gradient, so it is written only after them.

    Inside one compiled graph inductor may schedule a write of a donated input that
    does not depend on the gradients (Adam's step counter) before the forward and
    backward ran; if they then failed, the step had half-applied itself. Selecting
    with a flag that is always False but computed from every gradient orders all
    writes after the backward. The select fuses into the update kernels, which read
    the old values anyway.
    """
    probes = [g.reshape(-1)[:1].to(torch.float32) for g in _probed(grads) if g.numel()]
    if not probes:
        return new
    probe = torch.cat(probes)
    never = (probe != probe).all() & (probe == probe).all()  # NaN and not NaN: False
    return tree_map(lambda o, n: torch.where(never, o, n), old, new)


FEW_PROBED = 16
"""A buffer of at most this many entries is probed per name by :func:`after_gradients`
when the step kept its per-name gradients; a larger one through its flat gradient."""


def _probed(grads: Params) -> list[Tensor]:
    """The tensors whose computation the writes wait for: every gradient, or for flat
    gradients one per buffer, except that a buffer of few entries whose per-name
    gradients the step kept (:meth:`funcgrad.Flat._packed_from`) is probed through
    those: its flat gradient may be dead code (the rules read the per-name ones), and
    a probe of it would keep it. Through the flat gradient a buffer is one probe,
    which keeps a deep stack's compile short (one per name cost about 2 CPU s of 31 at
    40 layers: docs/compile-notes.md)."""
    if not isinstance(grads, Flat):
        return leaves(grads)
    out: list[Tensor] = []
    for b, buf in enumerate(grads.buffers):
        few = len(grads.layout.names_in(b)) <= FEW_PROBED
        parts = grads._parts_in(b, 0, buf.shape[-1]) if few else None
        out.extend(parts.values() if parts is not None else [buf])
    return out


__all__ = ["FEW_PROBED", "after_gradients", "autograd_gradients", "ghost_of", "gradient_function"]
