"""How ``fg.sharded`` cuts tensors across ranks (funcgrad/distributed/_sharded.py runs
the step): :class:`Rows` (a rank's rows of each tensor), :class:`Ranks` (each tensor
along its first dimension, as ``torch.chunk`` and ``DTensor``'s ``Shard(0)``) and
:class:`Chunks` (each flat buffer in equal chunks, as ZeRO), with the collectives
each needs; and the record/replay of the batched per-group statistics a rule takes on
the rank's part (``_Record``, ``_Replay``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _compat
from ..core import _flat
from ..core._base import Params
from ..core._shards import active
from ._all_reduce import GroupRef, by_dtype

T = TypeVar("T")


class Rows:
    """Which rows of a tensor of ``shape`` rank ``rank`` of ``world`` holds."""

    def __init__(self, shape: tuple[int, ...], rank: int, world: int) -> None:
        self.shape = tuple(shape)
        self.d0 = self.shape[0] if self.shape else 1
        self.rest = self.shape[1:]
        self.row = math.prod(self.rest)
        self.chunk = -(-self.d0 // world)
        self.world = world
        self.start = min(rank * self.chunk, self.d0)
        self.stop = min(self.start + self.chunk, self.d0)

    def local(self, t: Tensor) -> Tensor:
        """This rank's rows of the whole tensor ``t`` (a view)."""
        return t.reshape(self.d0, *self.rest)[self.start : self.stop]

    def padded(self, t: Tensor) -> Tensor:
        """The whole ``t`` as ``[world, chunk * row]``: row block ``r`` is rank ``r``'s."""
        v = t.reshape(self.d0, self.row)
        pad = self.world * self.chunk - self.d0
        if pad:
            v = torch.cat([v, v.new_zeros(pad, self.row)])
        return v.reshape(self.world, self.chunk * self.row)

    def pad_local(self, piece: Tensor) -> Tensor:
        """This rank's rows, padded to ``chunk`` rows, flat."""
        flat = piece.reshape(-1)
        pad = self.chunk * self.row - flat.numel()
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def unpad_local(self, flat: Tensor) -> Tensor:
        """Inverse of :meth:`pad_local`."""
        return flat.reshape(self.chunk, *self.rest)[: self.stop - self.start]

    def whole(self, blocks: Tensor) -> Tensor:
        """``[world, chunk * row]`` row blocks back to the whole tensor."""
        return blocks.reshape(self.world * self.chunk, *self.rest)[: self.d0].reshape(self.shape)


