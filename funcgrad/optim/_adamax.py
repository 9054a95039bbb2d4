"""Functional Adamax, step-for-step equal to ``torch.optim.Adamax`` with the same
arguments (the update math: :func:`adamax`'s docstring)."""

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


class AdamaxState(NamedTuple):
    """State of :func:`adamax`: ``count`` (int64 0-d, steps taken), ``exp_avg`` (the
    first moment) and ``exp_inf`` (the exponentially weighted infinity norm), torch's
    state keys, and ``hyperparams`` (``lr``, ``betas``, ``eps``, ``weight_decay``)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    exp_avg: dict[str, Tensor]
    exp_inf: dict[str, Tensor]
    hyperparams: Any = None


invariants(
    AdamaxState,
    count="nonnegative",
    exp_avg="finite",
    exp_inf="finite nonnegative",
    hyperparams="finite",
)
hyperparameters(
    AdamaxState, lr=check_lr, betas=check_betas, eps=check_eps, weight_decay=check_weight_decay
)


@optimizer
def adamax(
    lr: LearningRate = 2e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    *,
    maximize: bool = False,
    mask: DecayMask = None,
) -> GradientTransformation:
    r"""Adamax (Adam with the infinity norm), equal step for step to
    ``torch.optim.Adamax`` with the same arguments.

    With gradient :math:`g_t`, parameters :math:`p`, step :math:`t` (1-based)::

        g_t <- -g_t                                   if maximize
        g_t <- g_t + wd * p                           if wd != 0 (where mask says so)
        m_t  = lerp(m_{t-1}, g_t, 1 - b1)
        u_t  = max(b2 * u_{t-1}, |g_t| + eps)
        p   <- p - lr / (1 - b1^t) * m_t / u_t

    torch's arguments in its positional order (``maximize``, ``mask`` keyword-only);
    the numbers are floats, 0-d tensors or schedules, held in the state
    (``fg.set_hyperparams``). ``mask``: where weight decay applies (as ``fg.adamw``'s).
    float16/bfloat16 parameters compute in float32 and keep their moments in their
    own dtype, as the other optimizers.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.adamax(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> updates, state = tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(params), params)
        >>> fg.apply_updates(params, updates)  # the first step is -lr * sign(g)
        {'w': tensor([ 0.9000, -0.9000])}
    """
    betas = tuple(map(scalar, betas)) if isinstance(betas, (tuple, list)) else betas
    lr, eps, weight_decay = scalar(lr), scalar(eps), scalar(weight_decay)
    check_hyperparameters(AdamaxState, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    check_bool(maximize, "maximize", "fg.adamax")
    wd = off_if_zero(weight_decay)
    has_decay = wd is not None

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        # torch: clr = lr / (1 - b1^t) in Python doubles, then addcdiv with value -clr
        b1, b2 = hp["betas"]
        s = {
            "neg_clr": -(hp["lr"] / (1.0 - torch.pow(b1, count.to(torch.float64)))),
            "c1": 1.0 - b1,
            "b2": b2,
            "eps": hp["eps"],
        }
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
        m = o.lerp(e.slots["exp_avg"], g, s["c1"])
        u = o.maximum(o.mul(e.slots["exp_inf"], s["b2"]), o.add(o.abs(g), s["eps"]))
        # torch's addcdiv(p, m, u, value=-clr) computes (-clr * m) / u
        return o.div(o.mul(m, s["neg_clr"]), u), {"exp_avg": m, "exp_inf": u}

    slots = {"exp_avg": torch.zeros_like, "exp_inf": torch.zeros_like}
    hp = {"lr": hyper(lr), "betas": hyper(betas), "eps": hyper(eps), "weight_decay": wd}
    return elementwise("fg.adamax", AdamaxState, slots, scalars, kernel, hp, has_decay, mask)
