"""Transformations built from rules and groups: per_group (a rule per group) and monitor."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core._base import (
    EmptyState,
    GradientTransformation,
    Params,
    State,
    check_floating,
    shardable,
    with_facts,
)
from ..core._flat import Flat, cat
from ..core._scratch import Scratch
from . import _rule_base as _rb
from . import all_zero, any_nonfinite
from ._groups import Groups, as_groups
from ._rule_base import apply_rule, check_is_rule, group_norm, group_size, zero_count


def per_group(
    rule: Callable[[dict[str, Tensor]], Mapping[str, Tensor]],
    groups: Groups | Mapping[str, Sequence[str]],
) -> GradientTransformation:
    """Apply ``rule`` to each group's gradients; parameters in no group pass through.

    Stateless and branch-free: under ``torch.compile`` the whole thing is part of one
    graph, and under ``torch.func.vmap`` it runs per sample.

    Args:
        rule: a function ``dict[str, Tensor] -> dict[str, Tensor]`` keeping keys,
            shapes and dtypes, e.g. ``fg.rules.zero_fix()``.
        groups: ``fg.Groups`` (or a plain dict ``group -> parameter names``), usually
            from :func:`funcgrad.group_by_module`.

    Examples:
        >>> import torch, funcgrad as fg
        >>> groups = fg.Groups({"fc1": ("fc1.weight", "fc1.bias")})
        >>> tx = fg.per_group(fg.rules.zero_fix(), groups)
        >>> grads = {"fc1.weight": torch.zeros(2), "fc1.bias": torch.zeros(1),
        ...          "fc2.weight": torch.zeros(1)}
        >>> tx.update(grads, tx.init(grads))[0]  # fc2 is in no group: untouched
        {'fc1.weight': tensor([1., 1.]), 'fc1.bias': tensor([1.]), 'fc2.weight': tensor([0.])}
    """
    if isinstance(rule, GradientTransformation):
        raise TypeError(
            "fg.per_group: rule is a GradientTransformation; per_group takes a rule "
            "(dict -> dict), e.g. fg.rules.zero_fix(). Use fg.chain to combine transformations."
        )
    check_is_rule(rule, "fg.per_group: rule")
    groups = as_groups(groups)

    def init(params: Params) -> EmptyState:
        groups.check_against(params, "fg.per_group.init")
        members = {n: params[n] for names in groups.values() for n in names}
        check_floating(members, "fg.per_group.init")
        return EmptyState()

    def update(grads: Params, state: State, params: Params | None = None) -> tuple[Params, State]:
        groups.check_against(grads, "fg.per_group.update")
        ranks = _rb.shards()

        found = _segments(grads, groups) if _rb.reads_input_only(rule) else None
        if found is not None:
            # Flat gradients: funcgrad's rules are elementwise but for statistics over
            # the whole group, so each group is one segment of a buffer (or, split
            # across buffers, its per-name tensors).
            segments, split = found
            return _on_segments(grads, segments, rule, split), state  # type: ignore[arg-type,return-value]

        def apply_all() -> Params:
            out = dict(grads)
            for names in groups.values():
                group = {n: grads[n] for n in names}
                if ranks is None or _rb.is_shard_safe(rule):
                    out.update(apply_rule(rule, group))
                else:
                    # Under fg.sharded: a rule not declared shard-safe sees the whole group.
                    out.update(ranks.on_whole(lambda g: apply_rule(rule, g), group))
            return out

        # Under fg.sharded, funcgrad's rules get every group's statistics in one collective.
        return (_rb.batched(apply_all) if _rb.reads_input_only(rule) else apply_all()), state

    tx = shardable(GradientTransformation(init, update), by_entry=True)
    on_host = getattr(rule, "_eager", None)
    if on_host is None:
        return tx

    def eager(
        grads: Params, state: State, params: Params | None = None, scratch: Scratch | None = None
    ) -> Any:
        # update's values for a plain dict of CPU tensors outside fg.sharded, with host
        # reads (funcgrad/rules/_eager.py); None: update it is
        if type(grads) is not dict or _rb.shards() is not None:
            return None
        groups.check_against(grads, "fg.per_group.update")
        done = on_host([{n: grads[n] for n in names} for names in groups.values()], scratch)
        if done is None:
            return None
        out = dict(grads)
        for d in done:
            out.update(d)
        return out, state

    return with_facts(tx, eager=eager)


def _segments(
    grads: Mapping[str, Tensor], groups: Groups
) -> tuple[list[tuple[int, int, int]], list[tuple[str, ...]]] | None:
    """Each group's ``(buffer, start, stop)`` in flat gradients, in layout order, and
    the groups that are no such segment (split across buffers: a module whose large
    tensor has a buffer of its own, ``CPU_ALONE_BYTES``); None unless ``grads`` is a
    :class:`funcgrad.Flat` whose groups are disjoint, outside ``fg.sharded`` (whose
    statistics combine per name)."""
    if not isinstance(grads, Flat) or _rb.shards() is not None:
        return None
    layout = grads.layout
    first: dict[str, tuple[int, int, int]] = {}
    split: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for names in groups.values():
        if seen.intersection(names):
            return None  # overlapping groups
        seen.update(names)
        seg = layout.segment(names)
        if seg is None:
            split.append(tuple(names))
        else:
            first[names[0]] = seg
    # In layout order (each buffer's segments by increasing offset), with no sort:
    # traced, the offsets may be symbolic ints, which dynamo cannot sort.
    segs = [first[n] for n in layout.names if n in first]
    stops: dict[int, int] = {}
    for b, start, stop in segs:
        if start < stops.get(b, 0):
            return None  # overlapping groups
        stops[b] = stop
    return segs, split


def _on_segments(
    grads: Flat,
    segments: list[tuple[int, int, int]],
    rule: Callable[..., Mapping[str, Tensor]],
    split: Sequence[tuple[str, ...]] = (),
) -> Flat:
    """``rule`` on every group as one segment of its buffer, and on each ``split``
    group as its per-name tensors; the rest passes through.

    Groups that repeat with a period (the blocks of a deep stack of equal layers, or
    of a transformer grouped per module: every block's ``qkv`` one size, one period
    apart) are ruled together: the region is a ``(k, period)`` view, each of the
    block's groups a column of it ruled once as ``k`` rows, every statistic taken per
    row (:func:`funcgrad.rules._rule_base.rows`). The same values, and one reduction and one
    elementwise op per column instead of one per group, which is what a compiled
    step's code (and its compile time) otherwise grows by per layer. A buffer that
    holds a part of a split group is ruled group by group.
    """
    layout = grads.layout
    ruled_split: dict[str, Tensor] = {}
    for names in split:
        ruled_split.update(apply_rule(rule, {n: _entry(grads, n) for n in names}))
    split_in = {layout.entries[layout.index[n]][0] for n in ruled_split}

    def passed(b: int, start: int, stop: int) -> list[Tensor]:
        names = layout.run(b, start, stop) if b in split_in else None
        if names is None:  # no split group's entry here (groups end where entries do)
            return [t.reshape(-1) for t in grads._entries(b, start, stop).values()]
        return [ruled_split.get(n, _entry(grads, n)).reshape(-1) for n in names]

    out = []
    for b, buf in enumerate(grads.buffers):
        pieces: list[Tensor] = []
        at = 0
        spans = [(s, e) for i, s, e in segments if i == b]
        if b in split_in or (grads._has_parts() and len(spans) <= FEW_GROUPS):
            # Each group ruled on its own, from the per-name gradients (a compiled
            # step's: nothing reads the flat gradient, which is then never written).
            blocks: list[Block] = [(s, e - s, 1, ((0, e - s, True),)) for s, e in spans]
        else:
            blocks = _blocks(spans, buf.shape[-1])
        for start, period, k, cols in blocks:
            if start > at:
                pieces.extend(passed(b, at, start))
            if k == 1:
                group = grads._entries(b, start, start + period)
                ruled = apply_rule(rule, group)
                pieces.extend(ruled[n].reshape(-1) for n in group)
            else:
                region = buf[start : start + k * period].view(k, period)
                done = []
                for a, e, is_group in cols:
                    if not is_group:
                        done.append(region[:, a:e])
                        continue
                    with _rb.rows():
                        done.append(apply_rule(rule, {"segment": region[:, a:e]})["segment"])
                block = done[0] if len(done) == 1 else torch.cat(done, dim=1)
                pieces.append(block.reshape(-1))
            at = start + k * period
        if at < buf.numel():
            pieces.extend(passed(b, at, buf.numel()))
        out.append(cat(pieces))
    return Flat(out, layout)


def _entry(grads: Flat, name: str) -> Tensor:
    """One name's gradient: the kept per-name part (:meth:`funcgrad.Flat._parts_in`),
    else the view of its buffer."""
    b, o, shape = grads.layout.entries[grads.layout.index[name]]
    part = grads._parts_in(b, o, o + math.prod(shape))
    return part[name] if part is not None else grads[name]


FEW_GROUPS = 8
"""Up to this many groups in a buffer, a compiled step (which keeps the per-name
gradients, :meth:`funcgrad.Flat._packed_from`) rules each group on its own, on those
gradients: the flat gradient is then never written, and each rule fuses into the
backward's kernels and its output into the update (figures: docs/compile-notes.md,
"Figures behind the code"). More groups are ruled as blocks of rows (:func:`_blocks`),
which keeps a deep stack's compile time flat per layer."""

