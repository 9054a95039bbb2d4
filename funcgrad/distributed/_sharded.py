"""Sharded optimizer state (ZeRO-2) as a transformation: :func:`sharded`.

Each rank holds a part of every gradient, update and state tensor, cut one of two ways:

- :class:`Chunks`, for a :class:`funcgrad.Flat` (``fg.params``) when every part of
  ``tx`` works entry by entry without reading shapes (``_base.is_by_entry``): each
  flat buffer in equal chunks, as ZeRO cuts it; a tensor's piece is a 1-D run of its
  entries.
- :class:`Ranks` otherwise: each tensor along its first dimension the way
  ``torch.chunk`` (and so ``DTensor``'s ``Shard(0)``) splits it: rank ``r`` of ``N``
  holds rows ``[r*c, min((r+1)*c, d0))`` with ``c = ceil(d0 / N)``; a 0-d tensor
  counts as one row. Rows keep the trailing shape.

Either way a checkpoint describes each tensor as a ``DTensor`` of its whole shape
split by rows (``torch.distributed.checkpoint`` then reshards it to any number of
ranks and either cut; ``funcgrad/distributed/_checkpoint.py``).

One step, per rank:

1. the gradients go out in one reduce-scatter per buffer (chunks) or dtype (rows,
   each tensor padded to ``N*c`` rows); the rank keeps the mean of its part;
2. ``tx`` runs on that part with the rank's part of the parameters and its own
   state. Every per-group statistic it takes through funcgrad's conditions
   (``funcgrad.rules._rule_base``) is combined across ranks with one small all-reduce, so
   a rule decides on the global gradient (see that module's docstring);
3. the updates come back in one all-gather per buffer or dtype, and every rank
   returns the same full updates.

All collectives are ``torch.distributed._functional_collectives``: traced into the
compiled step as graph ops, one graph per rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _compat
from ..core import _flat
from ..core._base import (
    GradientTransformation,
    Params,
    State,
    check_state,
    params_device,
    require_transformation,
    wrapping,
)
from ..core._compose import refuse_transforms
from ..core._tree import flatten
from ..rules import _rule_base as _rb
from ._all_reduce import GroupRef, by_dtype, initialized

T = TypeVar("T")


class ShardedState(NamedTuple):
    """``inner``: the wrapped transformation's state, for this rank's rows only."""

    inner: State


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

    def __init__(self, ranks: _Group) -> None:
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

    def __init__(self, ranks: _Group, totals: Tensor, kinds: list[str]) -> None:
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


class _Group:
    """The ranks of one process group, and how statistics combine over them (the
    protocol of ``_rule_base.Shards``); subclasses say which entries a rank holds."""

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
        with _rb.active(record):
            fn()
        if not record.partials:
            return fn()
        replay = _Replay(self, self.sum(torch.stack(record.partials)), record.kinds)
        with _rb.active(replay):
            out = fn()
        replay.done()
        return out

    def on_whole(
        self, fn: Callable[[dict[str, Tensor]], dict[str, Tensor]], group: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """``fn`` on the whole group gathered from all ranks; this rank's part of it."""
        whole = self.gather_names(group)
        with _rb.active(None):  # fn sees whole tensors: nothing more to combine
            out = fn(whole)
        return self.local(out)

    def numel(self, name: str) -> int:
        raise NotImplementedError

    def local(self, tree: Mapping[str, Tensor]) -> Any:
        raise NotImplementedError

    def gather_names(self, pieces: Mapping[str, Tensor]) -> dict[str, Tensor]:
        raise NotImplementedError


class Ranks(_Group):
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


class Chunks(_Group):
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


def _initialized(who: str) -> None:
    if not initialized():
        raise RuntimeError(
            f"{who}: torch.distributed is not initialized, so there are no ranks to shard "
            "the state over. Call torch.distributed.init_process_group(...) first (torchrun "
            "sets the environment for init_process_group('gloo') or ('nccl')); in a single "
            "process, use tx itself."
        )


