"""Functional Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
Algorithms"), the paper's update as optax's ``lion`` computes it::

The update math is in :func:`lion`'s docstring (rendered on the API site)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core._base import GradientTransformation
from ..core._invariants import invariants
from ._hparams import (
    DecayMask,
    Hyper,
    LearningRate,
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


class LionState(NamedTuple):
    """State of :func:`lion`: ``count`` (int64 0-d) and the momentum ``mu``."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    mu: dict[str, Tensor]
    hyperparams: Any = None  # lr, b1, b2, weight_decay (_hparams)


def _check_beta(i: int, name: str) -> Callable[[Any], None]:
    def check(b: Any) -> None:
        check_number(
            b, f"beta parameter at index {i}", lambda v: 0.0 <= v < 1.0,
            f"Invalid beta parameter at index {i}: {{}}", name,
        )  # fmt: skip

    return check


invariants(LionState, count="nonnegative", mu="finite", hyperparams="finite")
hyperparameters(
    LionState,
    lr=check_lr,
    b1=_check_beta(0, "b1"),
    b2=_check_beta(1, "b2"),
    weight_decay=check_weight_decay,
)


@optimizer
def lion(
    lr: LearningRate = 1e-4,
    b1: Hyper = 0.9,
    b2: Hyper = 0.99,
    weight_decay: Hyper = 0.0,
    *,
    mask: DecayMask = None,
) -> GradientTransformation:
    r"""Lion: the sign of an interpolated momentum, as optax's ``lion``.

        c_t  = sign((1 - b1) g_t + b1 m_{t-1})
        m_t  = (1 - b2) g_t + b2 m_{t-1}
        u_t  = -lr * (c_t + wd * p)                   (decay where mask says so)

    Every entry of every update is ``±lr`` (or 0) before weight decay: the step size is
    set by ``lr`` alone, so Lion takes a learning rate 3-10x smaller than AdamW's.

    ``lr``: a float, a 0-d tensor or
    a schedule; ``b1``, ``b2``, ``weight_decay``: floats or 0-d tensors. ``mask``:
    where weight decay applies (as ``fg.adamw``'s).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.lion(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, 1.0, 1.0])}
        >>> updates, _ = tx.update({"w": torch.tensor([3.0, -0.5, 1e-3])}, tx.init(params))
        >>> updates
        {'w': tensor([-0.1000,  0.1000, -0.1000])}
    """
    lr, b1, b2, weight_decay = map(scalar, (lr, b1, b2, weight_decay))
    check_hyperparameters(LionState, lr=lr, b1=b1, b2=b2, weight_decay=weight_decay)
    wd = off_if_zero(weight_decay)
    has_decay = wd is not None

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        s = {"neg_lr": -hp["lr"], "b1": hp["b1"], "b2": hp["b2"]}
        s["c1"], s["c2"] = 1.0 - s["b1"], 1.0 - s["b2"]
        if has_decay:
            s["wd"] = hp["weight_decay"]
        return s

    def kernel(e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g, p, s, o = e.g, e.p, e.s, e.o
        mu = e.slots["mu"]
        u = o.sign(o.add(o.mul(s["c1"], g), o.mul(s["b1"], mu)))
        if e.decays:
            assert p is not None
            u = o.add(u, o.mul(s["wd"], p))
        return o.mul(u, s["neg_lr"]), {"mu": o.add(o.mul(s["c2"], g), o.mul(s["b2"], mu))}

    hp = {"lr": hyper(lr), "b1": hyper(b1), "b2": hyper(b2), "weight_decay": wd}
    return elementwise(
        "fg.lion", LionState, {"mu": torch.zeros_like}, scalars, kernel, hp, has_decay, mask
    )
