"""Functional Rprop, step-for-step equal to ``torch.optim.Rprop`` with the same
arguments (the update math: :func:`rprop`'s docstring)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core._base import GradientTransformation
from ..core._invariants import invariants
from ._hparams import (
    Hyper,
    LearningRate,
    check_bool,
    check_hyperparameters,
    check_lr,
    hyper,
    hyperparameters,
    optimizer,
    scalar,
)
from ._kernel import Entry, elementwise


class RpropState(NamedTuple):
    """State of :func:`rprop`: ``count`` (int64 0-d, steps taken), ``prev`` (the last
    gradient, zero where its sign flipped) and ``step_size`` (torch's state keys), and
    ``hyperparams`` (``lr``, ``etas``, ``step_sizes``)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    prev: dict[str, Tensor]
    step_size: dict[str, Tensor]
    hyperparams: Any = None


def _check_etas(etas: Any) -> None:
    if not (isinstance(etas, (tuple, list)) and len(etas) == 2):
        raise ValueError(f"Invalid etas: {etas!r}; expected a pair (etaminus, etaplus).")
    if all(isinstance(e, (int, float)) for e in etas):
        if not 0.0 < etas[0] < 1.0 < etas[1]:
            raise ValueError(f"Invalid eta values: {etas[0]}, {etas[1]}")


def _check_step_sizes(sizes: Any) -> None:
    if not (isinstance(sizes, (tuple, list)) and len(sizes) == 2):
        raise ValueError(f"Invalid step_sizes: {sizes!r}; expected a pair (min, max).")


invariants(
    RpropState, count="nonnegative", prev="finite", step_size="finite nonnegative",
    hyperparams="finite",
)  # fmt: skip
hyperparameters(RpropState, lr=check_lr, etas=_check_etas, step_sizes=_check_step_sizes)


@optimizer
def rprop(
    lr: LearningRate = 1e-2,
    etas: tuple[Hyper, Hyper] = (0.5, 1.2),
    step_sizes: tuple[Hyper, Hyper] = (1e-6, 50),
    *,
    maximize: bool = False,
) -> GradientTransformation:
    r"""Rprop (resilient backpropagation), equal step for step to ``torch.optim.Rprop``
    with the same arguments.

    With gradient :math:`g_t`, each entry's step size :math:`s` (``lr`` at the start)
    and the previous gradient :math:`q` (zero at the start)::

        g_t <- -g_t                                   if maximize
        f    = etaplus if g_t q > 0, etaminus if g_t q < 0, else 1
        s   <- clamp(s * f, step_sizes[0], step_sizes[1])
        g_t <- 0 where f == etaminus                  (the sign flipped: no step)
        p   <- p - sign(g_t) * s,   q <- g_t

    The step sizes start at ``lr`` rounded to the parameter's dtype, as torch's
    ``full_like``. Rprop uses the gradient's sign only: for full-batch training. It runs
    tensor by tensor (its comparisons have no multi-tensor form).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.rprop(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> updates, _ = tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(params), params)
        >>> updates  # -sign(g) * lr
        {'w': tensor([-0.1000,  0.1000])}
    """
    lr = scalar(lr)
    etas = tuple(map(scalar, etas)) if isinstance(etas, (tuple, list)) else etas
    step_sizes = (
        tuple(map(scalar, step_sizes)) if isinstance(step_sizes, (tuple, list)) else step_sizes
    )
    check_hyperparameters(RpropState, lr=lr, etas=etas, step_sizes=step_sizes)
    check_bool(maximize, "maximize", "fg.rprop")

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        minus, plus = hp["etas"]
        low, high = hp["step_sizes"]
        first = (count == 1).to(torch.float64)
        return {"lr": hp["lr"], "minus": minus, "plus": plus, "low": low, "high": high,
                "first": first}  # fmt: skip

    def kernel(e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g, s, o = e.g, e.s, e.o
        if maximize:
            g = o.neg(g)
        start = s["lr"].to(e.stored).to(g.dtype)  # torch.full_like(grad, lr)
        size = o.where(s["first"] != 0, start, e.slots["step_size"])
        sign = o.sign(o.mul(g, e.slots["prev"]))
        f = o.where(sign > 0, s["plus"], sign)
        f = o.where(f < 0, s["minus"], f)
        f = o.where(f == 0, torch.ones_like(s["plus"]), f)
        size = torch.clamp(o.mul(size, f), s["low"], s["high"])
        g = o.where(f == s["minus"], torch.zeros_like(s["plus"]), g)
        # torch's addcmul(p, sign(g), size, value=-1) computes (-1 * sign(g)) * size
        return o.mul(o.neg(o.sign(g)), size), {"prev": g, "step_size": size}

    slots = {"prev": torch.zeros_like, "step_size": torch.zeros_like}
    hp = {"lr": hyper(lr), "etas": hyper(etas), "step_sizes": hyper(step_sizes)}
    return elementwise(
        "fg.rprop", RpropState, slots, scalars, kernel, hp, False, None, multi_tensor=False
    )
