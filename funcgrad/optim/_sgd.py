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
    as64,
    check_lr,
    check_number,
    check_weight_decay,
    hyper,
    nonzero,
)
from ._kernel import Entry, elementwise


class SGDState(NamedTuple):
    """State of :func:`sgd`: ``count`` (int64 0-d, steps taken) and the momentum
    buffers (an empty dict without momentum)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    momentum_buffer: dict[str, Tensor]
    lr: Any = None  # float64 0-d: the learning rate, or its factor (_hparams.lr_start)


invariants(SGDState, count="nonnegative", momentum_buffer="finite", lr="finite nonnegative")


def sgd(
    lr: LearningRate = 1e-3,
    momentum: Hyper = 0.0,
    dampening: Hyper = 0.0,
    nesterov: bool = False,
    weight_decay: Hyper = 0.0,
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

    ``lr`` is a float, a 0-d tensor or
    a schedule ``count -> lr``; ``momentum``, ``dampening`` and ``weight_decay`` are
    floats or 0-d tensors (learnable under ``torch.func.grad``). ``mask`` says where
    weight decay applies (``fg.adamw``'s ``mask``): equal to ``torch.optim.SGD`` with a
    decay and a no-decay param group.

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
    check_lr(lr)
    check_number(momentum, "momentum value", lambda v: v >= 0.0, "Invalid momentum value: {}")
    check_number(dampening, "dampening value", lambda v: True, "")
    check_weight_decay(weight_decay)
    has_momentum = nonzero(momentum)
    if nesterov and (not has_momentum or nonzero(dampening)):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    m, damp, wd = hyper(momentum), hyper(dampening), hyper(weight_decay)
    has_decay = nonzero(wd)

    def scalars(count: Tensor, lr_t: Tensor) -> dict[str, Tensor]:
        s = {"neg_lr": -lr_t}
        if has_decay:
            s["wd"] = as64(wd, count)
        if has_momentum:
            s["momentum"] = as64(m, count)
            s["keep"] = 1.0 - as64(damp, count)
            s["first"] = (count == 1).to(torch.float64)
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
        later = o.add(o.mul(e.slots["momentum_buffer"], s["momentum"]), o.mul(s["keep"], g))
        buf = o.where(s["first"] != 0, g, later)
        g = o.add(g, o.mul(s["momentum"], buf)) if nesterov else buf
        return o.mul(g, s["neg_lr"]), {"momentum_buffer": buf}

    return elementwise(
        "fg.sgd",
        SGDState,
        {"momentum_buffer": torch.zeros_like} if has_momentum else {},
        scalars,
        kernel,
        lr,
        has_decay,
        mask,
    )