class _Record:
    """The first pass of :meth:`Ranks.batched`: keeps each partial, answers locally."""

    def __init__(self, ranks: Cut) -> None:
        self.ranks = ranks
        self.partials: list[Tensor] = []
        self.kinds: list[str] = []

    def any(self, flag: Tensor) -> Tensor:
        self.partials.append(flag.to(torch.float64))
        self.kinds.append("any")
        return flag

    def sum(self, partial: Tensor) -> Tensor:
        self.partials.append(partial.to(torch.float64))
        self.kinds.append("sum")
        return partial

    def numel(self, name: str) -> int:
        return self.ranks.numel(name)

    def on_whole(
        self, fn: Callable[[dict[str, Tensor]], dict[str, Tensor]], group: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        return self.ranks.on_whole(fn, group)

    def batched(self, fn: Callable[[], T]) -> T:
        return fn()


class _Replay(_Record):
    """The second pass: answers each statistic, in the same order, with its total."""

    def __init__(self, ranks: Cut, totals: Tensor, kinds: list[str]) -> None:
        super().__init__(ranks)
        self.totals, self.expected, self.i = totals, kinds, 0

    def _next(self, kind: str) -> Tensor:
        if self.i >= len(self.expected) or self.expected[self.i] != kind:
            raise RuntimeError(
                "fg.sharded: a rule took other statistics on its second pass than on its "
                "first. Rules must be pure functions of their group; one that is not must "
                "not be marked as funcgrad's own."
            )
        self.i += 1
        return self.totals[self.i - 1]

    def any(self, flag: Tensor) -> Tensor:
        return self._next("any") > 0

    def sum(self, partial: Tensor) -> Tensor:
        return self._next("sum").to(partial.dtype)

    def done(self) -> None:
        if self.i != len(self.expected):
            self._next("(none)")


class Cut:
    """The ranks of one process group, and how statistics combine over them (the
    protocol of ``core._shards.Shards``); subclasses say which entries a rank holds."""

    def __init__(self, group: Any) -> None:
        ref = GroupRef(group)
        ref.refresh()  # made eagerly, in init: the traced code reads the name alone
        self.ref = ref
        self.pg: str = ref.name  # type: ignore[assignment]
        self.rank = dist.get_rank(group)
        self.world = ref.world

    @property
    def group(self) -> Any:
        """The group passed (``None``: the world), for eager ``torch.distributed`` calls."""
        return self.ref.group

    # In a group of one rank every collective is the identity: none is issued (the
    # rank holds everything), so fg.sharded there costs what tx costs.

    def any(self, flag: Tensor) -> Tensor:
        fc = _compat.functional_collectives()

        if self.world == 1:
            return flag
        return fc.all_reduce(flag.to(torch.int32), "max", self.pg) > 0

    def sum(self, partial: Tensor) -> Tensor:
        fc = _compat.functional_collectives()

        return partial if self.world == 1 else fc.all_reduce(partial, "sum", self.pg)

    def batched(self, fn: Callable[[], T]) -> T:
        """``fn()`` with all its statistics combined in one all-reduce instead of one
        each: run once recording the local partials (under compile, everything but
        the partials is dead code), sum them all at once (in float64: counts stay
        exact, "any" becomes a count of ranks), and run again with the totals."""
        if self.world == 1:
            return fn()
        record = _Record(self)
        with active(record):
            fn()
        if not record.partials:
            return fn()
        replay = _Replay(self, self.sum(torch.stack(record.partials)), record.kinds)
        with active(replay):
            out = fn()
        replay.done()
        return out

    def on_whole(
        self, fn: Callable[[dict[str, Tensor]], dict[str, Tensor]], group: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """``fn`` on the whole group gathered from all ranks; this rank's part of it."""
        whole = self.gather_names(group)
        with active(None):  # fn sees whole tensors: nothing more to combine
            out = fn(whole)
        return self.local(out)

    def numel(self, name: str) -> int:
        raise NotImplementedError

    def local(self, tree: Mapping[str, Tensor]) -> Any:
        raise NotImplementedError

    def gather_names(self, pieces: Mapping[str, Tensor]) -> dict[str, Tensor]:
        raise NotImplementedError


class Ranks(Cut):
    """Rows: rank ``r`` holds its rows of every tensor (:class:`Rows`)."""

    def __init__(self, group: Any, shapes: Mapping[str, tuple[int, ...]]) -> None:
        super().__init__(group)
        self.rows = {k: Rows(s, self.rank, self.world) for k, s in shapes.items()}

    def numel(self, name: str) -> int:
        return math.prod(self.rows[name].shape)

    def same_shapes(self, grads: Params) -> bool:
        return grads.keys() == self.rows.keys() and all(
            tuple(g.shape) == self.rows[k].shape for k, g in grads.items()
        )

    def key(self) -> tuple[Any, ...]:
        return ("rows", tuple((k, rows.shape) for k, rows in self.rows.items()))

    # ---- moving rows
    def scatter_mean(self, grads: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The mean over ranks of ``grads``, this rank's rows: one reduce-scatter per dtype."""
        fc = _compat.functional_collectives()

        if self.world == 1:
            return self.local(grads)
        out: dict[str, Tensor] = {}
        for names in by_dtype(grads):
            blocks = torch.cat([self.rows[k].padded(grads[k]) for k in names], dim=1)
            mine = fc.reduce_scatter_single(blocks.reshape(-1), "sum", 0, self.pg) / self.world
            sizes = [self.rows[k].chunk * self.rows[k].row for k in names]
            for k, flat in zip(names, mine.split(sizes), strict=True):
                out[k] = self.rows[k].unpad_local(flat)
        return {k: out[k] for k in grads}

    def gather(self, pieces: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The whole tensors from every rank's rows: one all-gather per dtype."""
        fc = _compat.functional_collectives()

        if self.world == 1:
            return {k: self.rows[k].whole(p) for k, p in pieces.items()}
        out: dict[str, Tensor] = {}
        for names in by_dtype(pieces):
            mine = torch.cat([self.rows[k].pad_local(pieces[k]) for k in names])
            blocks = fc.all_gather_single(mine, 0, self.pg).reshape(self.world, -1)
            sizes = [self.rows[k].chunk * self.rows[k].row for k in names]
            for k, b in zip(names, blocks.split(sizes, dim=1), strict=True):
                out[k] = self.rows[k].whole(b)
        return {k: out[k] for k in pieces}

    gather_names = gather

    def local(self, tree: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {k: self.rows[k].local(t) for k, t in tree.items()}


class Chunks(Cut):
    """Equal chunks of the flat buffers, as ZeRO splits them: of a buffer of ``n``
    entries rank ``r`` of ``N`` holds entries ``[r*c, min((r+1)*c, n))``,
    ``c = ceil(n / N)``. ``tx`` sees a :class:`funcgrad.Flat` over the rank's chunks,
    whose entry for each name is that tensor's piece of the chunk: a 1-D run of its
    flattened entries, possibly empty. One reduce-scatter and one all-gather per
    buffer; every statistic a rule takes combines across ranks as with rows."""

    def __init__(self, group: Any, layout: _flat.Layout) -> None:
        super().__init__(group)
        self.whole = layout
        self.chunk = [-(-n // self.world) for n in layout.sizes]
        self.shapes = {n: s for n, (_, _, s) in zip(layout.names, layout.entries, strict=True)}
        self.mine = self.layout_of(self.rank)

    def span(self, rank: int, b: int) -> tuple[int, int]:
        """The entries ``[lo, hi)`` of buffer ``b`` that ``rank`` holds."""
        n, c = self.whole.sizes[b], self.chunk[b]
        return min(rank * c, n), min(rank * c + c, n)

    def piece(self, rank: int, name: str) -> tuple[int, int]:
        """The run ``[a, e)`` of ``name``'s flattened entries that ``rank`` holds."""
        b, o, s = self.whole.entries[self.whole.index[name]]
        lo, hi = self.span(rank, b)
        n = math.prod(s)
        return min(max(lo - o, 0), n), min(max(hi - o, 0), n)

    def layout_of(self, rank: int) -> _flat.Layout:
        """The layout of ``rank``'s chunks: each name's piece, 1-D, where it lies."""
        entries = []
        for name, (b, o, _) in zip(self.whole.names, self.whole.entries, strict=True):
            a, e = self.piece(rank, name)
            lo, hi = self.span(rank, b)
            entries.append((b, min(max(o, lo), hi) - lo, (e - a,)))
        return _flat.Layout.of(self.whole.names, entries)

    def numel(self, name: str) -> int:
        return math.prod(self.shapes[name])

    def same_shapes(self, grads: Params) -> bool:
        if isinstance(grads, _flat.Flat):
            return grads.layout is self.whole
        return list(grads) == list(self.whole.names) and all(
            tuple(g.shape) == self.shapes[k] for k, g in grads.items()
        )

    def key(self) -> tuple[Any, ...]:
        return ("chunks", self.whole)

    def local(self, tree: Mapping[str, Tensor]) -> Any:  # a Flat in self.mine
        """This rank's chunks of ``tree`` (whole tensors, any layout): views of a
        :class:`funcgrad.Flat` in ``self.whole``; a plain dict of pieces otherwise."""
        if isinstance(tree, _flat.Flat) and tree.layout is self.whole:
            spans = [self.span(self.rank, b) for b in range(len(tree.buffers))]
            chunks = [t[lo:hi] for t, (lo, hi) in zip(tree.buffers, spans, strict=True)]
            return _flat.Flat(chunks, self.mine)
        out = {}
        for k, t in tree.items():
            a, e = self.piece(self.rank, k)
            out[k] = t.reshape(-1)[a:e]
        return out

    def scatter_mean(self, grads: Mapping[str, Tensor]) -> Any:  # a Flat in self.mine
        """The mean over ranks of ``grads``, this rank's chunks: one reduce-scatter
        per buffer."""
        fc = _compat.functional_collectives()

        whole = _flat.pack(grads, self.whole)
        if self.world == 1:
            return self.local(whole)
        out = []
        for b, buf in enumerate(whole.buffers):
            lo, hi = self.span(self.rank, b)
            padded = _pad(buf, self.world * self.chunk[b])
            mine = fc.reduce_scatter_single(padded, "sum", 0, self.pg) / self.world
            out.append(mine[: hi - lo])
        return _flat.Flat(out, self.mine)

    def gather(self, pieces: Mapping[str, Tensor]) -> Any:  # a Flat in self.whole
        """The whole buffers from every rank's chunks: one all-gather per buffer."""
        fc = _compat.functional_collectives()

        mine = _flat.pack(pieces, self.mine)
        if self.world == 1:
            return _flat.Flat(mine.buffers, self.whole)
        out = []
        for b, buf in enumerate(mine.buffers):
            every = fc.all_gather_single(_pad(buf, self.chunk[b]), 0, self.pg)
            out.append(every[: self.whole.sizes[b]])
        return _flat.Flat(out, self.whole)

    def gather_names(self, pieces: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Whole tensors from every rank's pieces of them: one all-gather per name
        (for what needs a few whole tensors: a rule that is not shard-safe, a
        checkpoint)."""
        fc = _compat.functional_collectives()

        out = {}
        for k, piece in pieces.items():
            runs = [self.piece(r, k) for r in range(self.world)]
            if self.world == 1:
                every = piece.reshape(1, -1)
            else:
                longest = max(e - a for a, e in runs)
                every = fc.all_gather_single(_pad(piece.reshape(-1), longest), 0, self.pg)
                every = every.reshape(self.world, longest)
            parts = [every[r, : e - a] for r, (a, e) in enumerate(runs)]
            out[k] = torch.cat(parts).reshape(self.shapes[k])
        return out


def _pad(t: Tensor, n: int) -> Tensor:
    """1-D ``t`` with zeros appended up to ``n`` entries."""
    return torch.cat([t, t.new_zeros(n - t.shape[0])]) if n > t.shape[0] else t


__all__ = ["Chunks", "Cut", "Ranks", "Rows"]