MAX_PERIOD = 16
"""The most groups per block :func:`_blocks` looks for (a transformer block: 6-8)."""

Block = tuple[int, int, int, tuple[tuple[int, int, bool], ...]]
"""``(start, period, k, columns)``: ``k`` blocks of ``period`` entries from ``start``;
``columns``: ``(a, e, ruled)`` offsets within a block, a group's or a gap's."""


def _blocks(spans: list[tuple[int, int]], end: int) -> list[Block]:
    """``spans`` (groups in order, disjoint; ``end``: the buffer's size) as blocks that
    repeat: at each span, the period (in groups, up to :data:`MAX_PERIOD`) whose
    repetitions cover the most groups, at least two repetitions; else the span alone.
    A block's region is ``k * period`` entries and ends before the next group."""
    out: list[Block] = []
    i, n = 0, len(spans)
    while i < n:
        s0 = spans[i][0]
        size0 = spans[i][1] - s0
        best_p, best_k, best_b = 1, 1, size0  # the span alone
        for p in range(1, min(MAX_PERIOD, (n - i) // 2) + 1):
            if spans[i + p][1] - spans[i + p][0] != size0:
                continue  # a next block would not start with a group of this size
            period = spans[i + p][0] - s0
            if spans[i + p - 1][1] - s0 > period:
                continue
            rel = [(s - s0, e - s0) for s, e in spans[i : i + p]]
            k = 1
            while i + (k + 1) * p <= n and all(
                spans[i + k * p + j] == (s0 + k * period + a, s0 + k * period + e)
                for j, (a, e) in enumerate(rel)
            ):
                k += 1
            nxt = spans[i + k * p][0] if i + k * p < n else end
            if k > 1 and s0 + k * period > nxt:
                k -= 1  # the last block's tail would reach the next group: leave it out
            if k > 1 and p * k > best_p * best_k:
                best_p, best_k, best_b = p, k, period
                if i + p * k == n:
                    break  # every remaining group is covered
        cols: list[tuple[int, int, bool]] = []
        at = 0
        for s, e in spans[i : i + best_p]:
            if s - s0 > at:
                cols.append((at, s - s0, False))
            cols.append((s - s0, e - s0, True))
            at = e - s0
        if at < best_b:
            cols.append((at, best_b, False))
        out.append((s0, best_b, best_k, tuple(cols)))
        i += best_p * best_k
    return out


def _group_views(grads: Mapping[str, Tensor], groups: Groups) -> dict[str, dict[str, Tensor]]:
    """Each group as a dict; a group that is one segment of flat gradients is that
    segment alone (its statistics are the group's), outside ``fg.sharded``, or the
    per-name gradients a compiled step keeps (:meth:`funcgrad.Flat._entries`); a group
    split across buffers, its per-name gradients (kept ones where there are)."""
    segs = isinstance(grads, Flat) and _rb.shards() is None
    out = {}
    for g, names in groups.items():
        seg = grads.layout.segment(names) if segs else None  # type: ignore[attr-defined]
        if seg is not None:
            out[g] = grads._entries(*seg)  # type: ignore[attr-defined]
        elif segs:
            out[g] = {n: _entry(grads, n) for n in names}  # type: ignore[arg-type]
        else:
            out[g] = {n: grads[n] for n in names}
    return out


_all_zero = all_zero()
_any_nonfinite = any_nonfinite()
STATS = ("zero_fraction", "all_zero", "norm", "any_nonfinite")


class MonitorState(NamedTuple):
    """Latest per-group statistics: ``stats[group][stat]`` is a 0-d tensor."""

    stats: dict[str, dict[str, Tensor]]


def monitor(
    groups: Groups | Mapping[str, Sequence[str]],
    stats: Sequence[str] = ("zero_fraction", "all_zero", "norm"),
) -> GradientTransformation:
    """Pass gradients through unchanged and keep the latest per-group statistics.

    Put it before a rule to see raw gradients, after it to see the fixed ones. The
    statistics are 0-d tensors in the state (float32, ``all_zero`` and
    ``any_nonfinite`` as bool), computed without host syncs; read them with
    ``.item()`` only when you log.

    Stats: ``zero_fraction`` (fraction of exact zeros), ``all_zero``, ``norm``
    (2-norm of the group), ``any_nonfinite``.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.monitor(fg.Groups({"fc": ("fc.weight",)}))
        >>> g = {"fc.weight": torch.tensor([0.0, 3.0, 4.0, 0.0])}
        >>> _, state = tx.update(g, tx.init(g))
        >>> {k: v.item() for k, v in state.stats["fc"].items()}
        {'zero_fraction': 0.5, 'all_zero': False, 'norm': 5.0}
    """
    groups = as_groups(groups)
    stats = tuple(stats)
    bad = [s for s in stats if s not in STATS]
    if bad or not stats:
        raise ValueError(f"fg.monitor: unknown stats {bad}; choose from {STATS}.")

    def compute(group: dict[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for s in stats:
            if s == "zero_fraction":
                out[s] = zero_count(group).to(torch.float32) / group_size(group)
            elif s == "all_zero":
                out[s] = _all_zero(group)
            elif s == "norm":
                out[s] = group_norm(group).to(torch.float32)
            else:
                out[s] = _any_nonfinite(group)
        return out

    def init(params: Params) -> MonitorState:
        groups.check_against(params, "fg.monitor.init")
        return MonitorState(
            {
                g: compute({n: torch.zeros_like(params[n]) for n in names})
                for g, names in groups.items()
            }
        )

    def update(
        grads: Params, state: State, params: Params | None = None
    ) -> tuple[Params, MonitorState]:
        groups.check_against(grads, "fg.monitor.update")
        new = _rb.batched(
            lambda: {g: compute(group) for g, group in _group_views(grads, groups).items()}
        )
        return grads, MonitorState(new)

    return shardable(GradientTransformation(init, update), by_entry=True)
