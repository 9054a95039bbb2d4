"""What a rule is, and the helpers that every user of rules shares.

A *rule* maps a group ``dict[str, Tensor]`` to a dict with the same keys, shapes and
dtypes; a *condition* maps a group to a 0-d bool tensor. :class:`Rule` and
:class:`Condition` only add a readable ``repr`` (and ``&``, ``|``, ``~`` on
conditions): any callable is a rule. :func:`apply_rule` is the one place that calls
a rule and checks what it returned (``fg.per_group``, ``fg.rules.when`` and
``fg.hooks.attach`` all go through it).

Under :func:`funcgrad.sharded` a rule sees only this rank's rows of each gradient.
Every group statistic is therefore taken through the helpers here (:func:`any_of`,
:func:`zero_count`, :func:`group_norm`, :func:`group_size`): each computes the
partial statistic of the local rows and, while ``fg.sharded`` runs ``tx``, combines
the partials across ranks with one small collective (``any`` as a max, counts and
squared norms as sums, sizes from the global shapes); ``fg.per_group`` with funcgrad's
rules and ``fg.monitor`` combine all their groups' statistics in one collective
(:func:`batched`, :func:`reads_input_only`). A rule or condition built only
from elementwise ops and these statistics is *shard-safe*: ``Rule(fn, name,
shard_safe=True)``. Any other callable is applied by ``fg.per_group`` to the whole
group, gathered from all ranks (correct, at the price of that group's all-gather).

funcgrad's own rules also reduce a tensor only through :func:`any_` and :func:`all_`.
That lets ``fg.per_group`` rule ``k`` equal-size groups of flat gradients that repeat
(adjacent, or one column of blocks that repeat with a period) in one call
(:func:`rows`): each tensor is then ``(k, size)`` (possibly strided), one row per
group, and every statistic is taken per row, shape ``(k, 1)``.
"""

from __future__ import annotations

import contextlib
import math
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

import torch
from torch import Tensor

from .. import _compat
from .._compat import compiling
from ..core._base import describe, is_number
from ..core._shards import Shards as Shards
from ..core._shards import active as active
from ..core._shards import shards as shards

Group = Mapping[str, Tensor]
T = TypeVar("T")
Out = TypeVar("Out")


def is_shard_safe(fn: object) -> bool:
    """Whether ``fn`` was built as shard-safe (a :class:`Rule` or :class:`Condition`)."""
    return getattr(fn, "shard_safe", False) is True


def reads_input_only(fn: object) -> bool:
    """Whether every statistic ``fn`` takes is of its input group (funcgrad's own rules
    and conditions, and ``when``/``&``/``|``/``~`` of them). Then ``fg.sharded`` may
    combine all statistics of all groups in one collective (``Shards.batched``); a
    rule that takes a statistic of its own intermediate result may not."""
    return is_shard_safe(fn) and getattr(fn, "_input_stats", False) is True


class _Rows(threading.local):
    def __init__(self) -> None:
        self.on = False


_ROWS = _Rows()
"""Whether the group being ruled is ``k`` equal groups stacked as rows (``fg.per_group``
on flat gradients, funcgrad/rules/_per_group.py: one rule call for equal-size groups that
repeat); every statistic is then taken per row, shape ``(k, 1)``."""


@contextlib.contextmanager
def rows() -> Iterator[None]:
    """Inside the block, each tensor of a group is ``(k, n)``: row ``i`` belongs to the
    ``i``-th of ``k`` groups, and every statistic is taken per row."""
    before, _ROWS.on = _ROWS.on, True
    try:
        yield
    finally:
        _ROWS.on = before


def in_rows() -> bool:
    """Whether statistics are taken per row (see :func:`rows`)."""
    return _ROWS.on


def any_(t: Tensor) -> Tensor:
    """``t.any()``: 0-d, or ``(k, 1)`` per row under :func:`rows`."""
    b = _bytes(t)
    if b is not None:  # max of the bytes: see _bytes
        return (b.amax(dim=-1, keepdim=True) if _ROWS.on else b.max()) != 0
    return t.any(dim=-1, keepdim=True) if _ROWS.on else t.any()


