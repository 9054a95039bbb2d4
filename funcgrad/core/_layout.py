"""Where each tensor of a :class:`funcgrad.Flat` lies: :class:`Layout` (names, buffer,
offset and shape of each entry, interned so that equal layouts are one object) and the
policy that cuts a module's parameters into buffers (:data:`CPU_BUCKET_BYTES`,
:data:`CPU_ALONE_BYTES`).
funcgrad/core/_flat.py holds the mapping itself.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

CPU_BUCKET_BYTES = 16 * 2**20
"""The most bytes of one CPU buffer (a tensor larger than that gets one of its own).

glibc serves an allocation of more than its ``mmap`` threshold (raised as large
blocks are freed, up to 32 MiB) with a fresh ``mmap`` whose every page faults on
first write, each time. A buffer's temporaries under ``torch.compile`` (the flat
gradient, ``cat`` of the per-tensor gradients) are allocated every step, so one huge
buffer made an update-heavy step slower than one tensor per parameter
(docs/compile-notes.md, "Figures behind the code"). Buffers of at
most 16 MiB are reused from the heap; a tensor larger than that is its own buffer, so
its gradient is never copied. CUDA's caching allocator reuses memory: one buffer per
(device, dtype) there."""

CPU_ALONE_BYTES = 2**20
"""On the CPU a tensor of at least this many bytes is a buffer of its own.

