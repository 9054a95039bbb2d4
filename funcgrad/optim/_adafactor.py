"""Functional Adafactor, step-for-step equal to ``torch.optim.Adafactor``.

The update math is in :func:`adafactor`'s docstring (rendered on the API site)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core import _shards
from ..core._base import GradientTransformation
from ..core._invariants import invariants
from ._hparams import (
    DecayMask,
    Hyper,
    LearningRate,
    as64,
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
)
from ._kernel import Entry, Spec, build


class AdafactorState(NamedTuple):
    """State of :func:`adafactor`: ``count`` (int64 0-d); ``row_var`` and ``col_var``
    for tensors of two or more dimensions (shapes ``(..., r, 1)`` and ``(..., 1, c)``),
    ``variance`` for vectors (torch's state keys and shapes)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    row_var: dict[str, Tensor]
    col_var: dict[str, Tensor]
    variance: dict[str, Tensor]
    hyperparams: Any = None  # lr, beta2_decay, eps, d, weight_decay (_hparams)


invariants(
    AdafactorState,
    count="nonnegative",
    row_var="finite nonnegative",
    col_var="finite nonnegative",
    variance="finite nonnegative",
    hyperparams="finite",
)


def _rows(t: Tensor) -> Tensor | None:
    return t.new_zeros(*t.shape[:-1], 1) if t.dim() > 1 else None


def _cols(t: Tensor) -> Tensor | None:
    return t.new_zeros(*t.shape[:-2], 1, t.shape[-1]) if t.dim() > 1 else None


def _vector(t: Tensor) -> Tensor | None:
    return torch.zeros_like(t) if t.dim() <= 1 else None


def _check_eps(eps: object) -> None:
    if not (isinstance(eps, (tuple, list)) and len(eps) == 2):
        raise ValueError(
            f"Invalid eps: {eps!r}; fg.adafactor takes a pair (eps1, eps2) as "
            "torch.optim.Adafactor does: eps1 (None: the dtype's machine epsilon) bounds "
            "the second moment, eps2 the parameter scale. The default is (None, 1e-3)."
        )
    eps1, eps2 = eps
    if eps1 is not None:
        check_number(eps1, "eps[0]", lambda v: v >= 0.0, "epsilon1 should be >= 0 but is: {}")
    check_number(eps2, "eps[1]", lambda v: v >= 0.0, "epsilon2 should be >= 0 but is: {}")


def _check_beta2_decay(x: object) -> None:
    check_number(x, "beta2_decay", lambda v: v <= 0.0, "beta2_decay should be <= 0 but is: {}")


def _check_d(x: object) -> None:
    check_number(x, "d", lambda v: v >= 1.0, "Clipping threshold d should be >= 1 but is: {}")


hyperparameters(
    AdafactorState,
    lr=check_lr,
    beta2_decay=_check_beta2_decay,
    eps=_check_eps,
    d=_check_d,
    weight_decay=check_weight_decay,
)


@optimizer
def adafactor(
    lr: LearningRate = 1e-2,
    beta2_decay: Hyper = -0.8,
    eps: tuple[Hyper | None, Hyper] = (None, 1e-3),
    d: Hyper = 1.0,
    weight_decay: Hyper = 0.0,
    *,
    maximize: bool = False,
    mask: DecayMask = None,
) -> GradientTransformation:
    r"""Adafactor, equal step for step to ``torch.optim.Adafactor`` (same arguments).

    Adafactor keeps, for each tensor of two or more dimensions, a factored second
    moment: one mean of squares per row and one per column of its last two dimensions
    (``r + c`` numbers instead of ``r * c``); a vector keeps a full one. With step
    :math:`t` (1-based), gradient :math:`G`, parameters :math:`p` (torch's formulation)::

        G      <- -G                                          if maximize
        b_t     = t ** beta2_decay                            (one minus beta2 at t)
        rho_t   = min(lr, 1 / sqrt(t))
        alpha_t = max(eps2, RMS(p)) * rho_t
        R_t     = lerp(R_{t-1}, mean(G^2, last dim), b_t)     matrices
        C_t     = lerp(C_{t-1}, mean(G^2, second-last), b_t)
        V_t     = R_t C_t / max(mean(R_t), eps1)
        V_t     = lerp(V_{t-1}, G^2, b_t)                     vectors
        U_t     = G / sqrt(max(V_t, eps1^2))
        u_t     = -alpha_t / max(1, RMS(U_t) / d) * U_t - lr * wd * p

    ``eps1=None`` is the machine epsilon of the parameter's dtype, as in torch. Each
    tensor's update reads norms of the whole tensor, so Adafactor runs tensor by tensor
    (views of the flat buffers). Under ``fg.sharded`` those norms and the column means
    of a row-split matrix are summed across ranks (one small all-reduce each), so every
    rank takes the global step.

    ``lr`` caps the relative step
    size and scales the decoupled weight decay; the step itself is relative to each
    tensor's RMS. ``mask``: where weight decay applies (as ``fg.adamw``'s).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.adafactor()
        >>> params = {"w": torch.ones(3, 4), "b": torch.ones(4)}
        >>> state = tx.init(params)
        >>> [tuple(state.row_var["w"].shape), tuple(state.col_var["w"].shape)], list(state.variance)
        ([(3, 1), (1, 4)], ['b'])
        >>> updates, state = tx.update({"w": torch.ones(3, 4), "b": torch.ones(4)}, state, params)
        >>> updates["w"][0, 0]  # -min(lr, 1) * RMS(p) * sign: every entry -0.01
        tensor(-0.0100)
    """
    lr, beta2_decay, d, weight_decay = map(scalar, (lr, beta2_decay, d, weight_decay))
    eps = tuple(map(scalar, eps)) if isinstance(eps, (tuple, list)) else eps
    check_hyperparameters(
        AdafactorState, lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay
    )
    check_bool(maximize, "maximize", "fg.adafactor")
    wd = off_if_zero(weight_decay)
    has_decay, machine_eps = wd is not None, eps[0] is None

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        t = count.to(torch.float64)
        s = {
            "b": torch.pow(t, hp["beta2_decay"]),
            "rho": torch.minimum(hp["lr"], 1.0 / torch.sqrt(t)),
            "d": hp["d"],
        }
        if machine_eps:  # eps is not in the state (the dtype decides eps1)
            s["eps2"] = as64(eps[1], t)
        else:
            s["eps1"], s["eps2"] = hp["eps"]
        if has_decay:
            s["neg_lr_wd"] = -hp["lr"] * hp["weight_decay"]
        return s

    def kernel(e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g, p, slots, s = e.g, e.p, e.slots, e.s
        assert p is not None
        if maximize:
            g = -g
        shards = _shards.shards()  # fg.sharded: this rank's rows; norms summed over ranks

        def total(partial: Tensor) -> Tensor:
            return partial if shards is None else shards.sum(partial)

        n = g.numel() if shards is None else shards.numel(e.name)
        e1 = torch.finfo(e.stored).eps if machine_eps else s["eps1"]
        rms_p = torch.sqrt(total(torch.sum(p * p)) / n) if shards else p.norm(2) / math.sqrt(n)
        alpha = torch.maximum(s["eps2"], rms_p) * s["rho"]
        out: dict[str, Tensor] = {}
        if g.dim() > 1:
            split = shards is not None and g.dim() == 2  # rows on other ranks too
            rows = n // g.shape[-1] if split else g.shape[-2]
            row = torch.linalg.vector_norm(g, dim=-1, keepdim=True).square() / g.shape[-1]
            if split:
                col = total(torch.sum(g * g, dim=-2, keepdim=True)) / rows
            else:
                col = torch.linalg.vector_norm(g, dim=-2, keepdim=True).square() / rows
            r = torch.lerp(slots["row_var"], row, s["b"])
            c = torch.lerp(slots["col_var"], col, s["b"])
            out["row_var"], out["col_var"] = r, c
            r_mean = total(r.sum(dim=-2, keepdim=True)) / rows if split else r.mean(-2, True)
            v = (r @ c) / r_mean.clamp(min=e1)
        else:
            v = torch.lerp(slots["variance"], g * g, s["b"])
            out["variance"] = v
        u = torch.rsqrt(v.clamp(min=e1 * e1)) * g
        if shards is None:
            rms_u = u.norm(2) / (math.sqrt(n) * s["d"])
        else:
            rms_u = torch.sqrt(total(torch.sum(u * u))) / (math.sqrt(n) * s["d"])
        step = -alpha / torch.clamp(rms_u, min=1.0)
        u = u * step
        if e.decays:
            u = u + s["neg_lr_wd"] * p
        return u, out

    spec = Spec(
        who="fg.adafactor",
        state=AdafactorState,
        slots={"row_var": _rows, "col_var": _cols, "variance": _vector},
        scalars=scalars,
        kernel=kernel,
        hyper={
            "lr": hyper(lr),
            "beta2_decay": hyper(beta2_decay),
            "eps": hyper(eps),
            "d": hyper(d),
            "weight_decay": wd,
        },
        needs_params=True,
        elementwise=False,
        has_decay=has_decay,
        mask=mask,
    )
    return build(spec)
