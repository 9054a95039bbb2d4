"""Functional Adam and AdamW, step-for-step equal to ``torch.optim.Adam`` / ``AdamW``.

The update math is in :func:`adam`'s docstring (rendered on the API site)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core._base import GradientTransformation, is_number
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


class AdamState(NamedTuple):
    """State of :func:`adam` / :func:`adamw`.

    ``count``: int64 0-d tensor, steps taken. ``mu``/``nu``: first and second moments.
    ``nu_max``: running max of ``nu`` (``amsgrad``), else an empty dict.
    ``hyperparams``: ``lr``, ``betas``, ``eps``, ``weight_decay``, the values of the next
    step (funcgrad/optim/_hparams.py).
    """

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    mu: dict[str, Tensor]
    nu: dict[str, Tensor]
    nu_max: dict[str, Tensor]
    hyperparams: Any = None


invariants(
    AdamState,
    count="nonnegative",
    mu="finite",
    nu="finite nonnegative",
    nu_max="finite nonnegative",
    hyperparams="finite",
)
hyperparameters(
    AdamState, lr=check_lr, betas=check_betas, eps=check_eps, weight_decay=check_weight_decay
)


def _adam(
    lr: LearningRate,
    betas: tuple[Hyper, Hyper],
    eps: Hyper,
    weight_decay: Hyper,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
    mask: DecayMask,
    eps_root: float,
) -> GradientTransformation:
    who = "fg.adamw" if decoupled else "fg.adam"
    betas = tuple(map(scalar, betas)) if isinstance(betas, (tuple, list)) else betas
    lr, eps, weight_decay = scalar(lr), scalar(eps), scalar(weight_decay)
    check_hyperparameters(AdamState, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    check_bool(amsgrad, "amsgrad", who)
    check_bool(maximize, "maximize", who)
    if not is_number(eps_root) or not eps_root >= 0:
        raise ValueError(f"Invalid eps_root value: {eps_root!r}; expected a float >= 0.")
    eps_root = float(eps_root)
    wd = off_if_zero(weight_decay)
    has_decay = wd is not None

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        # As torch computes them in Python doubles: lr / (1 - b1^t), 1 / sqrt(1 - b2^t).
        t = count.to(torch.float64)
        lr_t, (b1, b2) = hp["lr"], hp["betas"]
        bc1 = 1.0 - torch.pow(b1, t)
        bc2 = 1.0 - torch.pow(b2, t)
        s = {
            "neg_step": -(lr_t / bc1),
            "inv_bc2": 1.0 / torch.sqrt(bc2),
            "c1": 1.0 - b1,
            "c2": 1.0 - b2,
            "b2": b2,
            "eps": hp["eps"],
        }
        if eps_root:
            s["inv2"] = s["inv_bc2"] * s["inv_bc2"]
        if has_decay:
            s["wd"] = hp["weight_decay"]
            if decoupled:
                s["lr_decay"] = lr_t * hp["weight_decay"]
        return s

    def kernel(e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g, p, s, o = e.g, e.p, e.s, e.o
        if maximize:
            g = o.neg(g)
        if e.decays and not decoupled:
            assert p is not None
            g = o.add(g, o.mul(p, s["wd"]))
        m = o.lerp(e.slots["mu"], g, s["c1"])
        # (1 - b2) * g first, then * g: no overflow where torch has none (its addcmul
        # computes value * t1 * t2 in that order), and not addcmul itself, whose
        # decomposition under torch.compile rounds differently from eager.
        sq = o.mul_(o.mul(g, s["c2"]), g)
        v = o.add_(o.mul(e.slots["nu"], s["b2"]), sq)
        o.release(sq)
        # Stored in the parameter's dtype by the caller; this step goes on with the
        # float32 values (torch re-reads its rounded float16 copies: a second moment
        # below 6e-8 then reads as 0, and its update becomes inf/NaN where this one is
        # finite).
        out = {"mu": m, "nu": v}
        if amsgrad:
            v = o.maximum(e.slots["nu_max"], v)
            out["nu_max"] = v
        # One division per element, not two: sqrt(v) * (1 / sqrt(bc2)) differs from
        # torch's sqrt(v) / sqrt(bc2) by at most an ulp. With eps_root (optax's), the
        # root of v / bc2 + eps_root: differentiable where v == 0.
        if eps_root:
            denom = o.add(o.sqrt(o.add(o.mul(v, s["inv2"]), eps_root)), s["eps"])
        else:
            denom = o.add_(o.mul_(o.sqrt(v), s["inv_bc2"]), s["eps"])
        u = o.mul_(o.div(m, denom), s["neg_step"])
        o.release(denom)
        if e.decays and decoupled:
            assert p is not None
            u = o.sub_(u, o.mul(p, s["lr_decay"]))
        return u, out

    slots: dict[str, Callable[[Tensor], Tensor | None]] = {
        "mu": torch.zeros_like,
        "nu": torch.zeros_like,
    }
    if amsgrad:
        slots["nu_max"] = torch.zeros_like
    hp = {"lr": hyper(lr), "betas": hyper(betas), "eps": hyper(eps), "weight_decay": wd}
    return elementwise(who, AdamState, slots, scalars, kernel, hp, has_decay, mask)


@optimizer
def adam(
    lr: LearningRate = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
    mask: DecayMask = None,
    eps_root: float = 0.0,
) -> GradientTransformation:
    r"""Adam, equal step for step to ``torch.optim.Adam`` with the same arguments.

    With gradient :math:`g_t`, parameters :math:`p`, step :math:`t` (1-based)::

        g_t  <- -g_t                               if maximize
        g_t  <- g_t + wd * p                       Adam (L2), if wd != 0
        m_t   = lerp(m_{t-1}, g_t, 1 - b1)         = b1 m + (1 - b1) g
        v_t   = b2 v_{t-1} + (1 - b2) g_t^2
        v^_t  = max(v^_{t-1}, v_t)                 if amsgrad, else v_t
        u_t   = -lr / (1 - b1^t) * m_t / (sqrt(v^_t) * (1 / sqrt(1 - b2^t)) + eps)
        u_t  <- u_t - lr * wd * p                  AdamW (decoupled), if wd != 0

    With ``eps_root > 0`` (opt-in; off, it is torch's rule) the denominator is
    ``sqrt(v^_t / (1 - b2^t) + eps_root) + eps``, differentiable where ``v^_t == 0``.

    The step counter is an int64 0-d tensor and the bias corrections are computed in
    float64 (as torch does in Python doubles), then cast to the compute dtype: no
    recompiles as the step grows, and no drift from ``torch.optim``. float16 and bfloat16
    parameters are computed in float32 and their moments stored in their own dtype
    (torch's opmath); the update is float32 and ``apply_updates`` rounds it once. Within a
    step the float32 moments are used (torch re-reads the rounded ones), so a float16
    second moment that underflows gives a finite update here and inf/NaN in torch.

    ``weight_decay`` is the L2 penalty added to the gradient (as in torch); see
    :func:`adamw` for decoupled decay (or torch's ``decoupled_weight_decay=True``).
    ``mask`` says where weight decay applies (see ``DecayMask``): with a mask, equal to
    ``torch.optim.Adam`` with a decay and a no-decay param group.

    Differentiable and vmappable (meta-learning, ensembles): ``lr``, ``betas``,
    ``eps`` and ``weight_decay`` may be 0-d tensors that carry gradients, and under
    ``torch.func.grad``/``vmap`` (or autograd recording through it) the update takes
    its plain per-tensor math. ``sqrt(nu)`` has no derivative where ``nu == 0`` (an
    exact-zero gradient on the first step): a derivative through such an entry is
    NaN, as in any Adam. ``eps_root > 0`` (optax's) takes the root of
    ``nu_hat + eps_root`` instead, finite there; it changes the update, so it is off
    by default (equal to ``torch.optim``).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.adam(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> updates, state = tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(params), params)
        >>> fg.apply_updates(params, updates), int(state.count)
        ({'w': tensor([ 0.9000, -0.9000])}, 1)

        A learnable lr: the derivative of the new ``w[0]`` (``1 - lr``) with respect to it:

        >>> def new_w0(lr):
        ...     tx = fg.adam(lr=lr)
        ...     u, _ = tx.update({"w": torch.tensor([2.0, -3.0])}, tx.init(params), params)
        ...     return fg.apply_updates(params, u)["w"][0]
        >>> round(float(torch.func.grad(new_w0)(torch.tensor(0.1))), 4)
        -1.0
    """
    check_bool(decoupled_weight_decay, "decoupled_weight_decay", "fg.adam")
    return _adam(
        lr, betas, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay, mask, eps_root
    )


@optimizer
def adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    mask: DecayMask = None,
    eps_root: float = 0.0,
) -> GradientTransformation:
    """AdamW, equal step for step to ``torch.optim.AdamW`` with the same arguments.

    Decoupled weight decay: ``p <- p - lr * weight_decay * p`` besides the Adam step,
    only where ``mask`` says so (e.g. ``mask=lambda name, p: p.ndim > 1`` keeps decay
    off biases and norm weights): equal to ``torch.optim.AdamW`` with a decay and a
    no-decay param group. Tensor hyperparameters and ``eps_root``: see :func:`adam`.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.adamw(lr=0.1, weight_decay=0.5)
        >>> params = {"w": torch.tensor([1.0])}
        >>> updates, _ = tx.update({"w": torch.tensor([2.0])}, tx.init(params), params)
        >>> fg.apply_updates(params, updates)  # 1 - 0.1 * 0.5 * 1 - 0.1
        {'w': tensor([0.8500])}
    """
    return _adam(lr, betas, eps, weight_decay, amsgrad, maximize, True, mask, eps_root)