Under inductor on the CPU a ``cat`` is always a buffer written whole, so a compiled
step reads a packed gradient (or a rule's output packed for the update) from a copy:
two more passes over those bytes, where per tensor the rule fuses into the update's
loop. For small tensors that is cheap next to what the flat layout saves (fewer
kernels, shorter compiles, one op per buffer eagerly); for large ones it is not: a
compiled update-heavy step with four 4 MiB matrices to a buffer took 1.9-3.4x the
per-tensor one, 1.01x with each alone (docs/flat-layout.md, docs/compile-notes.md). A
tensor alone in its buffer is never copied."""


def _unit_key(item: tuple[str, Tensor]) -> tuple[Any, ...]:
    """Names with one key in a row are one module's own parameters of one kind."""
    name, t = item
    return (name.rpartition(".")[0], t.device, t.dtype)


class Layout:
    """Where each name lives: ``(buffer index, offset, shape)``; interned, hashable.

    Two layouts with the same entries are the same object (:meth:`of`), so a
    compiled step guarding on it never recompiles for an equal one.
    """

    __slots__ = ("__weakref__", "entries", "index", "members", "names", "sizes", "starts")
    # Weak values: a layout lives while a Flat, a state or a compiled step holds it
    # (it was a plain dict: every layout ever made stayed, an unbounded strong cache).
    _interned: ClassVar[weakref.WeakValueDictionary[tuple[Any, ...], Layout]] = (
        weakref.WeakValueDictionary()
    )

    names: tuple[str, ...]
    entries: tuple[tuple[int, int, tuple[int, ...]], ...]
    sizes: tuple[int, ...]
    index: dict[str, int]
    members: tuple[tuple[str, ...], ...]
    starts: dict[tuple[int, int], int]

    @classmethod
    def of(
        cls, names: Sequence[str], entries: Sequence[tuple[int, int, tuple[int, ...]]]
    ) -> Layout:
        key = (tuple(names), tuple((b, o, tuple(s)) for b, o, s in entries))
        found = cls._interned.get(key)
        if found is not None:
            return found
        self = object.__new__(cls)
        self.names, self.entries = key
        count = 1 + max((b for b, _, _ in self.entries), default=-1)
        sizes = [0] * count
        for b, o, s in self.entries:
            sizes[b] = max(sizes[b], o + math.prod(s))
        self.sizes = tuple(sizes)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.members = tuple(
            tuple(n for n, (i, _, _) in zip(self.names, self.entries, strict=True) if i == b)
            for b in range(count)
        )
        self.starts = {}  # (buffer, offset) -> position in members[buffer] of the first there
        for b, names in enumerate(self.members):
            for i, n in enumerate(names):
                self.starts.setdefault((b, self.entries[self.index[n]][1]), i)
        cls._interned[key] = self
        return self

    @classmethod
    def for_tensors(cls, named: Mapping[str, Tensor]) -> Layout:
        """Buffers per (device, dtype), in the order of first appearance; each
        buffer's entries in the mapping's order, packed without gaps.

        On a CUDA device (or any but the CPU) one buffer per (device, dtype). On the
        CPU a tensor of :data:`CPU_ALONE_BYTES` or more is a buffer of its own (the
        open buffer stays open for the tensors after it); the others share buffers
        of at most :data:`CPU_BUCKET_BYTES`, a module's own parameters (names
        sharing the prefix before the last dot) in one buffer where they fit: see
        those two constants for why."""
        kinds: dict[tuple[torch.device, torch.dtype], int] = {}  # kind -> open buffer
        fill: list[int] = []  # bytes per buffer
        entries: list[tuple[int, int, tuple[int, ...]]] = []
        items = list(named.items())
        i = 0
        while i < len(items):
            t = items[i][1]
            kind = (t.device, t.dtype)
            j = i + 1  # items[i:j]: one module's own parameters of this kind, in a row
            while j < len(items) and _unit_key(items[j]) == _unit_key(items[i]):
                j += 1
            cpu = t.device.type == "cpu"
            cap = CPU_BUCKET_BYTES if cpu else None
            size = t.element_size()
            unit = items[i:j]
            big = cpu and any(u.numel() * size >= CPU_ALONE_BYTES for _, u in unit)
            nbytes = sum(u.numel() for _, u in unit) * size
            parts = [unit] if cap is None or (nbytes <= cap and not big) else [[x] for x in unit]
            for part in parts:
                nbytes = sum(u.numel() for _, u in part) * size
                b = kinds.get(kind)
                if cpu and nbytes >= CPU_ALONE_BYTES:  # its own buffer; the open one stays open
                    b = len(fill)
                    fill.append(0)
                elif b is None or (cap is not None and fill[b] > 0 and fill[b] + nbytes > cap):
                    b = kinds[kind] = len(fill)
                    fill.append(0)
                for _, u in part:
                    entries.append((b, fill[b] // size, tuple(u.shape)))
                    fill[b] += u.numel() * size
            i = j
        return cls.of([n for n, _ in items], entries)

    def names_in(self, b: int) -> tuple[str, ...]:
        """The names in buffer ``b``, in order."""
        return self.members[b]

    def segment(self, names: Sequence[str]) -> tuple[int, int, int] | None:
        """``(buffer, start, stop)`` if ``names`` are, in this order, one gap-free run
        of one buffer; else None."""
        if not names or any(n not in self.index for n in names):
            return None
        first = self.entries[self.index[names[0]]]
        b, start = first[0], first[1]
        at = start
        for n in names:
            i, o, s = self.entries[self.index[n]]
            if i != b or o != at:
                return None
            at += math.prod(s)
        return b, start, at

    def run(self, b: int, start: int, stop: int) -> tuple[str, ...] | None:
        """The names whose entries tile ``[start, stop)`` of buffer ``b`` exactly, in
        order (the inverse of :meth:`segment`); None if no run of entries does. Reads
        only the entries in the range (traced code runs it once per group)."""
        i = self.starts.get((b, start))
        if i is None:
            return () if start == stop else None
        names, out, at = self.members[b], [], start
        while i < len(names):
            _, o, shape = self.entries[self.index[names[i]]]
            if o >= stop:
                break
            if o != at:
                return None
            out.append(names[i])
            at += math.prod(shape)
            i += 1
        return tuple(out) if at == stop else None

    def __repr__(self) -> str:
        return f"Layout({len(self.names)} tensors in {len(self.sizes)} buffer(s))"

    def __reduce__(self) -> Any:  # pickles (deepcopy) as the interned object
        return (Layout.of, (self.names, self.entries))


__all__ = ["CPU_ALONE_BYTES", "CPU_BUCKET_BYTES", "Layout"]
