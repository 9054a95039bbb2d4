"""The seed rule (``fg.rules.zero_fix()``) in an eager step on CPU tensors, in one
pass per gradient where it has no zero.

``zero_fix``'s traceable form (``funcgrad/rules/__init__.py``) takes three passes
over every entry of every gradient whatever the gradients hold: the zero mask
(``g == 0``), the group's "all zero" test over it, and a ``torch.where`` that makes a
new tensor. torch's eager CPU kernels for these are slow next to its fused AdamW
kernel (the MLP's 662k entries: 0.54, 0.53 and 0.40 ms against 0.39 ms for the
update; docs/torch-loops.md). Here, on the host (free on the CPU):

1. one pass per gradient makes its nonzero mask (``t.bool()``: torch's fastest
   float-to-bool kernel here), and the mask's smallest and largest byte say whether
   the gradient holds a zero and whether it holds anything else; all groups' flags
   come to the host in one read;
2. a group with no nonzero entry becomes ``if_all_zero`` (``full_like``); in the
   others, a gradient with no zero passes through as it is (no copy), and only a
   gradient holding zeros takes the ``torch.where``, over the mask already made.

Small gradients of one shape (a deep stack's biases and small layers) are stacked
first and take step 1 together, one ``bool()`` and one ``amin``/``amax`` per row:
per tensor, the eager ops' own overhead (microseconds each) outweighed their work.
Large results and masks are borrowed from the optimizer's scratch
(funcgrad/core/_scratch.py), kept between steps: a fresh 39 MB result faulted every
page each step.

The values are those of the traceable form, bit for bit (NaN is not a zero; ``-0.0``
is; an empty tensor neither keeps its group from being all zero nor changes):
``tests/test_rules.py::test_zero_fix_eager_equals_the_traceable_rule``. Only plain
dense CPU tensors outside any trace or ``torch.func`` transform take it; anything
else, and ``atol``/``rtol`` other than 0, takes the traceable form. On CUDA the
traceable form stays on the device (a host read there waits for the GPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .. import _compat
from ..core._scratch import BIG, Scratch

Group = dict[str, Tensor]
Mask = Tensor | tuple[Tensor, int] | None


def plain_cpu(t: object) -> bool:
    """A plain, dense, real floating-point CPU tensor that does not require grad (the
    caller checks once that no ``torch.func`` transform runs: see :func:`zero_fix`)."""
    return (
        type(t) is Tensor
        and t.is_cpu
        and t.layout is torch.strided
        and t.is_floating_point()
        and not t.requires_grad
    )


def zero_fix(
    if_all_zero: float, if_zero: float
) -> Callable[[list[Group], Scratch | None], list[Group] | None]:
    """``zero_fix(if_all_zero, if_zero)`` (exact zeros) on a list of groups at once;
    None where a gradient is not a plain CPU tensor or the step is traced. Large
    results and masks are borrowed from ``scratch`` where given (the caller reclaims
    them once the step has read them), else allocated."""

    def run(groups: list[Group], scratch: Scratch | None = None) -> list[Group] | None:
        if _compat.compiling() or _compat.functorch_transform_active():
            return None  # traced, or tensors wrapped by vmap/grad: the traceable rule
        flat = [t for g in groups for t in g.values()]
        if not all(plain_cpu(t) for t in flat):
            return None
        masks, lo, hi = _nonzero_masks(flat, scratch)
        i = 0
        out: list[Group] = []
        for g in groups:
            n = len(g)
            dead = not any(hi[i : i + n])  # no nonzero entry (an empty tensor has none)
            if not dead and all(lo[i : i + n]):  # no zero: the group as it is
                out.append(dict(g))
                i += n
                continue
            done: Group = {}
            for k, t in g.items():
                m, none_zero = masks[i], lo[i]
                i += 1
                if m is None or (none_zero and not dead):  # empty, or nothing to change
                    done[k] = t
                    continue
                into = _empty(scratch, t, t.dtype)
                if dead:
                    fill = (
                        torch.full_like(t, if_all_zero) if into is None else into.fill_(if_all_zero)
                    )
                    done[k] = fill
                    continue
                mask = m if isinstance(m, Tensor) else m[0][m[1]]
                if into is None:
                    done[k] = torch.where(mask, t, if_zero)
                else:  # the 0-d value as where rounds a Python float: in t's dtype
                    value = torch.full((), if_zero, dtype=t.dtype)
                    done[k] = torch.where(mask, t, value, out=into)
            out.append(done)
        return out

    return run


def _empty(scratch: Scratch | None, t: Tensor, dtype: torch.dtype) -> Tensor | None:
    """A buffer shaped as ``t`` from ``scratch`` for a large ``t``; None: allocate."""
    if scratch is None or t.numel() < BIG:
        return None
    return scratch.empty(tuple(t.shape), dtype, t.device)


def _nonzero_masks(
    flat: list[Tensor], scratch: Scratch | None
) -> tuple[list[Mask], list[bool], list[bool]]:
    """Each tensor's nonzero mask (None for an empty one; a small tensor's as its row
    of the stacked masks, indexed when used), whether it has no zero, and
    whether it has a nonzero entry; the flags read on the host in one ``tolist()``.

    A large tensor is one pass (``bool()``) and a reduction of the mask's bytes. Small
    tensors of one shape and dtype (a deep stack's biases, its 64x64 layers) are
    stacked first: one ``bool()`` and one ``amin``/``amax`` per row for all of them,
    where per tensor the eager ops' own overhead outweighs their work."""
    masks: list[Mask] = [None] * len(flat)
    where: list[int] = []  # the tensors' indices, in the order of the flags
    los: list[Tensor] = []
    his: list[Tensor] = []
    small: dict[tuple[torch.Size, torch.dtype], list[int]] = {}
    for i, t in enumerate(flat):
        n = t.numel()
        if n == 0:
            continue
        if n < BIG:
            small.setdefault((t.shape, t.dtype), []).append(i)
            continue
        into = _empty(scratch, t, torch.bool)
        m = t.bool() if into is None else into.copy_(t)
        b = m.view(torch.uint8)
        masks[i] = m
        where.append(i)
        los.append(b.amin().view(1))
        his.append(b.amax().view(1))
    for idx in small.values():
        ts = [flat[i] for i in idx]
        stacked = (torch.stack(ts) if len(ts) > 1 else ts[0].unsqueeze(0)).bool()
        rows = stacked.view(torch.uint8).reshape(len(ts), -1)  # a view but for one strided
        for j, i in enumerate(idx):
            masks[i] = (stacked, j)
        where += idx
        los.append(rows.amin(1))
        his.append(rows.amax(1))
    lo = [True] * len(flat)  # an empty tensor: no zero, no nonzero
    hi = [False] * len(flat)
    if where:
        read = torch.cat(los + his).tolist()
        for i, a, b in zip(where, read[: len(where)], read[len(where) :], strict=True):
            lo[i], hi[i] = a == 1, b == 1
    return masks, lo, hi


__all__ = ["plain_cpu", "zero_fix"]
