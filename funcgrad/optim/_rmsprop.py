"""Functional RMSprop, step-for-step equal to ``torch.optim.RMSprop`` with the same
arguments (the update math: :func:`rmsprop`'s docstring)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core._base import GradientTransformation
from ..core._invariants import invariants
from ._hparams import (
    DecayMask,
    Hyper,
    LearningRate,
    check_bool,
    check_eps,
    check_hyperparameters,
    check_lr,
    check_momentum,
    check_number,
    check_weight_decay,
    hyper,
    hyperparameters,
    off_if_zero,
    optimizer,
    scalar,
)
from ._kernel import Entry, elementwise


class RMSpropState(NamedTuple):
    """State of :func:`rmsprop`: ``count`` (int64 0-d), ``square_avg``, and the
    ``momentum_buffer`` (with momentum) and ``grad_avg`` (centered), else empty dicts.
    Field names are torch's state keys."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    square_avg: dict[str, Tensor]
    momentum_buffer: dict[str, Tensor]
    grad_avg: dict[str, Tensor]
    hyperparams: Any = None  # lr, alpha, eps, weight_decay, momentum (_hparams)


invariants(
    RMSpropState,
    count="nonnegative",
    square_avg="finite nonnegative",
    momentum_buffer="finite",
    grad_avg="finite",
    hyperparams="finite",
)
hyperparameters(
    RMSpropState,
    lr=check_lr,
    alpha=lambda v: check_number(v, "alpha value", lambda x: x >= 0.0, "Invalid alpha value: {}"),
    eps=check_eps,
    weight_decay=check_weight_decay,
    momentum=check_momentum,
)


@optimizer
def rmsprop(
    lr: LearningRate = 1e-2,
    alpha: Hyper = 0.99,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    momentum: Hyper = 0.0,
    centered: bool = False,
    *,
    maximize: bool = False,
    mask: DecayMask = None,
) -> GradientTransformation:
    r"""RMSprop, equal step for step to ``torch.optim.RMSprop`` with the same arguments.

    With gradient :math:`g_t` and parameters :math:`p`::

        g_t <- -g_t                                   if maximize
        g_t <- g_t + wd * p                           if wd != 0 (where mask says so)
        v_t  = alpha * v_{t-1} + (1 - alpha) g_t^2
        a_t  = lerp(a_{t-1}, g_t, 1 - alpha)          if centered
        d_t  = sqrt(v_t - a_t^2) + eps                if centered, else sqrt(v_t) + eps
        b_t  = momentum * b_{t-1} + g_t / d_t         if momentum != 0
        u_t  = -lr * b_t                              if momentum != 0, else -lr * g_t / d_t

    torch's arguments in its positional order (``maximize``, ``mask`` keyword-only);
    the numbers are floats, 0-d tensors or schedules, held in the state
    (``fg.set_hyperparams``). ``mask``: where weight decay applies (as ``fg.adamw``'s).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.rmsprop(lr=0.01, alpha=0.5)
        >>> params = {"w": torch.tensor([1.0])}
        >>> updates, _ = tx.update({"w": torch.tensor([2.0])}, tx.init(params), params)
        >>> updates  # -0.01 * 2 / sqrt(0.5 * 4)
        {'w': tensor([-0.0141])}
    """
    lr, alpha, eps, weight_decay, momentum = map(scalar, (lr, alpha, eps, weight_decay, momentum))
    check_hyperparameters(
        RMSpropState, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum
    )
    check_bool(centered, "centered", "fg.rmsprop")
    check_bool(maximize, "maximize", "fg.rmsprop")
    wd, m = off_if_zero(weight_decay), off_if_zero(momentum)
    has_decay, has_momentum = wd is not None, m is not None

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        s = {"neg_lr": -hp["lr"], "alpha": hp["alpha"], "eps": hp["eps"]}
        s["one_minus_alpha"] = 1.0 - s["alpha"]
        if has_decay:
            s["wd"] = hp["weight_decay"]
        if has_momentum:
            s["momentum"] = hp["momentum"]
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
    hp = {
        "lr": hyper(lr), "alpha": hyper(alpha), "eps": hyper(eps), "weight_decay": wd,
        "momentum": m,
    }  # fmt: skip
    return elementwise("fg.rmsprop", RMSpropState, slots, scalars, kernel, hp, has_decay, mask)
