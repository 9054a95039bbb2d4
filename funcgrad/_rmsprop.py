r"""Functional RMSprop and Adagrad, step-for-step equal to ``torch.optim.RMSprop`` /
``torch.optim.Adagrad`` with the same arguments.

RMSprop, with gradient :math:`g_t` and parameters :math:`p`::

    g_t <- -g_t                                   if maximize
    g_t <- g_t + wd * p                           if wd != 0 (where mask says so)
    v_t  = alpha * v_{t-1} + (1 - alpha) g_t^2
    a_t  = lerp(a_{t-1}, g_t, 1 - alpha)          if centered
    d_t  = sqrt(v_t - a_t^2) + eps                if centered, else sqrt(v_t) + eps
    b_t  = momentum * b_{t-1} + g_t / d_t         if momentum != 0
    u_t  = -lr * b_t                              if momentum != 0, else -lr * g_t / d_t

Adagrad, with step :math:`t` (1-based)::

    g_t <- -g_t ; g_t <- g_t + wd * p             (maximize; weight decay)
    s_t  = s_{t-1} + g_t^2                        s_0 = initial_accumulator_value
    u_t  = -lr / (1 + (t - 1) lr_decay) * g_t / (sqrt(s_t) + eps)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._base import GradientTransformation, shardable
from ._hparams import DecayMask, Hyper, LearningRate, as64, check_lr, check_number, hyper
from ._invariants import invariants
from ._optim import Entry, Spec, build
from ._sgd import nonzero


class RMSpropState(NamedTuple):
    """State of :func:`rmsprop`: ``count`` (int64 0-d), ``square_avg``, and the
    ``momentum_buffer`` (with momentum) and ``grad_avg`` (centered), else empty dicts.
    Field names are torch's state keys."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    square_avg: dict[str, Tensor]
    momentum_buffer: dict[str, Tensor]
    grad_avg: dict[str, Tensor]
    lr: Any = None  # float64 0-d: the learning rate, or its factor (funcgrad._hparams.lr_start)


class AdagradState(NamedTuple):
    """State of :func:`adagrad`: ``count`` (int64 0-d) and the running ``sum`` of
    squared gradients (torch's state key)."""

    count: Tensor  # type: ignore[assignment]
    sum: dict[str, Tensor]  # type: ignore[assignment]  # shadows nothing callable here
    lr: Any = None  # float64 0-d: the learning rate, or its factor (funcgrad._hparams.lr_start)


invariants(
    RMSpropState,
    count="nonnegative",
    square_avg="finite nonnegative",
    momentum_buffer="finite",
    grad_avg="finite",
    lr="finite nonnegative",
)
invariants(AdagradState, count="nonnegative", sum="finite nonnegative", lr="finite nonnegative")


def _check_decay(weight_decay: Hyper) -> None:
    check_number(
        weight_decay, "weight_decay value", lambda v: v >= 0.0, "Invalid weight_decay value: {}"
    )


