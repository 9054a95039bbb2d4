"""Schedules ``count -> value`` made of tensor ops, with optax's definitions.

``count`` is the number of steps already taken, as a float64 0-d tensor (0 on the
first step, like ``LambdaLR``'s epoch). Every schedule here is built from
``torch.clamp`` / ``torch.where`` / ``torch.cos`` on that tensor: no Python branch
on its value, so a compiled step never recompiles as the count grows, and the value
is computed in double precision like torch's own learning rates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..core._base import is_int, is_number

Schedule = Callable[[Tensor], Tensor]


def _as_count(count: Tensor) -> Tensor:
    return torch.as_tensor(count).to(torch.float64)


def _steps(value: object, what: str) -> int:
    if not is_int(value) or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}.")
    return value


def _real(value: object, what: str) -> float:
    if not is_number(value) or not math.isfinite(value):
        raise TypeError(f"{what} must be a finite real number, got {value!r}.")
    return float(value)


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """A cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``.

    With ``c = min(count, decay_steps) / decay_steps``:
    ``value = init_value * ((1 - alpha) * (1 + cos(pi * c)) / 2 + alpha)`` (optax's
    ``cosine_decay_schedule``); the closed form of
    ``CosineAnnealingLR(T_max=decay_steps, eta_min=alpha * init_value)`` up to
    ``decay_steps``, then constant.

    Examples:
        >>> import torch, funcgrad as fg
        >>> sched = fg.cosine_decay(1.0, 10)
        >>> [round(float(sched(torch.tensor(c))), 3) for c in (0, 5, 10, 20)]
        [1.0, 0.5, 0.0, 0.0]
    """
    init_value = _real(init_value, "fg.cosine_decay: init_value")
    if not is_int(decay_steps) or decay_steps <= 0:
        raise ValueError(f"fg.cosine_decay: decay_steps must be > 0, got {decay_steps}.")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"fg.cosine_decay: alpha must be in [0, 1], got {alpha}.")

    def schedule(count: Tensor) -> Tensor:
        frac = torch.clamp(_as_count(count), max=decay_steps) / decay_steps
        cos = 0.5 * (1.0 + torch.cos(math.pi * frac))
        return init_value * ((1.0 - alpha) * cos + alpha)

    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """A straight line from ``init_value`` to ``end_value`` over ``transition_steps``.

    ``value = init_value + (end_value - init_value) * min(count, transition_steps) /
    transition_steps`` (optax's ``linear_schedule``); constant at ``end_value`` after.
    Equal to ``LinearLR(start_factor=init/base, end_factor=end/base,
    total_iters=transition_steps)`` for a base lr ``base``.

    Examples:
        >>> import torch, funcgrad as fg
        >>> warmup = fg.linear_schedule(0.0, 1.0, 4)
        >>> [float(warmup(torch.tensor(c))) for c in (0, 1, 4, 9)]
        [0.0, 0.25, 1.0, 1.0]
    """
    init_value = _real(init_value, "fg.linear_schedule: init_value")
    end_value = _real(end_value, "fg.linear_schedule: end_value")
    steps = _steps(transition_steps, "fg.linear_schedule: transition_steps")

    def schedule(count: Tensor) -> Tensor:
        frac = torch.clamp(_as_count(count), min=0.0, max=steps) / steps
        return init_value + (end_value - init_value) * frac

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Schedule ``i`` up to ``boundaries[i]``, then schedule ``i + 1`` on ``count -
    boundaries[i]`` (optax's ``join_schedules``).

    Examples:
        >>> import torch, funcgrad as fg
        >>> s = fg.join_schedules([fg.linear_schedule(0.0, 1.0, 2), fg.cosine_decay(1.0, 2)], [2])
        >>> [round(float(s(torch.tensor(c))), 3) for c in range(5)]
        [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    schedules = list(schedules)
    boundaries = list(boundaries)
    for i, s in enumerate(schedules):
        if not callable(s):
            raise TypeError(
                f"fg.join_schedules: schedules[{i}] is a {type(s).__name__}, not a schedule "
                "(a callable count -> value). For a constant, pass lambda count: value."
            )
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"fg.join_schedules: {len(schedules)} schedules need {len(schedules) - 1} "
            f"boundaries, got {len(boundaries)}."
        )
    for i, b in enumerate(boundaries):
        if not is_int(b) or b < 0:
            raise ValueError(f"fg.join_schedules: boundaries[{i}] must be an int >= 0, got {b!r}.")
    if boundaries != sorted(boundaries):
        raise ValueError(f"fg.join_schedules: boundaries must increase, got {boundaries}.")

    def schedule(count: Tensor) -> Tensor:
        count = _as_count(count)
        out = torch.as_tensor(schedules[0](count), dtype=torch.float64)
        for boundary, nxt in zip(boundaries, schedules[1:], strict=True):
            out = torch.where(count < boundary, out, nxt(count - boundary))
        return out

    return schedule


def warmup_cosine_decay(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then a
    cosine decay to ``end_value`` at ``decay_steps`` (warmup included), as optax's
    ``warmup_cosine_decay_schedule``.

    ``join_schedules([linear_schedule(init_value, peak_value, warmup_steps),
    cosine_decay(peak_value, decay_steps - warmup_steps, end_value / peak_value)],
    [warmup_steps])``: in torch terms, ``SequentialLR([LinearLR, CosineAnnealingLR],
    milestones=[warmup_steps])``.

    Examples:
        >>> import torch, funcgrad as fg
        >>> s = fg.warmup_cosine_decay(0.0, 1.0, warmup_steps=2, decay_steps=4)
        >>> [round(float(s(torch.tensor(c))), 3) for c in range(6)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    peak_value = _real(peak_value, "fg.warmup_cosine_decay: peak_value")
    end_value = _real(end_value, "fg.warmup_cosine_decay: end_value")
    warmup = _steps(warmup_steps, "fg.warmup_cosine_decay: warmup_steps")
    if not is_int(decay_steps) or decay_steps <= warmup:
        raise ValueError(
            "fg.warmup_cosine_decay: decay_steps counts the warmup too and must be > "
            f"warmup_steps ({warmup}), got {decay_steps!r}."
        )
    if peak_value == 0.0 or not 0.0 <= end_value / peak_value <= 1.0:
        raise ValueError(
            f"fg.warmup_cosine_decay: end_value ({end_value}) must lie between 0 and "
            f"peak_value ({peak_value}), which must not be 0."
        )
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup),
            cosine_decay(peak_value, decay_steps - warmup, end_value / peak_value),
        ],
        [warmup],
    )