def all_(t: Tensor) -> Tensor:
    """``t.all()``: 0-d, or ``(k, 1)`` per row under :func:`rows`."""
    b = _bytes(t)
    if b is not None:  # min of the bytes: see _bytes
        return (b.amin(dim=-1, keepdim=True) if _ROWS.on else b.min()) != 0
    return t.all(dim=-1, keepdim=True) if _ROWS.on else t.all()


def _bytes(t: Tensor) -> Tensor | None:
    """A non-empty bool CPU tensor as its bytes (``uint8``, 0 or 1), eagerly and for
    a plain tensor only (not under ``vmap`` or ``grad``, not traced); else None.

    torch's CPU ``all()`` / ``any()`` of a bool tensor are far slower than
    ``min()`` / ``max()`` of the same bytes, and they are one of the seed rule's
    three passes in an eager step (figures: docs/compile-notes.md, "Figures behind
    the code"). Compiled, inductor's reductions are fast either way."""
    if (
        t.dtype is not torch.bool
        or t.device.type != "cpu"
        or compiling()
        or type(t) is not Tensor
        or t.numel() == 0
        or _compat.is_functorch_wrapped(t)
    ):
        return None
    return t.view(torch.uint8)


def batched(fn: Callable[[], T]) -> T:
    """``fn()``; under ``fg.sharded``, with all its statistics in one collective
    (``fn`` must take them of its inputs only: see :func:`reads_input_only`)."""
    ranks = shards()
    return fn() if ranks is None else ranks.batched(fn)


class _Named(Generic[Out]):
    """What :class:`Condition` and :class:`Rule` share: the function, its name, and
    ``shard_safe`` (``fn`` reads the group only through funcgrad's statistics, so
    ``fg.sharded`` may run it on each rank's rows; see the module docstring)."""

    def __init__(
        self,
        fn: Callable[[Group], Out],
        name: str,
        *,
        shard_safe: bool = False,
        _input_stats: bool = False,
        _eager: Callable[..., list[dict[str, Tensor]] | None] | None = None,
    ) -> None:
        self._fn = fn
        self._name = name
        self._input_stats = _input_stats
        self.shard_safe = shard_safe
        # fn on a list of groups for an eager step on plain CPU tensors (the same values,
        # fewer passes: funcgrad/rules/_eager.py), or None where those need fn
        self._eager = _eager

    def __call__(self, group: Group) -> Out:
        return self._fn(group)

    def __repr__(self) -> str:
        return self._name


class Condition(_Named[Tensor]):
    """A named function ``group -> 0-d bool tensor``; combine with ``&``, ``|``, ``~``.

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> c = rules.all_zero() | rules.any_nonfinite()
        >>> c
        (all_zero() | any_nonfinite())
        >>> c({"w": torch.tensor([0.0, float("nan")])})
        tensor(True)
    """

    def _join(self, fn: Callable[[Group], Tensor], name: str, *others: object) -> Condition:
        safe = self.shard_safe and all(is_shard_safe(o) for o in others)
        plain = reads_input_only(self) and all(reads_input_only(o) for o in others)
        return Condition(fn, name, shard_safe=safe, _input_stats=plain)

    def __and__(self, other: Condition) -> Condition:
        return self._join(lambda g: self(g) & other(g), f"({self} & {other})", other)

    def __or__(self, other: Condition) -> Condition:
        return self._join(lambda g: self(g) | other(g), f"({self} | {other})", other)

    def __invert__(self) -> Condition:
        return self._join(lambda g: ~self(g), f"~{self}")


