"""Functional NAdam, step-for-step equal to ``torch.optim.NAdam`` with the same
arguments (the update math: :func:`nadam`'s docstring)."""

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
    check_number,
    check_weight_decay,
    hyper,
    hyperparameters,
    off_if_zero,
    optimizer,
    scalar,
    torch_scalar_dtype,
)
from ._kernel import Entry, elementwise


class NAdamState(NamedTuple):
    """State of :func:`nadam`: ``count`` (int64 0-d, steps taken), ``mu_product`` (the
    running product of the momentum coefficients, a 0-d tensor in torch's scalar dtype:
    float32 unless the default dtype is float64, as torch keeps it), ``exp_avg`` and
    ``exp_avg_sq`` (torch's state keys), and ``hyperparams`` (``lr``, ``betas``,
    ``eps``, ``weight_decay``, ``momentum_decay``)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    mu_product: Tensor
    exp_avg: dict[str, Tensor]
    exp_avg_sq: dict[str, Tensor]
    hyperparams: Any = None


def _check_momentum_decay(x: Any) -> None:
    check_number(x, "momentum_decay", lambda v: v >= 0.0, "Invalid momentum_decay value: {}")


invariants(
    NAdamState,
    count="nonnegative",
    mu_product="finite nonnegative",
    exp_avg="finite",
    exp_avg_sq="finite nonnegative",
    hyperparams="finite",
)
hyperparameters(
    NAdamState,
    lr=check_lr,
    betas=check_betas,
    eps=check_eps,
    weight_decay=check_weight_decay,
    momentum_decay=_check_momentum_decay,
)


@optimizer
def nadam(
    lr: LearningRate = 2e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    momentum_decay: Hyper = 4e-3,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
    mask: DecayMask = None,
) -> GradientTransformation:
    r"""NAdam (Adam with Nesterov momentum), equal step for step to
    ``torch.optim.NAdam`` with the same arguments.

    With gradient :math:`g_t`, parameters :math:`p`, step :math:`t` (1-based)::

        g_t  <- -g_t                                  if maximize
        g_t  <- g_t + wd * p                          if wd != 0, not decoupled
        mu_t  = b1 (1 - 0.96^(t psi) / 2)             psi = momentum_decay
        P_t   = P_{t-1} mu_t                          P_0 = 1 (mu_product)
        m_t   = lerp(m_{t-1}, g_t, 1 - b1)
        v_t   = b2 v_{t-1} + (1 - b2) g_t^2
        d_t   = sqrt(v_t / (1 - b2^t)) + eps
        u_t   = -lr (1 - mu_t) / (1 - P_t) g_t / d_t
                - lr mu_{t+1} / (1 - P_t mu_{t+1}) m_t / d_t
        u_t  <- u_t - lr * wd * p                     if wd != 0, decoupled

    torch's arguments in its positional order (``decoupled_weight_decay`` its sixth;
    ``maximize``, ``mask`` keyword-only); the numbers are floats, 0-d tensors or
    schedules, held in the state (``fg.set_hyperparams``). The running product
    :math:`P_t` is kept where torch keeps it, in a 0-d float32 tensor (float64 when
    that is the default dtype), and multiplied in that dtype, so the steps equal
    torch's in float64 too. ``mask``: where weight decay applies (as ``fg.adamw``'s).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.nadam(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> updates, state = tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(params), params)
        >>> fg.apply_updates(params, updates)
        {'w': tensor([ 0.8944, -0.8944])}
        >>> state.mu_product  # torch's opt.state[p]["mu_product"] after one step
        tensor(0.4501)
    """
    betas = tuple(map(scalar, betas)) if isinstance(betas, (tuple, list)) else betas
    lr, eps, weight_decay = scalar(lr), scalar(eps), scalar(weight_decay)
    momentum_decay = scalar(momentum_decay)
    check_hyperparameters(
        NAdamState, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
        momentum_decay=momentum_decay,
    )  # fmt: skip
    check_bool(decoupled_weight_decay, "decoupled_weight_decay", "fg.nadam")
    check_bool(maximize, "maximize", "fg.nadam")
    decoupled = decoupled_weight_decay
    wd = off_if_zero(weight_decay)
    has_decay = wd is not None

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        # As torch computes them in Python doubles, except the product it keeps.
        t = count.to(torch.float64)
        b1, b2 = hp["betas"]
        lr, psi = hp["lr"], hp["momentum_decay"]
        mu = b1 * (1.0 - 0.5 * torch.pow(0.96, t * psi))
        mu_next = b1 * (1.0 - 0.5 * torch.pow(0.96, (t + 1.0) * psi))
        kept = hp["mu_product"]
        product = kept * mu.to(kept.dtype)  # torch: mu_product *= mu, in its dtype
        p64 = product.to(torch.float64)
        s = {
            "mu_product": product,
            "c1": 1.0 - b1,
            "b2": b2,
            "c2": 1.0 - b2,
            "bc2": 1.0 - torch.pow(b2, t),
            "eps": hp["eps"],
            "cg": -lr * (1.0 - mu) / (1.0 - p64),
            "cm": -lr * mu_next / (1.0 - p64 * mu_next),
        }
        if has_decay:
            s["wd"] = hp["weight_decay"]
            if decoupled:
                s["lr_decay"] = lr * hp["weight_decay"]
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
        d = o.add(o.sqrt(o.div(v, s["bc2"])), s["eps"])
        # torch's addcdiv(p, x, d, value=c) adds c * (x / d)
        u = o.add(o.mul(o.div(g, d), s["cg"]), o.mul(o.div(m, d), s["cm"]))
        if e.decays and decoupled:
            assert p is not None
            u = o.sub(u, o.mul(p, s["lr_decay"]))
        return u, {"exp_avg": m, "exp_avg_sq": v}

    def ones(count: Tensor, hp: dict[str, Any]) -> Tensor:
        return torch.ones((), dtype=torch_scalar_dtype(), device=count.device)

    slots = {"exp_avg": torch.zeros_like, "exp_avg_sq": torch.zeros_like}
    hp = {
        "lr": hyper(lr), "betas": hyper(betas), "eps": hyper(eps), "weight_decay": wd,
        "momentum_decay": hyper(momentum_decay),
    }  # fmt: skip
    return elementwise(
        "fg.nadam", NAdamState, slots, scalars, kernel, hp, has_decay, mask,
        carry={"mu_product": ones},
    )  # fmt: skip
