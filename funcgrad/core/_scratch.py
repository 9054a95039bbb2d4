"""Buffers lent to one eager, donated training step and taken back after its commit.

On the CPU a fresh tensor of more than 128 KiB is a fresh ``mmap``: the first write
to each page faults. An eager Adam update that allocates its results every step (new
moments, the update, temporaries) took several times as long as the same operations
writing into buffers kept from the previous step (docs/compile-notes.md, "Figures
behind the code"). A
donated step copies every result into the given tensors at commit, after which the
results are dead: :class:`Scratch` keeps them for the next step. Only code that runs
inside :func:`lending` (the eager donated step) borrows, and only for CPU tensors
(CUDA's caching allocator already reuses memory). The price: the borrowed buffers
stay allocated between steps (Adam: four per large parameter).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import Tensor

from .._compat import compiling

BIG = 32768
"""Entries from which a tensor is borrowed rather than allocated (128 KiB of float32,
glibc's default ``mmap`` threshold); smaller ones stay on the multi-tensor path."""


class Scratch:
    """Free buffers by (shape, dtype, device), and those lent during the current step."""

    def __init__(self) -> None:
        self.free: dict[tuple[tuple[int, ...], torch.dtype, torch.device], list[Tensor]] = {}
        self.lent: list[Tensor] = []

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialized tensor of ``shape``, ``dtype`` on ``device``."""
        key = (shape, dtype, device)
        pool = self.free.get(key)
        t = pool.pop() if pool else torch.empty(shape, dtype=dtype, device=device)
        self.lent.append(t)
        return t

    def release(self, t: Tensor) -> None:
        """Take back ``t``, lent during this step and read no more, for this step's
        next borrower (a kernel's temporary); anything else is left alone."""
        for i, lent in enumerate(self.lent):
            if lent is t:
                del self.lent[i]
                self.free.setdefault((tuple(t.shape), t.dtype, t.device), []).append(t)
                return

    def reclaim(self) -> None:
        """Take back everything lent: call only once nothing refers to it any more."""
        for t in self.lent:
            self.free.setdefault((tuple(t.shape), t.dtype, t.device), []).append(t)
        self.lent.clear()

    def forget(self) -> None:
        """Drop what was lent (after a failed step, whose results may still be seen)."""
        self.lent.clear()


_ACTIVE: contextvars.ContextVar[Scratch | None] = contextvars.ContextVar(
    "funcgrad_scratch", default=None
)


@contextlib.contextmanager
def lending(scratch: Scratch) -> Iterator[None]:
    """While on, :func:`borrowing` returns ``scratch`` in this context (thread, task)."""
    token = _ACTIVE.set(scratch)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def borrowing(like: Tensor) -> Scratch | None:
    """The scratch to borrow from for tensors like ``like``, or None: allocate. Traced,
    always None (checked first: dynamo does not trace ``ContextVar.get``)."""
    if compiling() or like.device.type != "cpu":
        return None
    return _ACTIVE.get()