class Rule(_Named[dict[str, Tensor]]):
    """A named rule ``group -> group`` (same keys, shapes and dtypes).

    ``shard_safe=True`` declares that ``fn`` is elementwise except for statistics
    taken through funcgrad's conditions (``fg.rules.all_zero()(group)`` and the like),
    so ``fg.sharded`` may run it on each rank's rows; without it, ``fg.per_group``
    gathers the group from all ranks first.

    Examples:
        >>> import torch
        >>> from funcgrad import rules
        >>> halve_dead = rules.Rule(
        ...     lambda g: {k: torch.where(rules.all_zero()(g), 0.5, t) for k, t in g.items()},
        ...     "halve_dead", shard_safe=True)
        >>> halve_dead({"w": torch.zeros(2)})
        {'w': tensor([0.5000, 0.5000])}
    """


def number(value: object, what: str, *, finite: bool = True) -> float:
    """``value`` as a float, or a clear error naming ``what``."""
    if not is_number(value):
        raise TypeError(f"{what} must be a real number, got {value!r}.")
    if finite and not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value!r}.")
    return float(value)


def any_of(flags: list[Tensor]) -> Tensor:
    """One 0-d bool per tensor, reduced once: stays on the device, no host sync.

    Sharded: true if it holds on any rank."""
    local = torch.stack(flags).any(0) if _ROWS.on else torch.stack(flags).any()
    ranks = shards()
    return local if ranks is None else ranks.any(local)


def group_norm(group: Group) -> Tensor:
    """The 2-norm of all entries of the group, as ``torch.nn.utils.clip_grad_norm_``.

    Half-precision gradients are accumulated in float32. Sharded: the root of the
    summed squares of every rank's rows.
    """
    norms = []
    for g in group.values():
        acc = torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else g.dtype
        if _ROWS.on:
            norms.append(torch.linalg.vector_norm(g, 2, dim=-1, keepdim=True, dtype=acc))
        else:
            norms.append(torch.linalg.vector_norm(g, 2, dtype=acc))
    local = torch.linalg.vector_norm(torch.stack(norms), 2, dim=0 if _ROWS.on else None)
    ranks = shards()
    return local if ranks is None else ranks.sum(local * local).sqrt()


def group_size(group: Group) -> int:
    """The number of entries of the group (of the whole gradients when sharded)."""
    ranks = shards()
    if _ROWS.on:
        return sum(t.shape[-1] for t in group.values())
    if ranks is None:
        return sum(t.numel() for t in group.values())
    return sum(ranks.numel(k) for k in group)


Bound = float | Tensor
"""What counts as zero: ``|g| <= bound``, a float (``atol``) or a 0-d tensor per group
(``atol + rtol * rms``: :func:`zero_bound`)."""


def zero_bound(group: Group, atol: float, rtol: float) -> Bound:
    """The zero tests' bound for ``group``: ``atol``, plus ``rtol`` times the group's
    root-mean-square gradient where ``rtol > 0`` (scale-aware: the same entries count
    as zero whatever the loss's scale, in float32 as in float64; docs/exact-zeros.md).
    A group whose RMS is not finite (an Inf or NaN entry) gets ``atol`` alone, so an
    overflow never turns its finite entries into "zeros". Sharded: the whole group's
    RMS (the squares summed over the ranks)."""
    if rtol == 0.0:
        return atol
    rms = group_norm(group) / math.sqrt(max(group_size(group), 1))
    return torch.where(torch.isfinite(rms), atol + rtol * rms, atol)


def is_zero(t: Tensor, atol: Bound = 0.0) -> Tensor:
    """``|t| <= atol`` elementwise (exactly ``t == 0`` for ``atol=0``; NaN is not zero);
    ``atol`` a float or a group's :func:`zero_bound`."""
    if isinstance(atol, float) and atol == 0.0:
        return t == 0
    return t.abs() <= atol


def zero_count(group: Group, atol: Bound = 0.0) -> Tensor:
    """The number of zeros (``|g| <= atol``) among all entries of the group (0-d int64).

    Sharded: summed over the ranks."""
    if _ROWS.on:
        parts = [is_zero(t, atol).sum(dim=-1, keepdim=True) for t in group.values()]
        return torch.stack(parts).sum(0)
    local = torch.stack([is_zero(t, atol).sum() for t in group.values()]).sum()
    ranks = shards()
    return local if ranks is None else ranks.sum(local)


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
