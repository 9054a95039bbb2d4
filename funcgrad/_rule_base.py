"""What a rule is, and the helpers that every user of rules shares.

A *rule* maps a group ``dict[str, Tensor]`` to a dict with the same keys, shapes and
dtypes; a *condition* maps a group to a 0-d bool tensor. :class:`Rule` and
:class:`Condition` only add a readable ``repr`` (and ``&``, ``|``, ``~`` on
conditions): any callable is a rule. :func:`apply_rule` is the one place that calls
a rule and checks what it returned (``fg.per_group``, ``fg.rules.when`` and
``fg.hooks.attach`` all go through it).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from ._base import describe

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


def number(value: object, what: str, *, finite: bool = True) -> float:
    """``value`` as a float, or a clear error naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a real number, got {value!r}.")
    if finite and not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value!r}.")
    return float(value)


def any_of(flags: list[Tensor]) -> Tensor:
    """One 0-d bool per tensor, reduced once: stays on the device, no host sync."""
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


def is_zero(t: Tensor, atol: float = 0.0) -> Tensor:
    """``|t| <= atol`` elementwise (exactly ``t == 0`` for ``atol=0``; NaN is not zero)."""
    return t == 0 if atol == 0.0 else t.abs() <= atol


def zero_count(group: Group, atol: float = 0.0) -> Tensor:
    """The number of zeros (``|g| <= atol``) among all entries of the group (0-d int64)."""
    return torch.stack([is_zero(t, atol).sum() for t in group.values()]).sum()


def check_is_rule(fn: object, what: str) -> None:
    """Reject non-callables and un-called factories such as ``rules.zero_fix``."""
    if isinstance(fn, types.FunctionType) and fn.__module__ == "funcgrad.rules":
        name = fn.__name__
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


def apply_rule(rule: Callable[..., Mapping[str, Tensor]], group: Group) -> dict[str, Tensor]:
    """``rule(group)``, checked: the same keys, and each entry's shape and dtype kept."""
    after = rule(group)
    if not isinstance(after, Mapping) or after.keys() != group.keys():
        got = sorted(after) if isinstance(after, Mapping) else type(after).__name__
        raise ValueError(
            f"Rule {rule!r} must return a dict with the same keys as its input group: "
            f"expected {sorted(group)}, got {got}. A rule maps "
            "dict[str, Tensor] -> dict[str, Tensor] and keeps every key."
        )
    for k, t in group.items():
        u = after[k]
        if not isinstance(u, Tensor) or u.shape != t.shape or u.dtype != t.dtype:
            raise ValueError(
                f"Rule {rule!r} changed '{k}' from {describe(t)} to {describe(u)}. "
                "Rules must keep each gradient's shape and dtype; cast with "
                ".to(t.dtype) or use torch.full_like / torch.where."
            )
    return dict(after)
