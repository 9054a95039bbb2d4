"""Schedule-Free AdamW and SGD (Defazio et al., 2024), step-for-step equal to the
``schedulefree`` package's ``AdamWScheduleFree`` and ``SGDScheduleFree`` with the same
arguments (the update math: :func:`schedule_free_adamw`'s docstring).

The parameters a step reads and writes are the *training point* ``y``; the state keeps
the base sequence ``z``; the *evaluation point* ``x`` (the average) is a pure function
of the two (:func:`schedule_free_eval`). ``fg.Optimizer.train()``/``eval()`` move the
module's parameters between ``y`` and ``x`` in place, as the package's do
(:func:`move`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core._base import GradientTransformation, Params
from ..core._invariants import invariants
from ._get_set import optimizer_states
from ._hparams import (
    DecayMask,
    Hyper,
    LearningRate,
    check_betas,
    check_eps,
    check_hyperparameters,
    check_lr,
    check_number,
    check_weight_decay,
    hyper,
    hyperparameters,
    off_if_zero,
    optimizer,
    scalar,
)
from ._kernel import Entry, elementwise


class ScheduleFreeAdamWState(NamedTuple):
    """State of :func:`schedule_free_adamw`: ``count`` (int64 0-d, steps taken; the
    package's ``k``), ``weight_sum`` and ``lr_max`` (float64 0-d, the package's group
    values), ``z`` (the base sequence: the parameters of the first step, taken then, as
    the package takes them; zeros before), ``exp_avg_sq``, and
    ``hyperparams`` (``lr``, ``betas``, ``eps``, ``weight_decay``, ``warmup_steps``,
    ``r``, ``weight_lr_power``)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    weight_sum: Tensor
    lr_max: Tensor
    z: dict[str, Tensor]
    exp_avg_sq: dict[str, Tensor]
    hyperparams: Any = None


