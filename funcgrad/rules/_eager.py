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


def plain_cpu(t: object) -> bool:
    """A plain, dense, real floating-point CPU tensor, outside any trace or transform."""
    return (
        type(t) is Tensor
        and t.device.type == "cpu"
        and t.layout is torch.strided
        and t.is_floating_point()
        and not t.requires_grad
        and not _compat.is_functorch_wrapped(t)
    )


def zero_fix(
    if_all_zero: float, if_zero: float
) -> Callable[[list[Group], Scratch | None], list[Group] | None]:
    """``zero_fix(if_all_zero, if_zero)`` (exact zeros) on a list of groups at once;
    None where a gradient is not a plain CPU tensor or the step is traced. Large
    results and masks are borrowed from ``scratch`` where given (the caller reclaims
    them once the step has read them), else allocated."""

    def run(groups: list[Group], scratch: Scratch | None = None) -> list[Group] | None:
        if _compat.compiling():
            return None

        def empty(t: Tensor, dtype: torch.dtype) -> Tensor | None:
            if scratch is None or t.numel() < BIG:
                return None
            return scratch.empty(tuple(t.shape), dtype, t.device)

        masks: list[list[Tensor | None]] = []
        flags: list[Tensor] = []
        for g in groups:
            row: list[Tensor | None] = []
            for t in g.values():
                if not plain_cpu(t):
                    return None
                if t.numel() == 0:
                    row.append(None)
                    continue
                into = empty(t, torch.bool)
                nonzero = t.bool() if into is None else into.copy_(t)
                lo, hi = torch.aminmax(nonzero.view(torch.uint8))
                flags += (lo, hi)
                row.append(nonzero)
            masks.append(row)
        read = iter(torch.stack(flags).tolist() if flags else ())
        out: list[Group] = []
        for g, row in zip(groups, masks, strict=True):
            # per tensor: (no zero, some nonzero); an empty one: (True, False)
            seen = [(True, False) if m is None else (next(read) == 1, next(read) == 1) for m in row]
            done: Group = {}
            dead = not any(some for _, some in seen)  # no nonzero entry in the group
            for (k, t), m, (none_zero, _) in zip(g.items(), row, seen, strict=True):
                if m is None or (none_zero and not dead):  # empty, or nothing to change
                    done[k] = t
                    continue
                into = empty(t, t.dtype)
                if dead:
                    full = (
                        torch.full_like(t, if_all_zero) if into is None else into.fill_(if_all_zero)
                    )
                    done[k] = full
                elif into is None:
                    done[k] = torch.where(m, t, if_zero)
                else:  # the 0-d value as where rounds a Python float: in t's dtype
                    value = torch.full((), if_zero, dtype=t.dtype)
                    done[k] = torch.where(m, t, value, out=into)
            out.append(done)
        return out

    return run


__all__ = ["plain_cpu", "zero_fix"]