def rmsprop(
    lr: LearningRate = 1e-2,
    alpha: Hyper = 0.99,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    momentum: Hyper = 0.0,
    centered: bool = False,
    maximize: bool = False,
    mask: DecayMask = None,
) -> GradientTransformation:
    """RMSprop, equal step for step to ``torch.optim.RMSprop`` with the same arguments.

    The update rule is in this module's docstring. ``lr``: a float, a 0-d tensor or a
    schedule; the other numbers floats or 0-d tensors. ``mask``: where weight decay
    applies (as ``fg.adamw``'s).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.rmsprop(lr=0.01, alpha=0.5)
        >>> params = {"w": torch.tensor([1.0])}
        >>> updates, _ = tx.update({"w": torch.tensor([2.0])}, tx.init(params), params)
        >>> updates  # -0.01 * 2 / sqrt(0.5 * 4)
        {'w': tensor([-0.0141])}
    """
    check_lr(lr)
    check_number(eps, "epsilon value", lambda v: v >= 0.0, "Invalid epsilon value: {}")
    check_number(momentum, "momentum value", lambda v: v >= 0.0, "Invalid momentum value: {}")
    _check_decay(weight_decay)
    check_number(alpha, "alpha value", lambda v: v >= 0.0, "Invalid alpha value: {}")
    a, e, wd, m = hyper(alpha), hyper(eps), hyper(weight_decay), hyper(momentum)
    has_decay, has_momentum = nonzero(wd), nonzero(m)

    def scalars(count: Tensor, lr_t: Tensor) -> dict[str, Tensor]:
        s = {"neg_lr": -lr_t, "alpha": as64(a, count), "eps": as64(e, count)}
        s["one_minus_alpha"] = 1.0 - s["alpha"]
        if has_decay:
            s["wd"] = as64(wd, count)
        if has_momentum:
            s["momentum"] = as64(m, count)
        return s

    def kernel(e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g, p, slots, s, o = e.g, e.p, e.slots, e.s, e.o
        if maximize:
            g = o.neg(g)
        if e.decays:
            assert p is not None
            g = o.add(g, o.mul(s["wd"], p))
        # torch's addcmul(g, g, value=c) computes (c * g) * g
        v = o.add(o.mul(slots["square_avg"], s["alpha"]), o.mul(o.mul(s["one_minus_alpha"], g), g))
        out = {"square_avg": v}
        if centered:
            avg_g = o.lerp(slots["grad_avg"], g, s["one_minus_alpha"])
            out["grad_avg"] = avg_g
            denom = o.add(o.sqrt(o.sub(v, o.mul(avg_g, avg_g))), s["eps"])
        else:
            denom = o.add(o.sqrt(v), s["eps"])
        if has_momentum:
            buf = o.add(o.mul(slots["momentum_buffer"], s["momentum"]), o.div(g, denom))
            out["momentum_buffer"] = buf
            return o.mul(buf, s["neg_lr"]), out
        return o.mul(o.div(g, denom), s["neg_lr"]), out

    slots = {"square_avg": torch.zeros_like}
    if has_momentum:
        slots["momentum_buffer"] = torch.zeros_like
    if centered:
        slots["grad_avg"] = torch.zeros_like
    spec = Spec(
        who="fg.rmsprop",
        state=RMSpropState,
        slots=slots,
        scalars=scalars,
        kernel=kernel,
        lr=lr,
        needs_params=has_decay,
        elementwise=True,
        has_decay=has_decay,
        mask=mask,
    )
    return shardable(build(spec), by_entry=not callable(mask))


def adagrad(
    lr: LearningRate = 1e-2,
    lr_decay: Hyper = 0.0,
    weight_decay: Hyper = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: Hyper = 1e-10,
    maximize: bool = False,
    mask: DecayMask = None,
) -> GradientTransformation:
    """Adagrad, equal step for step to ``torch.optim.Adagrad`` with the same arguments.

    The update rule is in this module's docstring; the effective learning rate
    ``lr / (1 + (t - 1) * lr_decay)`` is computed in float64 like torch's.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.adagrad(lr=0.1, initial_accumulator_value=5.0)
        >>> params = {"w": torch.tensor([1.0])}
        >>> updates, state = tx.update({"w": torch.tensor([2.0])}, tx.init(params), params)
        >>> updates["w"], state.sum["w"]  # -0.1 * 2 / sqrt(5 + 4)
        (tensor([-0.0667]), tensor([9.]))
    """
    check_lr(lr)
    check_number(lr_decay, "lr_decay value", lambda v: v >= 0.0, "Invalid lr_decay value: {}")
    _check_decay(weight_decay)
    check_number(
        initial_accumulator_value,
        "initial_accumulator_value value",
        lambda v: v >= 0.0,
        "Invalid initial_accumulator_value value: {}",
    )
    if isinstance(initial_accumulator_value, Tensor):
        raise TypeError(
            "Invalid initial_accumulator_value: a float, not a tensor (it only sets where "
            "the state starts)."
        )
    check_number(eps, "epsilon value", lambda v: v >= 0.0, "Invalid epsilon value: {}")
    decay_rate, wd, e = hyper(lr_decay), hyper(weight_decay), hyper(eps)
    start = float(initial_accumulator_value)
    has_decay = nonzero(wd)

    def scalars(count: Tensor, lr_t: Tensor) -> dict[str, Tensor]:
        t = count.to(torch.float64)
        s = {"neg_clr": -lr_t / (1.0 + (t - 1.0) * as64(decay_rate, count)), "eps": as64(e, count)}
        if has_decay:
            s["wd"] = as64(wd, count)
        return s

    def kernel(e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g, p, s, o = e.g, e.p, e.s, e.o
        if maximize:
            g = o.neg(g)
        if e.decays:
            assert p is not None
            g = o.add(g, o.mul(s["wd"], p))
        acc = o.add(e.slots["sum"], o.mul(g, g))
        return o.mul(o.div(g, o.add(o.sqrt(acc), s["eps"])), s["neg_clr"]), {"sum": acc}

    spec = Spec(
        who="fg.adagrad",
        state=AdagradState,
        slots={"sum": lambda t: torch.full_like(t, start)},
        scalars=scalars,
        kernel=kernel,
        lr=lr,
        needs_params=has_decay,
        elementwise=True,
        has_decay=has_decay,
        mask=mask,
    )
    return shardable(build(spec), by_entry=not callable(mask))