class ScheduleFreeSGDState(NamedTuple):
    """State of :func:`schedule_free_sgd`: as :class:`ScheduleFreeAdamWState`, without
    ``exp_avg_sq``; ``hyperparams`` (``lr``, ``momentum``, ``weight_decay``,
    ``warmup_steps``, ``r``, ``weight_lr_power``)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    weight_sum: Tensor
    lr_max: Tensor
    z: dict[str, Tensor]
    hyperparams: Any = None


def _check_nonnegative(name: str) -> Any:
    def check(x: Any) -> None:
        check_number(x, name, lambda v: v >= 0.0, f"Invalid {name} value: {{}}")

    return check


def _check_momentum(x: Any) -> None:
    check_number(
        x, "momentum", lambda v: 0.0 < v < 1.0, "Momentum must be between 0 and 1 exclusive: {}"
    )


def _common_checks() -> dict[str, Any]:
    return dict(
        lr=check_lr,
        weight_decay=check_weight_decay,
        warmup_steps=_check_nonnegative("warmup_steps"),
        r=_check_nonnegative("r"),
        weight_lr_power=_check_nonnegative("weight_lr_power"),
    )


invariants(
    ScheduleFreeSGDState, count="nonnegative", weight_sum="finite nonnegative",
    lr_max="finite", z="finite", hyperparams="finite",
)  # fmt: skip
invariants(
    ScheduleFreeAdamWState, count="nonnegative", weight_sum="finite nonnegative",
    lr_max="finite", z="finite", exp_avg_sq="finite nonnegative", hyperparams="finite",
)  # fmt: skip
hyperparameters(ScheduleFreeAdamWState, betas=check_betas, eps=check_eps, **_common_checks())
hyperparameters(ScheduleFreeSGDState, momentum=_check_momentum, **_common_checks())


def _averaging(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
    """The step's learning rate and averaging weight, and the carried values, as the
    package computes them in Python doubles (``k`` is ``count - 1``)."""
    k1 = count.to(torch.float64)  # k + 1
    warm = hp["warmup_steps"]
    sched = torch.where(k1 - 1.0 < warm, k1 / torch.where(warm > 0, warm, 1.0), 1.0)
    lr = hp["lr"] * sched
    lr_max = torch.maximum(lr, hp["lr_max"])
    weight = torch.pow(k1, hp["r"]) * torch.pow(lr_max, hp["weight_lr_power"])
    weight_sum = hp["weight_sum"] + weight
    ckp1 = torch.where(weight_sum != 0, weight / torch.where(weight_sum != 0, weight_sum, 1.0), 0.0)
    first = (count == 1).to(torch.float64)  # z starts as the first step's parameters
    return {"lr": lr, "lr_max": lr_max, "weight_sum": weight_sum, "ckp1": ckp1, "first": first}


def _carry() -> dict[str, Any]:
    def zero(count: Tensor, hp: dict[str, Any]) -> Tensor:
        return torch.zeros((), dtype=torch.float64, device=count.device)

    def minus_one(count: Tensor, hp: dict[str, Any]) -> Tensor:
        return torch.full((), -1.0, dtype=torch.float64, device=count.device)

    return {"weight_sum": zero, "lr_max": minus_one}


@optimizer
def schedule_free_adamw(
    lr: LearningRate = 0.0025,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    warmup_steps: Hyper = 0,
    r: Hyper = 0.0,
    weight_lr_power: Hyper = 2.0,
    *,
    mask: DecayMask = None,
) -> GradientTransformation:
    r"""Schedule-Free AdamW, equal step for step to ``schedulefree.AdamWScheduleFree``
    with the same arguments: no learning-rate schedule, the average built in.

    The parameters are the training point :math:`y`; the state keeps :math:`z`
    (the parameters of the first step, as the package takes them then: parameters
    loaded after ``tx.init`` are the start). With gradient :math:`g` (taken at :math:`y`), step
    :math:`k` (0-based)::

        lr_k  = lr * min(1, (k + 1) / warmup_steps)      (lr without warmup)
        lr_max = max(lr_max, lr_k)
        w_k   = (k + 1)^r * lr_max^weight_lr_power
        c_k   = w_k / (w_0 + ... + w_k)
        v     = b2 v + (1 - b2) g^2
        d     = g / (sqrt(v / (1 - b2^(k+1))) + eps) + wd * y      (wd where mask says)
        y    <- lerp(y, z, c_k) + lr_k (b1 (1 - c_k) - 1) d
        z    <- z - lr_k d

    The evaluation point (the average :math:`x`) is ``fg.schedule_free_eval(params,
    state)``; ``fg.Optimizer``'s ``eval()``/``train()`` move the module's parameters
    to it and back, as the package's do. The package's arguments in its order (its
    ``foreach`` flag dropped); the numbers are floats, 0-d tensors or schedules, held
    in the state (``fg.set_hyperparams``). ``mask``: where weight decay applies.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.schedule_free_adamw(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> state = tx.init(params)
        >>> for g in ([2.0, -3.0], [1.0, 1.0]):
        ...     updates, state = tx.update({"w": torch.tensor(g)}, state, params)
        ...     params = fg.apply_updates(params, updates)
        >>> params["w"], fg.schedule_free_eval(params, state)["w"]  # y, and x = the average
        (tensor([ 0.8652, -0.9246]), tensor([ 0.8684, -0.9224]))
    """
    betas = tuple(map(scalar, betas)) if isinstance(betas, (tuple, list)) else betas
    lr, eps, weight_decay = scalar(lr), scalar(eps), scalar(weight_decay)
    warmup_steps, r, weight_lr_power = scalar(warmup_steps), scalar(r), scalar(weight_lr_power)
    check_hyperparameters(
        ScheduleFreeAdamWState, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
        warmup_steps=warmup_steps, r=r, weight_lr_power=weight_lr_power,
    )  # fmt: skip
    wd = off_if_zero(weight_decay)
    has_decay = wd is not None

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        b1, b2 = hp["betas"]
        a = _averaging(count, hp)
        s = {
            "weight_sum": a["weight_sum"],
            "lr_max": a["lr_max"],
            "ckp1": a["ckp1"],
            "first": a["first"],
            "c_y": a["lr"] * (b1 * (1.0 - a["ckp1"]) - 1.0),
            "neg_lr": -a["lr"],
            "b2": b2,
            "c2": 1.0 - b2,
            "bc2": 1.0 - torch.pow(b2, count.to(torch.float64)),
            "eps": hp["eps"],
        }
        if has_decay:
            s["wd"] = hp["weight_decay"]
        return s

    def kernel(e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g, y, s, o = e.g, e.p, e.s, e.o
        assert y is not None
        # the package's addcmul(v, g, g, value=1 - b2), as torch computes it
        v = o.add(o.mul(e.slots["exp_avg_sq"], s["b2"]), o.mul(o.mul(g, s["c2"]), g))
        d = o.div(g, o.add(o.sqrt(o.div(v, s["bc2"])), s["eps"]))
        if e.decays:
            d = o.add(d, o.mul(y, s["wd"]))
        z = o.where(s["first"] != 0, y, e.slots["z"])
        new_y = o.add(o.lerp(y, z, s["ckp1"]), o.mul(d, s["c_y"]))
        return o.sub(new_y, y), {"z": o.add(z, o.mul(d, s["neg_lr"])), "exp_avg_sq": v}

    slots = {"z": torch.zeros_like, "exp_avg_sq": torch.zeros_like}
    hp = {
        "lr": hyper(lr), "betas": hyper(betas), "eps": hyper(eps), "weight_decay": wd,
        "warmup_steps": hyper(warmup_steps), "r": hyper(r),
        "weight_lr_power": hyper(weight_lr_power),
    }  # fmt: skip
    return elementwise(
        "fg.schedule_free_adamw", ScheduleFreeAdamWState, slots, scalars, kernel, hp,
        has_decay, mask, carry=_carry(), reads_params=True,
    )  # fmt: skip


@optimizer
def schedule_free_sgd(
    lr: LearningRate = 1.0,
    momentum: Hyper = 0.9,
    weight_decay: Hyper = 0.0,
    warmup_steps: Hyper = 0,
    r: Hyper = 0.0,
    weight_lr_power: Hyper = 2.0,
    *,
    mask: DecayMask = None,
) -> GradientTransformation:
    r"""Schedule-Free SGD, equal step for step to ``schedulefree.SGDScheduleFree`` with
    the same arguments.

    As :func:`schedule_free_adamw` with ``d = g + wd * y`` (no second moment) and
    ``momentum`` in the place of ``b1``::

        y <- lerp(y, z, c_k) + lr_k (momentum (1 - c_k) - 1) d
        z <- z - lr_k d

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.schedule_free_sgd(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> updates, state = tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(params), params)
        >>> fg.apply_updates(params, updates)["w"], state.z["w"]  # the first step is SGD's
        (tensor([ 0.8000, -0.7000]), tensor([ 0.8000, -0.7000]))
    """
    lr, momentum, weight_decay = scalar(lr), scalar(momentum), scalar(weight_decay)
    warmup_steps, r, weight_lr_power = scalar(warmup_steps), scalar(r), scalar(weight_lr_power)
    check_hyperparameters(
        ScheduleFreeSGDState, lr=lr, momentum=momentum, weight_decay=weight_decay,
        warmup_steps=warmup_steps, r=r, weight_lr_power=weight_lr_power,
    )  # fmt: skip
    wd = off_if_zero(weight_decay)
    has_decay = wd is not None

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        a = _averaging(count, hp)
        s = {
            "weight_sum": a["weight_sum"],
            "lr_max": a["lr_max"],
            "ckp1": a["ckp1"],
            "first": a["first"],
            "c_y": a["lr"] * (hp["momentum"] * (1.0 - a["ckp1"]) - 1.0),
            "neg_lr": -a["lr"],
        }
        if has_decay:
            s["wd"] = hp["weight_decay"]
        return s

    def kernel(e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g, y, s, o = e.g, e.p, e.s, e.o
        assert y is not None
        if e.decays:
            g = o.add(g, o.mul(y, s["wd"]))
        z = o.where(s["first"] != 0, y, e.slots["z"])
        new_y = o.add(o.lerp(y, z, s["ckp1"]), o.mul(g, s["c_y"]))
        return o.sub(new_y, y), {"z": o.add(z, o.mul(g, s["neg_lr"]))}

    hp = {
        "lr": hyper(lr), "momentum": hyper(momentum), "weight_decay": wd,
        "warmup_steps": hyper(warmup_steps), "r": hyper(r),
        "weight_lr_power": hyper(weight_lr_power),
    }  # fmt: skip
    return elementwise(
        "fg.schedule_free_sgd", ScheduleFreeSGDState, {"z": torch.zeros_like}, scalars, kernel, hp,
        has_decay, mask, carry=_carry(), reads_params=True,
    )  # fmt: skip


_STATES = (ScheduleFreeAdamWState, ScheduleFreeSGDState)


def _beta1(s: Any) -> Tensor:
    hp = s.hyperparams
    return hp["betas"][0] if isinstance(s, ScheduleFreeAdamWState) else hp["momentum"]


def schedule_free_eval(params: Params, state: Any) -> dict[str, Tensor]:
    """The evaluation point of a schedule-free optimizer: the average
    :math:`x = \\mathrm{lerp}(y, z, 1 - 1/b_1)` for the parameters each schedule-free
    state inside ``state`` holds (``z``), the others as given; a pure function (it
    compiles, and differentiates). Evaluate the model there
    (``fg.call(model, fg.schedule_free_eval(params, state), x)``) and train on
    ``params``. The package's ``opt.eval()`` computes the same, in place.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.schedule_free_sgd(lr=0.1, momentum=0.5)
        >>> params = {"w": torch.tensor([1.0])}
        >>> state = tx.init(params)
        >>> for g in (2.0, 1.0):
        ...     updates, state = tx.update({"w": torch.tensor([g])}, state, params)
        ...     params = fg.apply_updates(params, updates)
        >>> params["w"], state.z["w"], fg.schedule_free_eval(params, state)["w"]  # x: z's mean
        (tensor([0.7250]), tensor([0.7000]), tensor([0.7500]))
    """
    out = dict(params.items())
    found = [s for s in optimizer_states(state) if isinstance(s, _STATES)]
    if not found:
        raise TypeError(
            "fg.schedule_free_eval: the state holds no schedule-free optimizer state "
            "(fg.schedule_free_adamw or fg.schedule_free_sgd); other optimizers train and "
            "evaluate at the same parameters."
        )
    for s in found:
        for name in s.z.keys():
            y = params[name]
            w = (1.0 - 1.0 / _beta1(s)).to(y.dtype)
            x = torch.lerp(y, s.z[name].to(y.dtype), w)
            out[name] = torch.where(s.count > 0, x, y)  # before the first step: y itself
    return out


def move(state: Any, params: Mapping[str, Tensor], to_eval: bool) -> None:
    """In place, as the package's ``eval()``/``train()``: the parameters each
    schedule-free state inside ``state`` holds go from the training point to the
    evaluation point (``to_eval``) or back. Eager only (``fg.Optimizer``)."""
    for s in optimizer_states(state):
        if not isinstance(s, _STATES) or int(s.count) == 0:
            continue  # before the first step, as the package (no z yet): nothing moves
        b1 = float(_beta1(s))
        weight = 1.0 - 1.0 / b1 if to_eval else 1.0 - b1
        for name in s.z.keys():
            p = params[name]
            p.lerp_(s.z[name].to(p.device), weight)


def holds_schedule_free(state: Any) -> bool:
    """Whether ``state`` holds a schedule-free optimizer state (``fg.Optimizer``: its
    ``train()``/``eval()`` modes matter)."""
    return any(isinstance(s, _STATES) for s in optimizer_states(state))
