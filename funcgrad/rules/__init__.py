"""Per-group gradient rules: pure, branch-free functions of a group's gradients.

A *rule* maps a group ``dict[str, Tensor]`` to a dict with the same keys, shapes
and dtypes. A *condition* maps a group to a 0-d bool tensor. :func:`when` combines
them with ``torch.where`` instead of a Python ``if``, so a rule never reads a tensor
value on the host: no graph break under ``torch.compile``, no GPU sync, and it
works under ``torch.func.vmap``.

The seed rule, for each group (e.g. all parameters of one ``nn.Linear``)::

    zero_fix() == when(all_zero(), fill(1.0), otherwise=replace_zeros(0.5))

Any callable ``group -> group`` is a rule; :class:`Rule` and :class:`Condition` only
add a readable ``repr`` and the ``&``, ``|``, ``~`` operators on conditions.

Zero tests take ``atol`` (default 0.0, exact): an entry with ``|g| <= atol`` counts as
zero. A gradient that is mathematically zero can come out as 1e-17 on another kernel
path (the key bias of an attention layer, a convolution's bias right before a
BatchNorm), and an exact test then flips; see docs/exact-zeros.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..core._base import clip_factor
from . import _eager
from . import _rule_base as _rb
from ._rule_base import Condition, Rule

# The helpers stay in _rule_base (not importable as fg.rules.<name>): fg.rules holds
# rules, conditions and their two classes only.
Group = _rb.Group
# funcgrad's rules and conditions: shard-safe, and every statistic is of the input group.
_BUILTIN: dict[str, Any] = {"shard_safe": True, "_input_stats": True}

__all__ = [
    "Condition",
    "Rule",
    "all_zero",
    "any_nonfinite",
    "any_zero",
    "clip_norm",
    "fill",
    "norm_above",
    "replace_nonfinite",
    "replace_zeros",
    "scale",
    "unchanged",
    "when",
    "zero_fix",
    "zero_fraction_above",
]


def _atol(atol: object, who: str, name: str = "atol") -> float:
    a = _rb.number(atol, f"fg.rules.{who}: {name}")
    if a < 0:
        raise ValueError(f"fg.rules.{who}: {name} must be >= 0, got {a}.")
    return a


def _suffix(atol: float, rtol: float = 0.0) -> str:
    parts = ([f"atol={atol}"] if atol else []) + ([f"rtol={rtol}"] if rtol else [])
    return ", ".join(parts)


def _and(*parts: str) -> str:
    return ", ".join(p for p in parts if p)


# ----------------------------------------------------------------- conditions


def all_zero(atol: float = 0.0, *, rtol: float = 0.0) -> Condition:
    """True where every entry of every gradient in the group is zero (``|g| <= atol +
    rtol * rms``, ``rms`` the group's root-mean-square gradient: see
    docs/exact-zeros.md for when a relative tolerance is the right one).

    ``-0.0`` counts as zero; ``NaN`` does not.

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.all_zero()({"w": torch.zeros(2), "b": torch.tensor([0.0, 1e-30])})
        tensor(False)
        >>> rules.all_zero(atol=1e-12)({"w": torch.zeros(2), "b": torch.tensor([0.0, 1e-30])})
        tensor(True)
    """
    a = _atol(atol, "all_zero")
    r = _atol(rtol, "all_zero", "rtol")
    if r:
        return Condition(
            lambda g: _none_above(g, _rb.zero_bound(g, a, r)),
            f"all_zero({_suffix(a, r)})",
            **_BUILTIN,
        )
    if a == 0.0:
        # t.any() is (t != 0).any() (NaN counts as nonzero) in one pass, without the
        # bool temporary: faster eagerly (docs/compile-notes.md).
        return Condition(
            lambda g: ~_rb.any_of([_rb.any_(t) for t in g.values()]),
            "all_zero()",
            **_BUILTIN,
        )
    # ~(|t| > atol).any() rather than (|t| <= atol).all(): NaN is not zero either way.
    return Condition(
        lambda g: ~_rb.any_of([_rb.any_(~_rb.is_zero(t, a)) for t in g.values()]),
        f"all_zero(atol={a})",
        **_BUILTIN,
    )


def _none_above(g: Group, bound: _rb.Bound) -> Tensor:
    return ~_rb.any_of([_rb.any_(~_rb.is_zero(t, bound)) for t in g.values()])


def any_zero(atol: float = 0.0, *, rtol: float = 0.0) -> Condition:
    """True where at least one entry in the group is zero (``|g| <= atol + rtol * rms``,
    as :func:`all_zero`).

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.any_zero()({"w": torch.tensor([1.0, -0.0])})
        tensor(True)
    """
    a = _atol(atol, "any_zero")
    r = _atol(rtol, "any_zero", "rtol")

    def cond(g: Group) -> Tensor:
        bound = _rb.zero_bound(g, a, r)
        return _rb.any_of([_rb.any_(_rb.is_zero(t, bound)) for t in g.values()])

    return Condition(cond, f"any_zero({_suffix(a, r)})", **_BUILTIN)


def any_nonfinite() -> Condition:
    """True where at least one entry in the group is NaN or +-Inf.

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.any_nonfinite()({"w": torch.tensor([1.0, float("inf")])})
        tensor(True)
    """
    return Condition(
        lambda g: _rb.any_of([_rb.any_(torch.isfinite(t).logical_not()) for t in g.values()]),
        "any_nonfinite()",
        **_BUILTIN,
    )


def zero_fraction_above(p: float, atol: float = 0.0, *, rtol: float = 0.0) -> Condition:
    """True where the fraction of zeros (``|g| <= atol + rtol * rms``, as
    :func:`all_zero`) among the group's entries is > ``p``.

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.zero_fraction_above(0.5)({"w": torch.tensor([0.0, 0.0, 1.0])})
        tensor(True)
    """
    p = _rb.number(p, "fg.rules.zero_fraction_above: p")
    a = _atol(atol, "zero_fraction_above")
    r = _atol(rtol, "zero_fraction_above", "rtol")
    if not 0.0 <= p < 1.0:
        raise ValueError(
            f"fg.rules.zero_fraction_above: p must be in [0, 1), got {p}. p=0 means 'any "
            "zero' (see any_zero()); p=1 could never be exceeded (see all_zero())."
        )

    def cond(g: Group) -> Tensor:
        total = _rb.group_size(g)
        # Integer count against a host float threshold: no rounding of the fraction.
        return _rb.zero_count(g, _rb.zero_bound(g, a, r)) > p * total

    return Condition(cond, f"zero_fraction_above({_and(str(p), _suffix(a, r))})", **_BUILTIN)


def norm_above(x: float) -> Condition:
    """True where the group's 2-norm (all entries together) is > ``x``.

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.norm_above(4.0)({"w": torch.tensor([3.0, 4.0])})
        tensor(True)
    """
    x = _rb.number(x, "fg.rules.norm_above: x")
    if x < 0:
        raise ValueError(f"fg.rules.norm_above: x must be >= 0, got {x}; a norm is never negative.")
    return Condition(lambda g: _rb.group_norm(g) > x, f"norm_above({x})", **_BUILTIN)


# -------------------------------------------------------------------- actions


def unchanged() -> Rule:
    """Leave the group as it is (the default ``otherwise`` of :func:`when`).

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.unchanged()({"w": torch.ones(1)})
        {'w': tensor([1.])}
    """
    return Rule(lambda g: dict(g), "unchanged()", **_BUILTIN)


def fill(value: float) -> Rule:
    """Set every entry of every gradient in the group to ``value``.

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.fill(1.0)({"w": torch.zeros(2, dtype=torch.float16)})
        {'w': tensor([1., 1.], dtype=torch.float16)}
    """
    v = _rb.number(value, "fg.rules.fill: value")
    return Rule(
        lambda g: {k: torch.full_like(t, v) for k, t in g.items()}, f"fill({v})", **_BUILTIN
    )


def replace_zeros(value: float, atol: float = 0.0, *, rtol: float = 0.0) -> Rule:
    """Set every zero entry (``|g| <= atol + rtol * rms``, as :func:`all_zero`; ``-0.0``
    too) to ``value``; keep the others.

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.replace_zeros(0.5)({"w": torch.tensor([0.0, 2.0])})
        {'w': tensor([0.5000, 2.0000])}
    """
    v = _rb.number(value, "fg.rules.replace_zeros: value")
    a = _atol(atol, "replace_zeros")
    r = _atol(rtol, "replace_zeros", "rtol")

    def rule(g: Group) -> dict[str, Tensor]:
        bound = _rb.zero_bound(g, a, r)
        return {k: torch.where(_rb.is_zero(t, bound), v, t) for k, t in g.items()}

    return Rule(rule, f"replace_zeros({_and(str(v), _suffix(a, r))})", **_BUILTIN)


def replace_nonfinite(value: float = 0.0) -> Rule:
    """Set every NaN / +-Inf entry to ``value``; keep the finite ones.

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.replace_nonfinite()({"w": torch.tensor([float("nan"), 2.0])})
        {'w': tensor([0., 2.])}
    """
    v = _rb.number(value, "fg.rules.replace_nonfinite: value")
    return Rule(
        lambda g: {k: torch.where(torch.isfinite(t), t, v) for k, t in g.items()},
        f"replace_nonfinite({v})",
        **_BUILTIN,
    )


def scale(factor: float) -> Rule:
    """Multiply every entry by ``factor``.

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.scale(0.5)({"w": torch.tensor([2.0])})
        {'w': tensor([1.])}
    """
    f = _rb.number(factor, "fg.rules.scale: factor")
    return Rule(lambda g: {k: t * f for k, t in g.items()}, f"scale({f})", **_BUILTIN)


def clip_norm(max_norm: float) -> Rule:
    """Rescale the group so its 2-norm is at most ``max_norm``.

    Same formula as ``torch.nn.utils.clip_grad_norm_`` applied to the group:
    ``g * min(1, max_norm / (norm + 1e-6))``.

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> rules.clip_norm(1.0)({"w": torch.tensor([3.0, 4.0])})
        {'w': tensor([0.6000, 0.8000])}
    """
    m = _rb.number(max_norm, "fg.rules.clip_norm: max_norm")
    if m <= 0:
        raise ValueError(f"fg.rules.clip_norm: max_norm must be > 0, got {m}.")

    def rule(g: Group) -> dict[str, Tensor]:
        coef = clip_factor(m, _rb.group_norm(g))
        return {k: t * coef.to(t.dtype) for k, t in g.items()}

    return Rule(rule, f"clip_norm({m})", **_BUILTIN)


# ------------------------------------------------------------------ combinators


def when(
    condition: Callable[[Group], Tensor],
    then: Callable[[Group], Mapping[str, Tensor]],
    otherwise: Callable[[Group], Mapping[str, Tensor]] | None = None,
) -> Rule:
    """``then(group)`` where ``condition(group)`` holds, else ``otherwise(group)``.

    Both branches are computed and selected with ``torch.where`` (branch-free).
    ``otherwise`` defaults to :func:`unchanged`.

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> r = rules.when(rules.norm_above(1.0), rules.scale(0.0))
        >>> r({"w": torch.tensor([3.0])}), r({"w": torch.tensor([0.5])})
        ({'w': tensor([0.])}, {'w': tensor([0.5000])})
    """
    other = unchanged() if otherwise is None else otherwise
    for what, fn in (("condition", condition), ("then", then), ("otherwise", other)):
        _rb.check_is_rule(fn, f"fg.rules.when: {what}")
    name = f"when({condition!r}, {then!r}, otherwise={other!r})"

    def rule(g: Group) -> dict[str, Tensor]:
        c = condition(g)
        # (one value per row, (k, 1), when k equal groups are ruled at once: _rule_base.rows)
        shape = (c.shape[0], 1) if _rb.in_rows() and isinstance(c, Tensor) and c.dim() == 2 else ()
        if not isinstance(c, Tensor) or c.dtype != torch.bool or tuple(c.shape) != shape:
            raise ValueError(
                f"fg.rules.when: condition {condition!r} must return a 0-d bool tensor, "
                f"got {c!r}. Reduce it, e.g. (t == 0).all(), and avoid Python bools."
            )
        a, b = _rb.apply_rule(then, g), _rb.apply_rule(other, g)
        return {k: torch.where(c, a[k], b[k]) for k in g}

    safe = all(_rb.is_shard_safe(f) for f in (condition, then, other))
    plain = all(_rb.reads_input_only(f) for f in (condition, then, other))
    return Rule(rule, name, shard_safe=safe, _input_stats=plain)


def zero_fix(
    if_all_zero: float = 1.0,
    if_zero: float = 0.5,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> Rule:
    """The seed rule: an all-zero group becomes ``if_all_zero``; else zeros become ``if_zero``.

    Equal to ``when(all_zero(atol, rtol=rtol), fill(if_all_zero),
    otherwise=replace_zeros(if_zero, atol, rtol=rtol))``: an entry is zero when
    ``|g| <= atol + rtol * rms`` (``rms``: the group's root-mean-square gradient). The
    default is exact zeros; on models whose gradients are mathematically zero in places
    (attention key biases, a bias before BatchNorm), ``rtol=1e-5`` makes the decisions
    the same in float32 and float64 at any loss scale (docs/exact-zeros.md).

    With exact zeros, ``fg.Optimizer``'s eager step on CPU tensors runs it by a form
    that reads each gradient's flags on the host and rewrites only gradients holding
    zeros (the same values; funcgrad/rules/_eager.py).

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> fix = rules.zero_fix()
        >>> fix({"w": torch.zeros(2), "b": torch.zeros(1)})
        {'w': tensor([1., 1.]), 'b': tensor([1.])}
        >>> fix({"w": torch.tensor([0.0, 3.0]), "b": torch.zeros(1)})
        {'w': tensor([0.5000, 3.0000]), 'b': tensor([0.5000])}
    """
    a = _rb.number(if_all_zero, "fg.rules.zero_fix: if_all_zero")
    z = _rb.number(if_zero, "fg.rules.zero_fix: if_zero")
    tol = _atol(atol, "zero_fix")
    rel = _atol(rtol, "zero_fix", "rtol")

    def rule(g: Group) -> dict[str, Tensor]:
        # Equal to when(all_zero(), fill(a), otherwise=replace_zeros(z)), in one pass:
        # in an all-zero group every entry is a zero, so "zeros become (a if the group
        # is all-zero else z)" is the whole rule. No full-size fill is materialized, and
        # each tensor's zero mask serves both the test and the replacement (all_zero's
        # "no entry is not zero" is "every entry is zero"; NaN is neither way a zero).
        bound = _rb.zero_bound(g, tol, rel)
        zeros = {k: _rb.is_zero(t, bound) for k, t in g.items()}
        dead = ~_rb.any_of([~_rb.all_(m) for m in zeros.values()])
        # 0-d, a for a dead group, else z: made in each gradient's dtype from the
        # Python floats (through float32, 0.1 became 0.10000000149 in float64).
        value: dict[torch.dtype, Tensor] = {}
        out = {}
        for k, t in g.items():
            if t.dtype not in value:
                value[t.dtype] = torch.where(
                    dead, torch.full((), a, dtype=t.dtype, device=t.device), z
                )
            out[k] = torch.where(zeros[k], value[t.dtype], t)
        return out

    extra = f", {_suffix(tol, rel)}" if tol or rel else ""
    eager = _eager.zero_fix(a, z) if not (tol or rel) else None
    return Rule(rule, f"zero_fix(if_all_zero={a}, if_zero={z}{extra})", _eager=eager, **_BUILTIN)
