"""The elementwise operations an optimizer's kernel is written in (funcgrad/optim/_kernel.py
runs it): :data:`PLAIN` on one tensor at a time (``torch``'s own operations, a large
result written into a borrowed scratch buffer in the eager donated step) and
:data:`LISTS` on lists of tensors (one ``torch._foreach_*`` call where torch has one).
Both compute the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..core._base import is_number
from ..core._scratch import BIG, Scratch


class Ops:
    """The elementwise operations of a kernel, each ``torch``'s own; with a scratch
    (the eager donated step), a result of at least ``BIG`` entries is written into a
    borrowed buffer (``out=``) instead of a new one. Same operations, same values.

    The ``*_`` forms (``add_``, ``mul_``, ``sub_``) may write into their first
    argument, which must be a result of the same kernel that is read no more: in place
    where the step may write (eager, not traced or transformed), else out of place.
    :meth:`release` hands a borrowed buffer that is read no more back for the rest
    of the kernel to reuse. Both only save memory and allocations; the values are
    those of the plain operations."""

    def __init__(self, scratch: Scratch | None = None) -> None:
        self.scratch = scratch

    def _call(self, fn: Callable[..., Tensor], *args: Any) -> Tensor:
        if self.scratch is not None:
            tensors = [a for a in args if isinstance(a, Tensor)]
            big = max(tensors, key=Tensor.numel)
            if big.numel() >= BIG:
                shape = big.shape  # an elementwise kernel's: its tensors' or 0-d
                if any(t.dim() and t.shape != shape for t in tensors):
                    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
                if fn is torch.where:
                    dtype = torch.result_type(args[1], args[2])
                elif len(args) == 1:
                    dtype = args[0].dtype
                else:
                    dtype = torch.result_type(args[0], args[1])
                out = self.scratch.empty(tuple(shape), dtype, tensors[0].device)
                return fn(*args, out=out)
        return fn(*args)

    def add(self, a: Tensor, b: Tensor | float) -> Tensor:
        return self._call(torch.add, a, b)

    def sub(self, a: Tensor, b: Tensor | float) -> Tensor:
        return self._call(torch.sub, a, b)

    def mul(self, a: Tensor | float, b: Tensor | float) -> Tensor:
        return self._call(torch.mul, a, b)

    def div(self, a: Tensor, b: Tensor | float) -> Tensor:
        return self._call(torch.div, a, b)

    def lerp(self, a: Tensor, b: Tensor, weight: Tensor | float) -> Tensor:
        return self._call(torch.lerp, a, b, weight)

    def where(self, cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
        return self._call(torch.where, cond, a, b)

    def maximum(self, a: Tensor, b: Tensor) -> Tensor:
        return self._call(torch.maximum, a, b)

    def sqrt(self, a: Tensor) -> Tensor:
        return self._call(torch.sqrt, a)

    def sign(self, a: Tensor) -> Tensor:
        return self._call(torch.sign, a)

    def abs(self, a: Tensor) -> Tensor:
        return self._call(torch.abs, a)

    def neg(self, a: Tensor) -> Tensor:
        return self._call(torch.neg, a)

    def add_(self, a: Tensor, b: Tensor | float) -> Tensor:
        return torch.add(a, b) if self.scratch is None else a.add_(b)

    def sub_(self, a: Tensor, b: Tensor | float) -> Tensor:
        return torch.sub(a, b) if self.scratch is None else a.sub_(b)

    def mul_(self, a: Tensor, b: Tensor | float) -> Tensor:
        return torch.mul(a, b) if self.scratch is None else a.mul_(b)

    def release(self, a: Tensor) -> None:
        if self.scratch is not None:
            self.scratch.release(a)


PLAIN = Ops()
"""Operations that allocate their results (traced, transformed, or outside a step)."""


class Lists(Ops):
    """:class:`Ops` over lists of tensors (the multi-tensor path): each argument a
    list (one tensor per parameter, all of a compute dtype) or a scalar shared by all
    (a float or a 0-d tensor). One ``torch._foreach_*`` call where torch has the
    overload, else the plain operation tensor by tensor. On the CPU torch's
    ``_foreach_*`` run the plain operation on each tensor, so the values are those of
    :class:`Ops`' bit for bit (tested); the lists cut the Python dispatches of an
    eager step over many small tensors."""

    def __init__(self) -> None:
        super().__init__(None)

    @staticmethod
    def _each(fn: Callable[..., Tensor], *args: Any) -> Any:
        n = next(len(a) for a in args if isinstance(a, list))
        return [fn(*(a[i] if isinstance(a, list) else a for a in args)) for i in range(n)]

    @staticmethod
    def _scalar(x: Any, tensor_ok: bool) -> bool:
        """Whether ``x`` may go to a ``_foreach_*`` overload as the shared scalar."""
        if is_number(x):
            return True
        return tensor_ok and isinstance(x, Tensor) and x.dim() == 0

    @staticmethod
    def _number(x: Any) -> Any:
        """A 0-d CPU tensor scalar as a Python float, for the ``_foreach_*`` overloads
        that take no tensor: the op casts it to its dtype, as the tensor's value was."""
        if isinstance(x, Tensor) and x.dim() == 0 and x.device.type == "cpu":
            return x.item()
        return x

    def _binary(
        self, fn: Callable[..., Tensor], many: Callable[..., Any], a: Any, b: Any,
        tensor_ok: bool, commutes: bool,
    ) -> Any:  # fmt: skip
        if not tensor_ok:
            b = self._number(b)
        if isinstance(a, list) and (isinstance(b, list) or self._scalar(b, tensor_ok)):
            return list(many(a, b))
        if commutes and isinstance(b, list) and self._scalar(a, tensor_ok):
            return list(many(b, a))  # IEEE addition and multiplication commute exactly
        return self._each(fn, a, b)

    def add(self, a: Any, b: Any) -> Any:
        return self._binary(torch.add, torch._foreach_add, a, b, True, True)

    def sub(self, a: Any, b: Any) -> Any:
        return self._binary(torch.sub, torch._foreach_sub, a, b, False, False)

    def mul(self, a: Any, b: Any) -> Any:
        return self._binary(torch.mul, torch._foreach_mul, a, b, True, True)

    def div(self, a: Any, b: Any) -> Any:
        return self._binary(torch.div, torch._foreach_div, a, b, True, False)

    def lerp(self, a: Any, b: Any, weight: Any) -> Any:
        weight = self._number(weight)
        if isinstance(a, list) and isinstance(b, list) and self._scalar(weight, False):
            return list(torch._foreach_lerp(a, b, weight))
        return self._each(torch.lerp, a, b, weight)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return self._each(torch.where, cond, a, b)

    def maximum(self, a: Any, b: Any) -> Any:
        if isinstance(a, list) and isinstance(b, list):
            return list(torch._foreach_maximum(a, b))
        return self._each(torch.maximum, a, b)

    def sqrt(self, a: Any) -> Any:
        return list(torch._foreach_sqrt(a))

    def sign(self, a: Any) -> Any:
        return list(torch._foreach_sign(a))

    def abs(self, a: Any) -> Any:
        return list(torch._foreach_abs(a))

    def neg(self, a: Any) -> Any:
        return list(torch._foreach_neg(a))

    def _inplace(
        self, many: Callable[..., Any], method: str, a: Any, b: Any, tensor_ok: bool
    ) -> Any:
        if not tensor_ok:
            b = self._number(b)
        if isinstance(b, list) or self._scalar(b, tensor_ok):
            many(a, b)
        else:
            for t in a:
                getattr(t, method)(b)
        return a

    def add_(self, a: Any, b: Any) -> Any:
        return self._inplace(torch._foreach_add_, "add_", a, b, True)

    def sub_(self, a: Any, b: Any) -> Any:
        return self._inplace(torch._foreach_sub_, "sub_", a, b, False)

    def mul_(self, a: Any, b: Any) -> Any:
        return self._inplace(torch._foreach_mul_, "mul_", a, b, True)

    def release(self, a: Any) -> None:
        pass


LISTS = Lists()


__all__ = ["LISTS", "PLAIN", "Lists", "Ops"]
