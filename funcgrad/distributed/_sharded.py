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
import weakref
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

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
from ..core._shards import active
from ..core._tree import flatten
from ._all_reduce import initialized
from ._split import Chunks, Cut, Ranks

T = TypeVar("T")


class ShardedState(NamedTuple):
    """``inner``: the wrapped transformation's state, for this rank's rows only."""

    inner: State


_CLASSES: weakref.WeakValueDictionary[str, type[ShardedState]] = weakref.WeakValueDictionary()
"""``fg.sharded``'s state classes (one per layout) by the name pickle looks them up
with: torch's compile-without-running (``make_step(compile="async")`` across ranks)
pickles the guards' view of the state, types included. Weak: a class lives as long as
the transformation that made it (docs/internals.md)."""


def __getattr__(name: str) -> type[ShardedState]:
    """A state class by its name (``_ShardedState_<id>``), as pickle finds a class."""
    cls = _CLASSES.get(name)
    if cls is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return cls


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


def _check_same_on_all_ranks(ranks: Cut, sig: list[tuple[str, str]]) -> None:
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
            # Findable by name in this module, as pickle finds a class (_CLASSES)
            State_.__qualname__ = f"_ShardedState_{id(State_):x}"
            _CLASSES[State_.__qualname__] = State_
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
        with active(ranks):
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
