"""Functional Adadelta, step-for-step equal to ``torch.optim.Adadelta`` with the same
arguments (the update math: :func:`adadelta`'s docstring)."""

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
    check_number,
    check_weight_decay,
    hyper,
    hyperparameters,
    off_if_zero,
    optimizer,
    scalar,
)
from ._kernel import Entry, elementwise


class AdadeltaState(NamedTuple):
    """State of :func:`adadelta`: ``count`` (int64 0-d, steps taken), ``square_avg``
    and ``acc_delta`` (torch's state keys), and ``hyperparams`` (``lr``, ``rho``,
    ``eps``, ``weight_decay``)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    square_avg: dict[str, Tensor]
    acc_delta: dict[str, Tensor]
    hyperparams: Any = None


invariants(
    AdadeltaState,
    count="nonnegative",
    square_avg="finite nonnegative",
    acc_delta="finite nonnegative",
    hyperparams="finite",
)
hyperparameters(
    AdadeltaState,
    lr=check_lr,
    rho=lambda v: check_number(v, "rho value", lambda x: 0.0 <= x <= 1.0, "Invalid rho value: {}"),
    eps=check_eps,
    weight_decay=check_weight_decay,
)


@optimizer
def adadelta(
    lr: LearningRate = 1.0,
    rho: Hyper = 0.9,
    eps: Hyper = 1e-6,
    weight_decay: Hyper = 0.0,
    *,
    maximize: bool = False,
    mask: DecayMask = None,
) -> GradientTransformation:
    r"""Adadelta, equal step for step to ``torch.optim.Adadelta`` with the same arguments.

    With gradient :math:`g_t` and parameters :math:`p`::

        g_t <- -g_t                                   if maximize
        g_t <- g_t + wd * p                           if wd != 0 (where mask says so)
        v_t  = rho v_{t-1} + (1 - rho) g_t^2
        d_t  = sqrt(a_{t-1} + eps) / sqrt(v_t + eps) * g_t
        a_t  = rho a_{t-1} + (1 - rho) d_t^2
        p   <- p - lr * d_t

    torch's arguments in its positional order (``maximize``, ``mask`` keyword-only);
    the numbers are floats, 0-d tensors or schedules, held in the state
    (``fg.set_hyperparams``). ``mask``: where weight decay applies (as ``fg.adamw``'s).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.adadelta(lr=1.0, rho=0.5, eps=1e-2)
        >>> params = {"w": torch.tensor([1.0])}
        >>> updates, _ = tx.update({"w": torch.tensor([2.0])}, tx.init(params), params)
        >>> updates  # -sqrt(0.01) / sqrt(0.5 * 4 + 0.01) * 2
        {'w': tensor([-0.1411])}
    """
    lr, rho, eps, weight_decay = map(scalar, (lr, rho, eps, weight_decay))
    check_hyperparameters(AdadeltaState, lr=lr, rho=rho, eps=eps, weight_decay=weight_decay)
    check_bool(maximize, "maximize", "fg.adadelta")
    wd = off_if_zero(weight_decay)
    has_decay = wd is not None

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        del count
        s = {"neg_lr": -hp["lr"], "rho": hp["rho"], "c": 1.0 - hp["rho"], "eps": hp["eps"]}
        if has_decay:
            s["wd"] = hp["weight_decay"]
        return s

    def kernel(e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g, p, s, o = e.g, e.p, e.s, e.o
        if maximize:
            g = o.neg(g)
        if e.decays:
            assert p is not None
            g = o.add(g, o.mul(p, s["wd"]))
        # torch's addcmul(v, g, g, value=c) computes (c * g) * g
        v = o.add(o.mul(e.slots["square_avg"], s["rho"]), o.mul(o.mul(g, s["c"]), g))
        std = o.sqrt(o.add(v, s["eps"]))
        delta = o.mul(o.div(o.sqrt(o.add(e.slots["acc_delta"], s["eps"])), std), g)
        a = o.add(o.mul(e.slots["acc_delta"], s["rho"]), o.mul(o.mul(delta, s["c"]), delta))
        return o.mul(delta, s["neg_lr"]), {"square_avg": v, "acc_delta": a}

    slots = {"square_avg": torch.zeros_like, "acc_delta": torch.zeros_like}
    hp = {"lr": hyper(lr), "rho": hyper(rho), "eps": hyper(eps), "weight_decay": wd}
    return elementwise("fg.adadelta", AdadeltaState, slots, scalars, kernel, hp, has_decay, mask)
