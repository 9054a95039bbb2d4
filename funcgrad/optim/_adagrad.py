"""Functional Adagrad, step-for-step equal to ``torch.optim.Adagrad`` with the same
arguments (the update math: :func:`adagrad`'s docstring)."""

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


class AdagradState(NamedTuple):
    """State of :func:`adagrad`: ``count`` (int64 0-d) and the running ``sum`` of
    squared gradients (torch's state key)."""

    count: Tensor  # type: ignore[assignment]
    sum: dict[str, Tensor]  # type: ignore[assignment]  # shadows nothing callable here
    hyperparams: Any = None  # lr, lr_decay, weight_decay, eps (_hparams)


invariants(AdagradState, count="nonnegative", sum="finite nonnegative", hyperparams="finite")
hyperparameters(
    AdagradState,
    lr=check_lr,
    lr_decay=lambda v: check_number(
        v, "lr_decay value", lambda x: x >= 0.0, "Invalid lr_decay value: {}"
    ),
    weight_decay=check_weight_decay,
    eps=check_eps,
)


@optimizer
def adagrad(
    lr: LearningRate = 1e-2,
    lr_decay: Hyper = 0.0,
    weight_decay: Hyper = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: Hyper = 1e-10,
    *,
    maximize: bool = False,
    mask: DecayMask = None,
) -> GradientTransformation:
    r"""Adagrad, equal step for step to ``torch.optim.Adagrad`` with the same arguments.

    With step :math:`t` (1-based)::

        g_t <- -g_t                                   if maximize
        g_t <- g_t + wd * p                           if wd != 0 (where mask says so)
        s_t  = s_{t-1} + g_t^2                        s_0 = initial_accumulator_value
        u_t  = -lr / (1 + (t - 1) lr_decay) * g_t / (sqrt(s_t) + eps)

    The effective learning rate ``lr / (1 + (t - 1) * lr_decay)`` is computed in
    float64 like torch's.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.adagrad(lr=0.1, initial_accumulator_value=5.0)
        >>> params = {"w": torch.tensor([1.0])}
        >>> updates, state = tx.update({"w": torch.tensor([2.0])}, tx.init(params), params)
        >>> updates["w"], state.sum["w"]  # -0.1 * 2 / sqrt(5 + 4)
        (tensor([-0.0667]), tensor([9.]))
    """
    lr, lr_decay, weight_decay, eps = map(scalar, (lr, lr_decay, weight_decay, eps))
    check_hyperparameters(
        AdagradState, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps
    )
    check_bool(maximize, "maximize", "fg.adagrad")
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
    start = float(initial_accumulator_value)
    wd = off_if_zero(weight_decay)
    has_decay = wd is not None

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        t = count.to(torch.float64)
        s = {"neg_clr": -hp["lr"] / (1.0 + (t - 1.0) * hp["lr_decay"]), "eps": hp["eps"]}
        if has_decay:
            s["wd"] = hp["weight_decay"]
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

    return elementwise(
        "fg.adagrad",
        AdagradState,
        {"sum": lambda t: torch.full_like(t, start)},
        scalars,
        kernel,
        {"lr": hyper(lr), "lr_decay": hyper(lr_decay), "weight_decay": wd, "eps": hyper(eps)},
        has_decay,
        mask,
    )
