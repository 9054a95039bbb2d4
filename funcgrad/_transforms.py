"""Transformations built from rules and labels: per_group, partition, monitor."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ._base import EmptyState, GradientTransformation, Params, State, check_floating
from ._groups import Groups, as_groups
from .rules import (
    all_zero,
    any_nonfinite,
    check_is_rule,
    check_same_structure,
    group_norm,
    zero_count,
)


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

    Example:
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
            "per_group: rule is a GradientTransformation; per_group takes a rule "
            "(dict -> dict), e.g. fg.rules.zero_fix(). Use fg.chain to combine transformations."
        )
    check_is_rule(rule, "per_group: rule")
    groups = as_groups(groups)

    def init(params: Params) -> EmptyState:
        groups.check_against(params, "per_group.init")
        check_floating({n: params[n] for names in groups.values() for n in names}, "per_group.init")
        return EmptyState()

    def update(grads: Params, state: State, params: Params | None = None) -> tuple[Params, State]:
        groups.check_against(grads, "per_group.update")
        out = dict(grads)
        for names in groups.values():
            group = {n: grads[n] for n in names}
            new = rule(group)
            check_same_structure(group, new, rule)
            out.update(new)
        return out, state

    return GradientTransformation(init, update)


class PartitionState(NamedTuple):
    """The state of :func:`partition`: one inner state per label."""

    inner_states: dict[str, State]


def partition(
    transforms: Mapping[str, GradientTransformation],
    labels: Mapping[str, str] | Callable[[Params], Mapping[str, str]],
) -> GradientTransformation:
    """Send each parameter's gradient to the transformation of its label (optax-style).

    Each inner transformation sees only the sub-dict of its parameters.

    Args:
        transforms: ``label -> transformation``.
        labels: ``parameter name -> label``, or a function ``params -> that dict``.

    Example:
        >>> import torch, funcgrad as fg
        >>> tx = fg.partition({"train": fg.adam(lr=0.1), "frozen": fg.set_to_zero()},
        ...                   {"w": "train", "b": "frozen"})
        >>> params = {"w": torch.zeros(1), "b": torch.zeros(1)}
        >>> grads = {"w": torch.ones(1), "b": torch.ones(1)}
        >>> updates, _ = tx.update(grads, tx.init(params), params)
        >>> updates
        {'w': tensor([-0.1000]), 'b': tensor([0.])}
    """
    transforms = dict(transforms)
    for k, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"partition: transforms['{k}'] is a {type(t).__name__}, not a "
                "GradientTransformation."
            )

    def resolve(params: Mapping[str, Tensor]) -> dict[str, str]:
        lab = dict(labels(dict(params)) if callable(labels) else labels)
        missing = sorted(params.keys() - lab.keys())
        extra = sorted(lab.keys() - params.keys())
        if missing or extra:
            raise KeyError(
                f"partition: labels must name every parameter exactly. Missing labels "
                f"for {missing}; labels for unknown parameters {extra}."
            )
        unknown = sorted({v for v in lab.values() if v not in transforms})
        if unknown:
            raise KeyError(
                f"partition: labels {unknown} have no transformation. Known labels: "
                f"{sorted(transforms)}; add them to the transforms dict."
            )
        return lab

    def split(tree: Mapping[str, Tensor], lab: dict[str, str]) -> dict[str, Params]:
        parts: dict[str, Params] = {k: {} for k in transforms}
        for n, t in tree.items():
            parts[lab[n]][n] = t
        return parts

    def init(params: Params) -> PartitionState:
        parts = split(params, resolve(params))
        return PartitionState({k: t.init(parts[k]) for k, t in transforms.items()})

    def update(
        grads: Params, state: PartitionState, params: Params | None = None
    ) -> tuple[Params, PartitionState]:
        lab = resolve(grads if params is None else params)
        g_parts = split(grads, lab)
        p_parts = split(params, lab) if params is not None else None
        out: Params = {}
        new_states = {}
        for k, t in transforms.items():
            u, new_states[k] = t.update(
                g_parts[k], state.inner_states[k], None if p_parts is None else p_parts[k]
            )
            out.update(u)
        # Keep the caller's key order (dict order matters for pytree flattening).
        return {n: out[n] for n in grads}, PartitionState(new_states)

    return GradientTransformation(init, update)


def set_to_zero() -> GradientTransformation:
    """Replace every update by zeros (for frozen partitions).

    Example:
        >>> import torch, funcgrad as fg
        >>> fg.set_to_zero().update({"w": torch.ones(2)}, fg.EmptyState())[0]
        {'w': tensor([0., 0.])}
    """
    from ._base import stateless

    return stateless(lambda grads, params: {k: torch.zeros_like(g) for k, g in grads.items()})


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

    Example:
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
        raise ValueError(f"monitor: unknown stats {bad}; choose from {STATS}.")

    def compute(group: dict[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for s in stats:
            if s == "zero_fraction":
                total = sum(t.numel() for t in group.values())
                out[s] = zero_count(group).to(torch.float32) / total
            elif s == "all_zero":
                out[s] = _all_zero(group)
            elif s == "norm":
                out[s] = group_norm(group).to(torch.float32)
            else:
                out[s] = _any_nonfinite(group)
        return out

    def init(params: Params) -> MonitorState:
        groups.check_against(params, "monitor.init")
        return MonitorState(
            {
                g: compute({n: torch.zeros_like(params[n]) for n in names})
                for g, names in groups.items()
            }
        )

    def update(
        grads: Params, state: State, params: Params | None = None
    ) -> tuple[Params, MonitorState]:
        groups.check_against(grads, "monitor.update")
        new = {g: compute({n: grads[n] for n in names}) for g, names in groups.items()}
        return grads, MonitorState(new)

    return GradientTransformation(init, update)