def _signature(params: Params, whole_state: State) -> list[tuple[str, str]]:
    """What every rank must agree on: parameter names, shapes, dtypes and values
    (checksums), and the structure of ``tx``'s unsharded state (another
    transformation makes another one)."""
    sig = [(f"parameter '{k}'", f"{tuple(p.shape)} {p.dtype}") for k, p in params.items()]
    if params:  # sum and sum of squares per tensor, one host read for all
        sums = torch.stack(
            [torch.stack([p.double().sum(), p.double().square().sum()]) for p in params.values()]
        ).tolist()
        for k, (s1, s2) in zip(params, sums, strict=True):
            sig.append((f"the values of parameter '{k}'", f"checksums ({s1!r}, {s2!r})"))
    accessors, leaves, _ = flatten(whole_state)
    for a, leaf in zip(accessors, leaves, strict=True):
        what = f"{tuple(leaf.shape)} {leaf.dtype}" if isinstance(leaf, Tensor) else repr(leaf)
        sig.append((f"tx's state entry {a.codify('state')}", what))
    return sig


def _check_same_on_all_ranks(ranks: _Group, sig: list[tuple[str, str]]) -> None:
    """Compare every rank's signature with rank 0's; the same error on every rank."""
    every: list[Any] = [None] * ranks.world
    dist.all_gather_object(every, sig, group=ranks.group)
    ref = dict(every[0])
    for r, other in enumerate(every[1:], start=1):
        theirs = dict(other)
        for what in list(ref) + [w for w in theirs if w not in ref]:
            if ref.get(what) != theirs.get(what):
                a, b = ref.get(what, "no such entry"), theirs.get(what, "no such entry")
                raise ValueError(
                    f"fg.sharded.init: rank {r} differs from rank 0 at {what}: rank 0 has "
                    f"{a}, rank {r} has {b}. Every rank must build the same model with the "
                    "same initial values (same seed, or broadcast rank 0's parameters with "
                    "torch.distributed.broadcast) and the same transformation before the "
                    "first step; otherwise the ranks would train different models, or the "
                    "collectives of the step would not match."
                )


class Layout(NamedTuple):
    """What a checkpoint needs to describe the shards: the group, and for each leaf of
    ``tx``'s state (optree order) its whole shape if it is split like the
    parameters, else None; with flat chunks, also the parameter each split leaf
    belongs to (its piece of the chunk is that parameter's)."""

    ranks: Ranks | Chunks
    whole: list[tuple[int, ...] | None]
    device: torch.device
    names: list[str | None]


def _leaf_layout(
    tx: GradientTransformation, params: Params, ranks: Ranks | Chunks
) -> tuple[list[tuple[int, ...] | None], list[str | None], State]:
    """Init ``tx`` on shape-only parameters twice, once with one more entry in each
    (a row, or with flat chunks one more entry of a 1-D piece): the state leaves
    whose shape follows are split like the parameters. Also returns, per leaf, the
    parameter it belongs to (flat chunks), and the (shape-only) unsharded state."""
    if isinstance(ranks, Chunks):
        dtypes = [b.dtype for b in params.buffers]  # type: ignore[attr-defined]

        def meta(extra: int) -> Params:
            entries, fill = [], [0] * len(dtypes)
            for b, _, shape in ranks.whole.entries:
                shape = (math.prod(shape) + 1,) if extra else shape
                entries.append((b, fill[b], shape))
                fill[b] += math.prod(shape)
            lay = _flat.Layout.of(ranks.whole.names, entries)
            sizes = zip(lay.sizes, dtypes, strict=True)
            bufs = [torch.empty(n, dtype=d, device="meta") for n, d in sizes]
            return _flat.Flat(bufs, lay)  # type: ignore[return-value]
    else:

        def meta(extra: int) -> Params:
            out = {}
            for k, p in params.items():
                d0 = p.shape[0] if p.dim() else 1
                shape = (d0 + extra, *p.shape[1:]) if p.dim() or extra else ()
                out[k] = torch.empty(shape, dtype=p.dtype, device="meta")
            return out

    whole_state = tx.init(meta(0))
    accessors, whole, _ = flatten(whole_state)
    _, probe, _ = flatten(tx.init(meta(1)))
    kinds: list[tuple[int, ...] | None] = []
    names: list[str | None] = []
    for a, w, p in zip(accessors, whole, probe, strict=True):
        split = isinstance(w, Tensor) and isinstance(p, Tensor) and w.shape != p.shape
        kinds.append(tuple(w.shape) if split else None)
        name = a[-1].entry if split and len(a) else None
        if split and isinstance(ranks, Chunks) and name not in ranks.shapes:
            raise TypeError(
                f"fg.sharded: tx's state entry {a.codify('state')} follows the parameters' "
                "shapes but is not keyed by a parameter name, so it cannot be split into "
                "flat chunks. Pass parameters that are not a funcgrad.Flat (dict(params)) "
                "to split it by rows instead."
            )
        names.append(name if split else None)
    return kinds, names, whole_state


