"""Functional RAdam, step-for-step equal to ``torch.optim.RAdam`` with the same
arguments (the update math: :func:`radam`'s docstring)."""

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
    check_betas,
    check_bool,
    check_eps,
    check_hyperparameters,
    check_lr,
    check_weight_decay,
    hyper,
    hyperparameters,
    off_if_zero,
    optimizer,
    scalar,
)
from ._kernel import Entry, elementwise


class RAdamState(NamedTuple):
    """State of :func:`radam`: ``count`` (int64 0-d, steps taken), ``exp_avg`` and
    ``exp_avg_sq`` (torch's state keys), and ``hyperparams`` (``lr``, ``betas``,
    ``eps``, ``weight_decay``)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    exp_avg: dict[str, Tensor]
    exp_avg_sq: dict[str, Tensor]
    hyperparams: Any = None


invariants(
    RAdamState,
    count="nonnegative",
    exp_avg="finite",
    exp_avg_sq="finite nonnegative",
    hyperparams="finite",
)
hyperparameters(
    RAdamState, lr=check_lr, betas=check_betas, eps=check_eps, weight_decay=check_weight_decay
)


@optimizer
def radam(
    lr: LearningRate = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
    mask: DecayMask = None,
) -> GradientTransformation:
    r"""RAdam (rectified Adam), equal step for step to ``torch.optim.RAdam`` with the
    same arguments.

    With gradient :math:`g_t`, parameters :math:`p`, step :math:`t` (1-based)::

        g_t  <- -g_t                                   if maximize
        g_t  <- g_t + wd * p                           if wd != 0, not decoupled
        m_t   = lerp(m_{t-1}, g_t, 1 - b1)
        v_t   = b2 v_{t-1} + (1 - b2) g_t^2
        rho_inf = 2 / (1 - b2) - 1
        rho_t   = rho_inf - 2 t b2^t / (1 - b2^t)
        a_t   = lr * m_t / (1 - b1^t)
        u_t   = -a_t * sqrt(1 - b2^t) / (sqrt(v_t) + eps) * r_t   if rho_t > 5, else -a_t
        r_t   = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))
        u_t  <- u_t - lr * wd * p                      if wd != 0, decoupled

    torch's arguments in its positional order (``decoupled_weight_decay`` is its fifth;
    ``maximize``, ``mask`` keyword-only); the numbers are floats, 0-d tensors or
    schedules, held in the state (``fg.set_hyperparams``). Both branches are computed
    and one is chosen per step by the step count (no host read: it compiles to one
    graph). ``mask``: where weight decay applies (as ``fg.adamw``'s).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.radam(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> updates, _ = tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(params), params)
        >>> fg.apply_updates(params, updates)  # rho_1 <= 5: -lr * (bias-corrected m) = -lr g
        {'w': tensor([ 0.8000, -0.7000])}
    """
    betas = tuple(map(scalar, betas)) if isinstance(betas, (tuple, list)) else betas
    lr, eps, weight_decay = scalar(lr), scalar(eps), scalar(weight_decay)
    check_hyperparameters(RAdamState, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    check_bool(decoupled_weight_decay, "decoupled_weight_decay", "fg.radam")
    check_bool(maximize, "maximize", "fg.radam")
    decoupled = decoupled_weight_decay
    wd = off_if_zero(weight_decay)
    has_decay = wd is not None

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        # As torch computes them in Python doubles.
        t = count.to(torch.float64)
        b1, b2 = hp["betas"]
        bc1 = 1.0 - torch.pow(b1, t)
        bc2 = 1.0 - torch.pow(b2, t)
        rho_inf = 2.0 / (1.0 - b2) - 1.0
        rho_t = rho_inf - 2.0 * t * torch.pow(b2, t) / bc2
        on = rho_t > 5.0
        # the rectification where it is used; elsewhere a finite stand-in (not used)
        r_t, r_inf = torch.where(on, rho_t, 6.0), torch.where(on, rho_inf, 6.0)
        rect = torch.pow(
            (r_t - 4.0) * (r_t - 2.0) * r_inf / ((r_inf - 4.0) * (r_inf - 2.0) * r_t), 0.5
        )
        s = {
            "lr": hp["lr"],
            "bc1": bc1,
            "sqrt_bc2": torch.pow(bc2, 0.5),
            "rect": rect,
            "on": on.to(torch.float64),
            "c1": 1.0 - b1,
            "c2": 1.0 - b2,
            "b2": b2,
            "eps": hp["eps"],
        }
        if has_decay:
            s["wd"] = hp["weight_decay"]
            if decoupled:
                s["lr_decay"] = hp["lr"] * hp["weight_decay"]
        return s

    def kernel(e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g, p, s, o = e.g, e.p, e.s, e.o
        if maximize:
            g = o.neg(g)
        if e.decays and not decoupled:
            assert p is not None
            g = o.add(g, o.mul(p, s["wd"]))
        m = o.lerp(e.slots["exp_avg"], g, s["c1"])
        # torch's addcmul(v, g, g, value=1 - b2) computes ((1 - b2) * g) * g
        v = o.add(o.mul(e.slots["exp_avg_sq"], s["b2"]), o.mul(o.mul(g, s["c2"]), g))
        a = o.mul(o.div(m, s["bc1"]), s["lr"])
        adaptive = o.div(s["sqrt_bc2"], o.add(o.sqrt(v), s["eps"]))
        rectified = o.mul(o.mul(a, adaptive), s["rect"])
        u = o.neg(o.where(s["on"] != 0, rectified, a))
        if e.decays and decoupled:
            assert p is not None
            u = o.sub(u, o.mul(p, s["lr_decay"]))
        return u, {"exp_avg": m, "exp_avg_sq": v}

    slots = {"exp_avg": torch.zeros_like, "exp_avg_sq": torch.zeros_like}
    hp = {"lr": hyper(lr), "betas": hyper(betas), "eps": hyper(eps), "weight_decay": wd}
    return elementwise("fg.radam", RAdamState, slots, scalars, kernel, hp, has_decay, mask)
