"""Param groups for funcgrad's optimizers: :func:`grouped`, the one mechanism behind
``fg.Optimizer``'s param groups and per-group hyperparameters in ``fg.make_step``.

Every optimizer records its factory and the arguments it was built with
(``tx.facts.optimizer``, funcgrad/optim/_hparams.py); every wrapper (``chain``,
``partition``, ``accumulate``, ``sharded``...) records its parts and how to build it
over others (``tx.facts.remake``). :func:`grouped` walks ``tx``, rebuilds each
optimizer once per group with the group's keys, and joins them with
``core._combine.by_groups``, which sends each parameter to its group's copy. The
rest of ``tx`` (rules, monitors, clipping) is unchanged and sees every gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor

from ..core._base import GradientTransformation, is_number, require_transformation
from ..core._combine import by_groups
from ._hparams import OptimizerInfo, is_schedule


def optimizers_in(tx: GradientTransformation) -> list[OptimizerInfo]:
    """The optimizers inside ``tx`` (through every wrapper that records its parts), in
    the order their states appear in ``tx.init``'s."""
    out: list[OptimizerInfo] = []

    def walk(t: GradientTransformation) -> None:
        if t.facts.optimizer is not None:
            out.append(t.facts.optimizer)
            return
        for part in t.facts.parts:
            walk(part)

    walk(tx)
    return out


def map_optimizers(
    tx: GradientTransformation, fn: Callable[[GradientTransformation], GradientTransformation]
) -> GradientTransformation:
    """``tx`` rebuilt with each optimizer inside it replaced by ``fn(optimizer)``."""
    if tx.facts.optimizer is not None:
        return fn(tx)
    if not tx.facts.parts or tx.facts.remake is None:
        return tx
    return tx.facts.remake(tuple(map_optimizers(p, fn) for p in tx.facts.parts))  # type: ignore[no-any-return]


def lr_ratios(infos: Sequence[OptimizerInfo]) -> list[float]:
    """Each optimizer's learning rate over the first one's (1.0 where either is a
    tensor or a schedule, or the first is 0): a param group's ``lr`` sets the first
    optimizer's and scales the others' by these."""
    first = infos[0].kwargs.get("lr") if infos and infos[0].kwargs else None
    out = []
    for info in infos:
        lr = (info.kwargs or {}).get("lr")
        plain = all(is_number(x) for x in (first, lr))
        out.append(float(lr) / float(first) if plain and first else 1.0)  # type: ignore[arg-type]
    return out


def group_names(group: Mapping[str, Any], i: int, who: str) -> list[str]:
    if not isinstance(group, Mapping) or "params" not in group:
        raise TypeError(
            f"{who}: param group {i} must be a dict with a 'params' key (the parameters' "
            f"names), e.g. {{'params': ['fc.bias'], 'weight_decay': 0.0}}; got "
            f"{type(group).__name__}."
        )
    params = group["params"]
    names = [params] if isinstance(params, str) else list(params)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(
            f"{who}: param group {i}'s 'params' must be parameter names (str), got "
            f"{type(bad[0]).__name__}. fg.Optimizer takes tensors; fg.grouped takes names."
        )
    return names


def grouped(
    tx: GradientTransformation, groups: Sequence[Mapping[str, Any]]
) -> GradientTransformation:
    """``tx`` with each optimizer inside it split by param groups, as torch.optim's are.

    Each group is a dict: ``"params"``, the names of its parameters, and any of the
    optimizers' arguments (``lr``, ``betas``, ``weight_decay``, ``momentum``,
    ``nesterov``, ``amsgrad``, ...), which override the ones ``tx``'s optimizers were
    built with for that group's parameters (a key is given to each optimizer that takes
    it; ``lr`` keeps each optimizer's ratio to the first one's). The rules and other
    transformations in ``tx`` see all gradients as before. Every parameter must be in
    exactly one group. The state holds one optimizer state per group
    (``fg.get_hyperparams`` lists them in group order), each with its own step count
    and hyperparameters. ``fg.Optimizer`` builds its param groups with this function.

    Args:
        tx: a transformation holding funcgrad optimizers (``fg.adamw()``, a chain...).
        groups: the param groups, in order.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.grouped(fg.sgd(lr=0.1), [{"params": ["w"]},
        ...                                  {"params": ["b"], "lr": 0.01}])
        >>> params = {"w": torch.zeros(1), "b": torch.zeros(1)}
        >>> grads = {"w": torch.ones(1), "b": torch.ones(1)}
        >>> tx.update(grads, tx.init(params), params)[0]
        {'w': tensor([-0.1000]), 'b': tensor([-0.0100])}
        >>> [h["lr"] for h in fg.get_hyperparams(tx.init(params))]
        [0.1, 0.01]
    """
    who = "fg.grouped"
    require_transformation(tx, f"{who}: tx")
    if not groups:
        raise ValueError(f"{who}: give at least one param group.")
    group_of: dict[str, int] = {}
    for i, g in enumerate(groups):
        for n in group_names(g, i, who):
            if n in group_of:
                raise ValueError(
                    f"{who}: parameter '{n}' is in param group {group_of[n]} and in group {i}; "
                    "a parameter belongs to one group (torch.optim refuses this too)."
                )
            group_of[n] = i
    overrides = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    infos = optimizers_in(tx)
    if not infos:
        raise TypeError(
            f"{who}: tx holds no funcgrad optimizer (fg.adam, fg.sgd, ...) whose "
            "hyperparameters param groups could set; a GradientTransformation built by "
            "hand does not say what it holds."
        )
    takes = set().union(*(set(info.kwargs or {}) for info in infos))
    unknown = sorted({k for o in overrides for k in o} - takes)
    if unknown:
        raise KeyError(
            f"{who}: no optimizer in tx takes {unknown}; they take {sorted(takes)} "
            f"({', '.join(i.who for i in infos)})."
        )
    ratios = iter(lr_ratios(infos))
    members = [{n for n, j in group_of.items() if j == i} for i in range(len(groups))]

    def split(opt: GradientTransformation) -> GradientTransformation:
        info: OptimizerInfo = opt.facts.optimizer
        ratio = next(ratios)
        copies = [
            info.rebuild(**for_optimizer(info, o, ratio, names))
            for o, names in zip(overrides, members, strict=True)
        ]
        return copies[0] if len(copies) == 1 else by_groups(copies, group_of)

    return map_optimizers(tx, split)


def for_optimizer(
    info: OptimizerInfo, overrides: Mapping[str, Any], ratio: float, names: Iterable[str]
) -> dict[str, Any]:
    """A group's keys as arguments of one optimizer: those it takes; ``lr`` times the
    optimizer's ratio to the first; a mask given as a dict cut to the group's names."""
    kwargs = info.kwargs or {}
    out = {k: v for k, v in overrides.items() if k in kwargs}
    if "lr" in out and ratio != 1.0 and not isinstance(out["lr"], Tensor):
        if not is_schedule(out["lr"]):
            out["lr"] = out["lr"] * ratio
    mask = out.get("mask", kwargs.get("mask"))
    if isinstance(mask, Mapping):
        keep = set(names)
        out["mask"] = {n: v for n, v in mask.items() if n in keep}
    return out
