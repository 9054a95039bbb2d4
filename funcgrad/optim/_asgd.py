"""Functional ASGD (averaged SGD), step-for-step equal to ``torch.optim.ASGD`` with the
same arguments (the update math: :func:`asgd`'s docstring)."""

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


class ASGDState(NamedTuple):
    """State of :func:`asgd`: ``count`` (int64 0-d, steps taken), ``eta`` (the step
    size of the next step) and ``mu`` (the averaging weight of the next step), 0-d
    tensors in torch's scalar dtype (float32 unless the default dtype is float64, as
    torch keeps them), ``ax`` (the averaged parameters), torch's state keys, and
    ``hyperparams`` (``lr``, ``lambd``, ``alpha``, ``t0``, ``weight_decay``)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    eta: Tensor
    mu: Tensor
    ax: dict[str, Tensor]
    hyperparams: Any = None


def _check_any(name: str) -> Any:
    def check(x: Any) -> None:  # torch checks none of these; a number, finite
        check_number(x, name, lambda v: v == v and abs(v) != float("inf"), f"Invalid {name}: {{}}")

    return check


invariants(
    ASGDState, count="nonnegative", eta="finite", mu="finite nonnegative", ax="finite",
    hyperparams="finite",
)  # fmt: skip
hyperparameters(
    ASGDState, lr=check_lr, lambd=_check_any("lambd"), alpha=_check_any("alpha"),
    t0=_check_any("t0"), weight_decay=check_weight_decay,
)  # fmt: skip


@optimizer
def asgd(
    lr: LearningRate = 1e-2,
    lambd: Hyper = 1e-4,
    alpha: Hyper = 0.75,
    t0: Hyper = 1e6,
    weight_decay: Hyper = 0.0,
    *,
    maximize: bool = False,
    mask: DecayMask = None,
) -> GradientTransformation:
    r"""ASGD (averaged stochastic gradient descent), equal step for step to
    ``torch.optim.ASGD`` with the same arguments, the averaged parameters included.

    With gradient :math:`g_t`, parameters :math:`p`, step :math:`t` (1-based), step
    size :math:`\eta` (``lr`` on the first step) and averaging weight :math:`\mu`
    (1 on the first step), both carried in the state from the step before::

        g_t  <- -g_t                                   if maximize
        g_t  <- g_t + wd * p                           if wd != 0 (where mask says so)
        p    <- p (1 - lambd eta) - eta g_t
        ax   <- ax + mu (p - ax)                       (p itself while mu = 1)
        eta  <- lr / (1 + lambd lr t)^alpha            for the next step
        mu   <- 1 / max(1, t - t0)                     for the next step

    torch's arguments in its positional order (``maximize``, ``mask`` keyword-only);
    the numbers are floats, 0-d tensors or schedules, held in the state
    (``fg.set_hyperparams``). ``eta`` and ``mu`` are kept where torch keeps them, in
    0-d float32 tensors (float64 when that is the default dtype), so the steps equal
    torch's in float64 too. The averaged parameters are ``state.ax`` (torch's
    ``opt.state[p]["ax"]``): evaluate with them, e.g. ``fg.call(model, state.ax, x)``.
    ``mask``: where weight decay applies (``lambd``'s decay applies everywhere, as
    in torch).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.asgd(lr=0.1, t0=0)  # average from the second step on
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> state = tx.init(params)
        >>> for g in ([2.0, -3.0], [1.0, 1.0], [0.0, 2.0]):
        ...     updates, state = tx.update({"w": torch.tensor(g)}, state, params)
        ...     params = fg.apply_updates(params, updates)
        >>> params["w"], state.ax["w"]  # ax: the mean of the last two steps' parameters
        (tensor([ 0.7000, -1.0000]), tensor([ 0.7000, -0.9000]))
    """
    lr, lambd, alpha, t0 = scalar(lr), scalar(lambd), scalar(alpha), scalar(t0)
    weight_decay = scalar(weight_decay)
    check_hyperparameters(
        ASGDState, lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay
    )
    check_bool(maximize, "maximize", "fg.asgd")
    wd = off_if_zero(weight_decay)
    has_decay = wd is not None

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        # As torch computes them in Python doubles, from the eta and mu it keeps.
        t = count.to(torch.float64)
        lr, lambd = hp["lr"], hp["lambd"]
        kept_eta, kept_mu = hp["eta"], hp["mu"]
        # torch sets eta from the learning rate of its first step (its state starts there)
        eta = torch.where(count == 1, lr.to(kept_eta.dtype), kept_eta).to(torch.float64)
        mu = kept_mu.to(torch.float64)
        s = {
            "eta": (lr / torch.pow(1.0 + lambd * lr * t, hp["alpha"])).to(kept_eta.dtype),
            "mu": (1.0 / torch.clamp(t - hp["t0"], min=1.0)).to(kept_mu.dtype),
            "keep": 1.0 - lambd * eta,
            "neg_eta": -eta,
            "avg": mu,
            "copy": (mu == 1.0).to(torch.float64),
        }
        if has_decay:
            s["wd"] = hp["weight_decay"]
        return s

    def kernel(e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g, p, s, o = e.g, e.p, e.s, e.o
        assert p is not None
        if maximize:
            g = o.neg(g)
        if e.decays:
            g = o.add(g, o.mul(p, s["wd"]))
        # torch: p.mul_(1 - lambd * eta); p.add_(g, alpha=-eta)
        new = o.add(o.mul(p, s["keep"]), o.mul(g, s["neg_eta"]))
        ax = e.slots["ax"]
        averaged = o.add(ax, o.mul(o.sub(new, ax), s["avg"]))
        return o.sub(new, p), {"ax": o.where(s["copy"] != 0, new, averaged)}

    def eta0(count: Tensor, hp: dict[str, Any]) -> Tensor:
        return hp["lr"].to(torch_scalar_dtype()).to(count.device)

    def mu0(count: Tensor, hp: dict[str, Any]) -> Tensor:
        return torch.ones((), dtype=torch_scalar_dtype(), device=count.device)

    hp = {
        "lr": hyper(lr), "lambd": hyper(lambd), "alpha": hyper(alpha), "t0": hyper(t0),
        "weight_decay": wd,
    }  # fmt: skip
    return elementwise(
        "fg.asgd", ASGDState, {"ax": torch.zeros_like}, scalars, kernel, hp, has_decay, mask,
        carry={"eta": eta0, "mu": mu0}, reads_params=True,
    )  # fmt: skip
