"""Functional SGD, step-for-step equal to ``torch.optim.SGD`` with the same arguments.

The update math is in :func:`sgd`'s docstring (rendered on the API site)."""

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
    check_hyperparameters,
    check_lr,
    check_momentum,
    check_number,
    check_weight_decay,
    hyper,
    hyperparameters,
    nonzero,
    off_if_zero,
    optimizer,
    scalar,
)
from ._kernel import Entry, elementwise


class SGDState(NamedTuple):
    """State of :func:`sgd`: ``count`` (int64 0-d, steps taken), the momentum buffers
    (an empty dict without momentum) and ``hyperparams`` (``lr``, ``momentum``,
    ``dampening``, ``weight_decay``: the values of the next step)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    momentum_buffer: dict[str, Tensor]
    hyperparams: Any = None


invariants(SGDState, count="nonnegative", momentum_buffer="finite", hyperparams="finite")
hyperparameters(
    SGDState,
    lr=check_lr,
    momentum=check_momentum,
    dampening=lambda v: check_number(v, "dampening value", lambda x: True, ""),
    weight_decay=check_weight_decay,
)


@optimizer
def sgd(
    lr: LearningRate = 1e-3,
    momentum: Hyper = 0.0,
    dampening: Hyper = 0.0,
    weight_decay: Hyper = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    mask: DecayMask = None,
) -> GradientTransformation:
    r"""Stochastic gradient descent, equal step for step to ``torch.optim.SGD``.

    With gradient :math:`g_t`, parameters :math:`p`, momentum buffer :math:`b`::

        g_t <- -g_t                                   if maximize
        g_t <- g_t + wd * p                           if wd != 0 (where mask says so)
        b_t  = g_t                                    on the first step, then
        b_t  = momentum * b_{t-1} + (1 - dampening) g_t
        g_t <- g_t + momentum * b_t                   if nesterov, else g_t <- b_t
        u_t  = -lr * g_t

    (the middle three lines only with ``momentum != 0``). The first step copies the
    gradient into the buffer, as torch does: the state's ``count`` says which step it is.

    The arguments are torch's, in its positional order (``fg.sgd(0.1, 0.9, 0.0, 5e-4)``
    is ``lr, momentum, dampening, weight_decay``); ``maximize`` and ``mask`` are
    keyword-only. ``lr``, ``momentum``, ``dampening`` and ``weight_decay`` are floats,
    0-d tensors (learnable under ``torch.func.grad``) or schedules, held in the state
    (``fg.set_hyperparams``). ``mask`` says where weight decay applies (``fg.adamw``'s
    ``mask``): equal to ``torch.optim.SGD`` with a decay and a no-decay param group.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.sgd(lr=0.1, momentum=0.9)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     updates, state = tx.update({"w": torch.tensor([1.0, 2.0])}, state, params)
        ...     params = fg.apply_updates(params, updates)
        >>> params  # buffer 1 then 1.9 (times the gradient): 1 - 0.1 - 0.19
        {'w': tensor([ 0.7100, -1.5800])}
    """
    lr, momentum, dampening, weight_decay = map(scalar, (lr, momentum, dampening, weight_decay))
    check_hyperparameters(
        SGDState, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay
    )
    check_bool(nesterov, "nesterov", "fg.sgd")
    check_bool(maximize, "maximize", "fg.sgd")
    m, wd = off_if_zero(momentum), off_if_zero(weight_decay)
    has_momentum, has_decay = m is not None, wd is not None
    if nesterov and (not has_momentum or nonzero(dampening)):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        s = {"neg_lr": -hp["lr"]}
        if has_decay:
            s["wd"] = hp["weight_decay"]
        if has_momentum:
            s["momentum"] = hp["momentum"]
            s["keep"] = 1.0 - hp["dampening"]
            s["first"] = (count == 1).to(torch.float64)
            s["on"] = (hp["momentum"] != 0).to(torch.float64)
        return s

    def kernel(e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g, p, s, o = e.g, e.p, e.s, e.o
        if maximize:
            g = o.neg(g)
        if e.decays:
            assert p is not None
            g = o.add(g, o.mul(s["wd"], p))
        if not has_momentum:
            return o.mul(g, s["neg_lr"]), {}
        old = e.slots["momentum_buffer"]
        later = o.add(o.mul(old, s["momentum"]), o.mul(s["keep"], g))
        buf = o.where(s["first"] != 0, g, later)
        d = o.add(g, o.mul(s["momentum"], buf)) if nesterov else buf
        # momentum written to 0.0 while training: plain SGD, the buffer left as it is
        # (torch skips both); off from the start, the slot is not built at all
        on = s["on"] != 0
        return o.mul(o.where(on, d, g), s["neg_lr"]), {"momentum_buffer": o.where(on, buf, old)}

    hp = {"lr": hyper(lr), "momentum": m, "dampening": hyper(dampening), "weight_decay": wd}
    return elementwise(
        "fg.sgd",
        SGDState,
        {"momentum_buffer": torch.zeros_like} if has_momentum else {},
        scalars,
        kernel,
        hp,
        has_decay,
        mask,
    )