def sharded(
    tx: GradientTransformation, group: Any = None, *, assume_shardable: bool = False
) -> GradientTransformation:
    """``tx`` with its state split across the ranks of ``group`` (ZeRO-2).

    Each rank keeps ``tx``'s state for its part of the parameters only (1/N of it):
    for ``fg.params(model)``, an equal chunk of each flat buffer (as ZeRO cuts it;
    ``tx`` then sees each tensor's piece as a 1-D run of entries); for a plain dict,
    or a ``tx`` that reads shapes (``fg.adafactor``, ``fg.muon``, a mask or labels
    given as a function), its rows of every tensor. The mean gradient is
    reduce-scattered, ``tx`` runs on the rank's part with
    every per-group statistic (``all_zero``, zero counts, norms, ``monitor``,
    ``clip_by_global_norm``, ``skip_if_nonfinite``) combined across ranks, and the
    updates are all-gathered, so every rank ends the step with the same full
    parameters. The result equals ``tx`` on the global batch in one process.

    Replaces ``fg.all_reduce_mean`` (which would average twice): put
    ``fg.sharded(...)`` around the whole chain. Parameters stay whole on every rank
    (ZeRO-2, not FSDP's sharded parameters).

    Rules from ``fg.rules`` run on each rank's rows. A rule of your own that is not a
    ``fg.rules.Rule(..., shard_safe=True)`` is applied by ``fg.per_group`` to the whole
    group, gathered from all ranks. ``tx`` may only contain funcgrad's transformations
    (they are elementwise on the rows); a transformation of your own (``fg.stateless``
    or a custom ``GradientTransformation``) is an error unless you pass
    ``assume_shardable=True`` after checking that each of its output entries depends
    only on the same entry of its inputs. Split by rows, ``tx`` sees
    ``(rows, *trailing shape)`` pieces, and a 0-d parameter as a 1-d piece of 0 or 1
    rows: masks and labels given as functions of tensors see the pieces.

    Checkpoints: ``fg.state_dict(state)`` gives ``DTensor`` s of the whole shapes, for
    ``torch.distributed.checkpoint``; see ``docs/distributed.md``.

    Args:
        tx: the transformation to shard, usually the whole chain (rules, then Adam).
        group: a ``ProcessGroup``; ``None`` means the default (world) group.
        assume_shardable: skip the check that ``tx`` is made of funcgrad's
            transformations.

    Example (two processes, e.g. ``torchrun --nproc_per_node=2``)::

        tx = fg.sharded(fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adam()))
        state = tx.init(params)       # each rank: its chunk of mu and nu
        step = fg.make_step(loss_fn, tx, compile=True, donate=True)

    Runnable in one process (a group of one rank, which holds all the rows):

        >>> import torch, torch.distributed as dist, funcgrad as fg
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> try:
        ...     rule = fg.per_group(fg.rules.zero_fix(), {"layer": ["w"]})
        ...     tx = fg.sharded(fg.chain(rule, fg.adam(lr=0.1)))
        ...     params = {"w": torch.ones(2)}
        ...     state = tx.init(params)
        ...     updates, state = tx.update({"w": torch.tensor([0.0, -1.0])}, state, params)
        ... finally:
        ...     dist.destroy_process_group()
        >>> type(state).__name__, updates["w"]  # the zero became 0.5, then Adam's sign step
        ('ShardedState', tensor([-0.1000,  0.1000]))
    """
    require_transformation(tx, "fg.sharded: tx")
    if tx.facts.averages:
        raise ValueError(
            "fg.sharded: tx contains fg.all_reduce_mean. fg.sharded averages the gradients "
            "itself (a reduce-scatter); averaging twice would divide by the world size "
            "twice. Remove fg.all_reduce_mean from the chain."
        )
    if not (assume_shardable or tx.facts.shardable):
        raise TypeError(
            "fg.sharded: tx contains a transformation that is not known to work on row "
            "shards: one built with fg.stateless, fg.add_noise, or a custom "
            "GradientTransformation. Under fg.sharded each rank sees only its rows of "
            "each gradient, so a transformation that mixes entries (a matrix product, a "
            "sum, a norm not taken through fg.rules) would silently compute something "
            "else. If each output entry of yours depends only on the same entry of its "
            "inputs, pass fg.sharded(tx, assume_shardable=True)."
        )

    # The layout (rows per rank, process group, whole shapes) is fixed per state class:
    # one class per distinct layout, made on first use and reused, so the layout
    # travels in each state's type (its pytree metadata) and never changes under a
    # state. An equal layout gives the same class: a compiled step guards on the
    # type, so a second init (fg.load_state_dict) does not recompile.
    classes: dict[tuple[Any, ...], type[ShardedState]] = {}

    def state_class(layout: Layout) -> type[ShardedState]:
        key = _key(layout)
        cls = classes.get(key)
        if cls is None:

            class State_(ShardedState):
                __slots__ = ()

            State_.layout = layout  # type: ignore[attr-defined]
            State_.__name__ = "ShardedState"
            # Findable by name in this module, as pickle finds a class: torch's
            # compile-without-running (make_step(compile="async") across ranks) pickles
            # the guards' view of the state, types included.
            State_.__qualname__ = f"_ShardedState_{id(State_):x}"
            globals()[State_.__qualname__] = State_
            cls = classes[key] = State_
        return cls

    def init(params: Params) -> ShardedState:
        _initialized("fg.sharded.init")
        refuse_transforms("fg.sharded", params)
        ranks: Ranks | Chunks
        if isinstance(params, _flat.Flat) and tx.facts.by_entry:
            ranks = Chunks(group, params.layout)
        else:
            ranks = Ranks(group, {k: tuple(p.shape) for k, p in params.items()})
        kinds, names, whole_state = _leaf_layout(tx, params, ranks)
        _check_same_on_all_ranks(ranks, _signature(params, whole_state))
        cls = state_class(Layout(ranks, kinds, params_device(params), names))
        return cls(tx.init(cls.layout.ranks.local(params)))  # type: ignore[attr-defined]

    def update(
        grads: Params, state: ShardedState, params: Params | None = None
    ) -> tuple[Params, ShardedState]:
        check_state(state, ShardedState, "fg.sharded")
        refuse_transforms("fg.sharded", grads, params)
        layout: Layout | None = getattr(type(state), "layout", None)
        if layout is None or not layout.ranks.same_shapes(grads):
            raise ValueError(
                "fg.sharded.update: the state was made for other parameters (names or "
                "shapes). Build it with tx.init(params) for the parameters you train."
            )
        ranks = layout.ranks
        rows = ranks.scatter_mean(grads)
        local_params = None if params is None else ranks.local(params)
        with _rb.active(ranks):
            updates, inner = tx.update(rows, state.inner, local_params)
        return ranks.gather(updates), type(state)(inner)

    return wrapping(
        GradientTransformation(init, update),
        tx,
        remake=lambda parts: sharded(parts[0], group, assume_shardable=assume_shardable),
    )


def _key(layout: Layout) -> tuple[Any, ...]:
    r = layout.ranks
    return (r.pg, r.rank, r.world, r.key(), tuple(layout.whole), layout.device)
