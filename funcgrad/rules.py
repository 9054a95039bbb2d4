"""Per-group gradient rules: pure, branch-free functions of a group's gradients.

A *rule* maps a group ``dict[str, Tensor]`` to a dict with the same keys, shapes
and dtypes. A *condition* maps a group to a 0-d bool tensor. :func:`when` combines
them with ``torch.where`` instead of a Python ``if``, so a rule never reads a tensor
value on the host: no graph break under ``torch.compile``, no GPU sync, and it
works under ``torch.func.vmap``.

The seed rule, for each group (e.g. all parameters of one ``nn.Linear``)::

    zero_fix() == when(all_zero(), fill(1.0), otherwise=replace_zeros(0.5))

Any callable ``group -> group`` is a rule; the classes here only add a readable
``repr`` and the ``&``, ``|``, ``~`` operators on conditions.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

__all__ = [
    "Condition",
    "Rule",
    "all_zero",
    "any_nonfinite",
    "any_zero",
    "clip_norm",
    "fill",
    "identity",
    "norm_above",
    "replace_nonfinite",
    "replace_zeros",
    "scale",
    "when",
    "zero_fix",
    "zero_fraction_above",
]

Group = Mapping[str, Tensor]


class Condition:
    """A named function ``group -> 0-d bool tensor``; combine with ``&``, ``|``, ``~``.

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> c = rules.all_zero() | rules.any_nonfinite()
        >>> c
        (all_zero() | any_nonfinite())
        >>> c({"w": torch.tensor([0.0, float("nan")])})
        tensor(True)
    """

    def __init__(self, fn: Callable[[Group], Tensor], name: str) -> None:
        self._fn = fn
        self._name = name

    def __call__(self, group: Group) -> Tensor:
        return self._fn(group)

    def __repr__(self) -> str:
        return self._name

    def __and__(self, other: Condition) -> Condition:
        return Condition(lambda g: self(g) & other(g), f"({self} & {other})")

    def __or__(self, other: Condition) -> Condition:
        return Condition(lambda g: self(g) | other(g), f"({self} | {other})")

    def __invert__(self) -> Condition:
        return Condition(lambda g: ~self(g), f"~{self}")


class Rule:
    """A named rule ``group -> group`` (same keys, shapes and dtypes)."""

    def __init__(self, fn: Callable[[Group], dict[str, Tensor]], name: str) -> None:
        self._fn = fn
        self._name = name

    def __call__(self, group: Group) -> dict[str, Tensor]:
        return self._fn(group)

    def __repr__(self) -> str:
        return self._name


def _number(value: object, what: str, *, finite: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a real number, got {value!r}.")
    if finite and not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value!r}.")
    return float(value)


def _any(flags: list[Tensor]) -> Tensor:
    # One 0-d bool per tensor, reduced once: stays on the device, no host sync.
    return torch.stack(flags).any()


def group_norm(group: Group) -> Tensor:
    """The 2-norm of all entries of the group, as ``torch.nn.utils.clip_grad_norm_``.

    Half-precision gradients are accumulated in float32.
    """
    norms = []
    for g in group.values():
        acc = torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else g.dtype
        norms.append(torch.linalg.vector_norm(g, 2, dtype=acc))
    return torch.linalg.vector_norm(torch.stack(norms), 2)


def zero_count(group: Group) -> Tensor:
    """The number of exact zeros among all entries of the group (0-d int64)."""
    return torch.stack([t.eq(0).sum() for t in group.values()]).sum()


# ----------------------------------------------------------------- conditions


def all_zero() -> Condition:
    """True where every entry of every gradient in the group is exactly 0.

    ``-0.0`` counts as zero; ``NaN`` does not.

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.all_zero()({"w": torch.zeros(2), "b": torch.tensor([0.0, 1e-30])})
        tensor(False)
    """
    return Condition(lambda g: ~_any([t.ne(0).any() for t in g.values()]), "all_zero()")


def any_zero() -> Condition:
    """True where at least one entry in the group is exactly 0.

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.any_zero()({"w": torch.tensor([1.0, -0.0])})
        tensor(True)
    """
    return Condition(lambda g: _any([t.eq(0).any() for t in g.values()]), "any_zero()")


def any_nonfinite() -> Condition:
    """True where at least one entry in the group is NaN or +-Inf.

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.any_nonfinite()({"w": torch.tensor([1.0, float("inf")])})
        tensor(True)
    """
    return Condition(
        lambda g: _any([torch.isfinite(t).logical_not().any() for t in g.values()]),
        "any_nonfinite()",
    )


def zero_fraction_above(p: float) -> Condition:
    """True where the fraction of exact zeros among all the group's entries is > ``p``.

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.zero_fraction_above(0.5)({"w": torch.tensor([0.0, 0.0, 1.0])})
        tensor(True)
    """
    p = _number(p, "zero_fraction_above: p")
    if not 0.0 <= p < 1.0:
        raise ValueError(
            f"zero_fraction_above: p must be in [0, 1), got {p}. p=0 means 'any zero' "
            "(see any_zero()); p=1 could never be exceeded (see all_zero())."
        )

    def cond(g: Group) -> Tensor:
        total = sum(t.numel() for t in g.values())
        # Integer count against a host float threshold: no rounding of the fraction.
        return zero_count(g) > p * total

    return Condition(cond, f"zero_fraction_above({p})")


def norm_above(x: float) -> Condition:
    """True where the group's 2-norm (all entries together) is > ``x``.

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.norm_above(4.0)({"w": torch.tensor([3.0, 4.0])})
        tensor(True)
    """
    x = _number(x, "norm_above: x")
    if x < 0:
        raise ValueError(f"norm_above: x must be >= 0, got {x}; a norm is never negative.")
    return Condition(lambda g: group_norm(g) > x, f"norm_above({x})")


# -------------------------------------------------------------------- actions


def identity() -> Rule:
    """Leave the group unchanged.

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.identity()({"w": torch.ones(1)})
        {'w': tensor([1.])}
    """
    return Rule(lambda g: dict(g), "identity()")


def fill(value: float) -> Rule:
    """Set every entry of every gradient in the group to ``value``.

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.fill(1.0)({"w": torch.zeros(2, dtype=torch.float16)})
        {'w': tensor([1., 1.], dtype=torch.float16)}
    """
    v = _number(value, "fill: value")
    return Rule(lambda g: {k: torch.full_like(t, v) for k, t in g.items()}, f"fill({v})")


def replace_zeros(value: float) -> Rule:
    """Set every entry that is exactly 0 (or -0.0) to ``value``; keep the others.

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.replace_zeros(0.5)({"w": torch.tensor([0.0, 2.0])})
        {'w': tensor([0.5000, 2.0000])}
    """
    v = _number(value, "replace_zeros: value")
    return Rule(
        lambda g: {k: torch.where(t == 0, v, t) for k, t in g.items()},
        f"replace_zeros({v})",
    )


def replace_nonfinite(value: float = 0.0) -> Rule:
    """Set every NaN / +-Inf entry to ``value``; keep the finite ones.

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.replace_nonfinite()({"w": torch.tensor([float("nan"), 2.0])})
        {'w': tensor([0., 2.])}
    """
    v = _number(value, "replace_nonfinite: value")
    return Rule(
        lambda g: {k: torch.where(torch.isfinite(t), t, v) for k, t in g.items()},
        f"replace_nonfinite({v})",
    )


def scale(factor: float) -> Rule:
    """Multiply every entry by ``factor``.

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.scale(0.5)({"w": torch.tensor([2.0])})
        {'w': tensor([1.])}
    """
    f = _number(factor, "scale: factor")
    return Rule(lambda g: {k: t * f for k, t in g.items()}, f"scale({f})")


def clip_norm(max_norm: float) -> Rule:
    """Rescale the group so its 2-norm is at most ``max_norm``.

    Same formula as ``torch.nn.utils.clip_grad_norm_`` applied to the group:
    ``g * min(1, max_norm / (norm + 1e-6))``.

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.clip_norm(1.0)({"w": torch.tensor([3.0, 4.0])})
        {'w': tensor([0.6000, 0.8000])}
    """
    m = _number(max_norm, "clip_norm: max_norm")
    if m <= 0:
        raise ValueError(f"clip_norm: max_norm must be > 0, got {m}.")

    def rule(g: Group) -> dict[str, Tensor]:
        coef = torch.clamp(m / (group_norm(g) + 1e-6), max=1.0)
        return {k: t * coef.to(t.dtype) for k, t in g.items()}

    return Rule(rule, f"clip_norm({m})")


# ------------------------------------------------------------------ combinators


def check_is_rule(fn: object, what: str) -> None:
    """Reject non-callables and un-called factories such as ``rules.zero_fix``."""
    factory = (
        isinstance(fn, types.FunctionType) and fn.__module__ == __name__ and fn.__name__ in __all__
    )
    if factory:
        name = getattr(fn, "__name__", "?")
        raise TypeError(
            f"{what} must be a rule or condition, got the function rules.{name}. "
            f"Did you pass rules.{name} instead of rules.{name}(...)? The "
            "functions in fg.rules build rules; call them first."
        )
    if not callable(fn):
        raise TypeError(
            f"{what} must be a rule or condition (a callable group -> group), got a "
            f"{type(fn).__name__}. Build one with fg.rules, e.g. fg.rules.zero_fix()."
        )


def check_same_structure(before: Group, after: Mapping[str, Tensor], who: object) -> None:
    """A rule must return the same keys, shapes and dtypes it was given."""
    if not isinstance(after, Mapping) or after.keys() != before.keys():
        got = sorted(after) if isinstance(after, Mapping) else type(after).__name__
        raise ValueError(
            f"Rule {who!r} must return a dict with the same keys as its input group: "
            f"expected {sorted(before)}, got {got}. A rule maps "
            "dict[str, Tensor] -> dict[str, Tensor] and keeps every key."
        )
    for k, t in before.items():
        u = after[k]
        if not isinstance(u, Tensor) or u.shape != t.shape or u.dtype != t.dtype:
            desc = f"{tuple(u.shape)} {u.dtype}" if isinstance(u, Tensor) else type(u).__name__
            raise ValueError(
                f"Rule {who!r} changed '{k}' from {tuple(t.shape)} {t.dtype} to {desc}. "
                "Rules must keep each gradient's shape and dtype; cast with "
                ".to(t.dtype) or use torch.full_like / torch.where."
            )


def when(
    condition: Callable[[Group], Tensor],
    then: Callable[[Group], Mapping[str, Tensor]],
    otherwise: Callable[[Group], Mapping[str, Tensor]] | None = None,
) -> Rule:
    """``then(group)`` where ``condition(group)`` holds, else ``otherwise(group)``.

    Both branches are computed and selected with ``torch.where`` (branch-free).

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> r = rules.when(rules.norm_above(1.0), rules.scale(0.0))
        >>> r({"w": torch.tensor([3.0])}), r({"w": torch.tensor([0.5])})
        ({'w': tensor([0.])}, {'w': tensor([0.5000])})
    """
    other = identity() if otherwise is None else otherwise
    for what, fn in (("condition", condition), ("then", then), ("otherwise", other)):
        check_is_rule(fn, f"when: {what}")
    name = f"when({condition!r}, {then!r}, otherwise={other!r})"

    def rule(g: Group) -> dict[str, Tensor]:
        c = condition(g)
        if not isinstance(c, Tensor) or c.dtype != torch.bool or c.dim() != 0:
            raise ValueError(
                f"when: condition {condition!r} must return a 0-d bool tensor, got "
                f"{c!r}. Reduce it, e.g. (t == 0).all(), and avoid Python bools."
            )
        a, b = then(g), other(g)
        check_same_structure(g, a, then)
        check_same_structure(g, b, other)
        return {k: torch.where(c, a[k], b[k]) for k in g}

    return Rule(rule, name)


_all_zero = all_zero


def zero_fix(all_zero: float = 1.0, zero: float = 0.5) -> Rule:
    """The seed rule: an all-zero group becomes ``all_zero``; else zeros become ``zero``.

    Equal to ``when(all_zero(), fill(all_zero), otherwise=replace_zeros(zero))``.

    Example:
        >>> import torch
        >>> from funcgrad import rules
        >>> fix = rules.zero_fix()
        >>> fix({"w": torch.zeros(2), "b": torch.zeros(1)})
        {'w': tensor([1., 1.]), 'b': tensor([1.])}
        >>> fix({"w": torch.tensor([0.0, 3.0]), "b": torch.zeros(1)})
        {'w': tensor([0.5000, 3.0000]), 'b': tensor([0.5000])}
    """
    a = _number(all_zero, "zero_fix: all_zero")
    z = _number(zero, "zero_fix: zero")
    dead = _all_zero()

    def rule(g: Group) -> dict[str, Tensor]:
        # Equal to when(all_zero(), fill(a), otherwise=replace_zeros(z)), in one pass:
        # in an all-zero group every entry is a zero, so "zeros become (a if the group
        # is all-zero else z)" is the whole rule. No full-size fill is materialized.
        value = torch.where(dead(g), a, z)  # 0-d: a for a dead group, else z
        return {k: torch.where(t == 0, value.to(t.dtype), t) for k, t in g.items()}

    return Rule(rule, f"zero_fix(all_zero={a}, zero={z})")
