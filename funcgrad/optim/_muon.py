"""Functional Muon, step-for-step equal to ``torch.optim.Muon`` (2-D parameters).

The update math is in :func:`muon`'s docstring (rendered on the API site)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core import _shards
from ..core._base import GradientTransformation, Params, is_int
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
    hyper,
    hyperparameters,
    off_if_zero,
    optimizer,
    scalar,
)
from ._kernel import Entry, Spec, build


class MuonState(NamedTuple):
    """State of :func:`muon`: ``count`` (int64 0-d) and the ``momentum_buffer``."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    momentum_buffer: dict[str, Tensor]
    hyperparams: Any = None  # lr, weight_decay, momentum, eps (_hparams)


invariants(MuonState, count="nonnegative", momentum_buffer="finite", hyperparams="finite")
hyperparameters(
    MuonState,
    lr=check_lr,
    weight_decay=lambda v: check_number(
        v, "weight decay", lambda x: x >= 0.0, "weight decay should be >= 0 but is: {}"
    ),
    momentum=lambda v: check_number(
        v, "momentum", lambda x: x >= 0.0, "momentum should be >= 0 but is: {}"
    ),
    eps=check_eps,
)

_RATIOS = (None, "original", "match_rms_adamw", "spectral_unclamped")


def orthogonalize(
    m: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float | Tensor
) -> Tensor:
    """Newton–Schulz iteration towards the nearest semi-orthogonal matrix, in bfloat16,
    the operations of ``torch.optim.Muon`` in its order."""
    a, b, c = coefficients
    o = m.bfloat16()
    tall = m.shape[-2] > m.shape[-1]
    if tall:
        o = o.mT
    o = o / o.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = o @ o.mT
        o = torch.addmm(o, torch.addmm(gram, gram, gram, beta=b, alpha=c), o, beta=a)
    return o.mT if tall else o


def _ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "spectral_unclamped":  # torch 2.14's third choice
        return math.sqrt(rows / cols)
    return 0.2 * math.sqrt(max(rows, cols))


def _check_matrices(params: Params) -> None:
    flat = {k: tuple(p.shape) for k, p in params.items() if p.dim() != 2}
    if flat:
        raise ValueError(
            f"fg.muon: Muon only supports 2D parameters; {flat} are not 2-D (Muon "
            "orthogonalizes weight matrices, as torch.optim.Muon). Give the other parameters "
            "to AdamW with fg.partition: "
            "labels = {n: 'muon' if p.ndim == 2 else 'adamw' for n, p in params.items()}; "
            "tx = fg.partition({'muon': fg.muon(), 'adamw': fg.adamw()}, labels) "
            "(docs/optimizers.md; keep embeddings and the output head on AdamW too)."
        )


@optimizer
def muon(
    lr: LearningRate = 1e-3,
    weight_decay: Hyper = 0.1,
    momentum: Hyper = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
    eps: Hyper = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
    *,
    mask: DecayMask = None,
) -> GradientTransformation:
    r"""Muon, equal step for step to ``torch.optim.Muon`` with the same arguments.

    Muon replaces each weight matrix's momentum by its nearest semi-orthogonal matrix
    (five Newton–Schulz iterations in bfloat16, as torch and Keller Jordan's reference
    run them). With gradient :math:`G`, parameters :math:`W` of shape ``(A, B)``::

        B_t  = lerp(B_{t-1}, G, 1 - momentum)
        M    = lerp(G, B_t, momentum)               if nesterov, else B_t
        O    = NewtonSchulz(M)                      (bfloat16)
        u_t  = -lr * wd * W - lr * ratio * O         (weight decay where mask says so)

    ``ratio`` is ``sqrt(max(1, A / B))`` (``adjust_lr_fn=None`` or ``"original"``),
    ``0.2 * sqrt(max(A, B))`` (``"match_rms_adamw"``, so that the update's RMS matches
    AdamW's) or ``sqrt(A / B)`` (``"spectral_unclamped"``, added in torch 2.14). Muon is
    for the hidden 2-D weights only: embeddings, the output head, biases and norms go to
    AdamW (``fg.partition``, see ``docs/optimizers.md``).

    Under ``fg.sharded`` each matrix is gathered whole for the iteration (one
    all-gather of the momentum per matrix) and every rank keeps its rows of the result.

    Every parameter must be 2-D (a
    clear error otherwise: use ``fg.partition`` with AdamW for the rest). ``mask``:
    where weight decay applies (as ``fg.adamw``'s; torch's Muon decays all of its
    parameters).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.muon(lr=0.02, weight_decay=0.0)
        >>> params = {"w": torch.zeros(4, 4)}
        >>> updates, _ = tx.update({"w": torch.eye(4)}, tx.init(params), params)
        >>> round(float(torch.linalg.matrix_norm(updates["w"], ord=2)), 2)  # about lr
        0.02
    """
    lr, weight_decay, momentum, eps = map(scalar, (lr, weight_decay, momentum, eps))
    check_hyperparameters(MuonState, lr=lr, weight_decay=weight_decay, momentum=momentum, eps=eps)
    check_bool(nesterov, "nesterov", "fg.muon")
    if adjust_lr_fn not in _RATIOS:
        raise ValueError(
            f"Adjust learning rate function {adjust_lr_fn} is not supported; use None, "
            "'original', 'match_rms_adamw' or 'spectral_unclamped'."
        )
    if not (isinstance(ns_coefficients, (tuple, list)) and len(ns_coefficients) == 3):
        raise ValueError(f"Coefficients must be a tuple of exactly 3 values: {ns_coefficients!r}")
    if not is_int(ns_steps) or not 0 <= ns_steps < 100:
        raise ValueError(f"Invalid ns_steps: {ns_steps!r}; expected an int in [0, 100).")
    coeffs = (float(ns_coefficients[0]), float(ns_coefficients[1]), float(ns_coefficients[2]))
    wd = off_if_zero(weight_decay)
    has_decay = wd is not None

    def scalars(count: Tensor, hp: dict[str, Any]) -> dict[str, Tensor]:
        mom = hp["momentum"]
        s = {"lr": hp["lr"], "momentum": mom, "one_minus_momentum": 1.0 - mom, "eps": hp["eps"]}
        if has_decay:
            s["neg_lr_wd"] = -hp["lr"] * hp["weight_decay"]
        return s

    def kernel(e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g, p, s = e.g, e.p, e.s
        if g.dim() != 2:
            _check_matrices({e.name: g})
        buf = torch.lerp(e.slots["momentum_buffer"], g, s["one_minus_momentum"])
        mom = torch.lerp(g, buf, s["momentum"]) if nesterov else buf
        shards = _shards.shards()  # fg.sharded: the whole matrix, this rank's rows of O

        def ortho(whole: dict[str, Tensor]) -> dict[str, Tensor]:
            return {e.name: orthogonalize(whole[e.name], coeffs, ns_steps, s["eps"])}

        o = ortho({e.name: mom}) if shards is None else shards.on_whole(ortho, {e.name: mom})
        cols = g.shape[-1]
        rows = g.shape[-2] if shards is None else shards.numel(e.name) // cols
        u = o[e.name].to(g.dtype) * (s["lr"] * -_ratio(adjust_lr_fn, rows, cols))
        if e.decays:
            assert p is not None
            u = u + s["neg_lr_wd"] * p
        return u, {"momentum_buffer": buf}

    build_tx = build(
        Spec(
            who="fg.muon",
            state=MuonState,
            slots={"momentum_buffer": torch.zeros_like},
            scalars=scalars,
            kernel=kernel,
            hyper={
                "lr": hyper(lr),
                "weight_decay": wd,
                "momentum": hyper(momentum),
                "eps": hyper(eps),
            },
            needs_params=has_decay,
            elementwise=False,
            has_decay=has_decay,
            mask=mask,
        )
    )

    def init(params: Params) -> MuonState:
        _check_matrices(params)
        return build_tx.init(params)  # type: ignore[no-any-return]

    return GradientTransformation(init, build_tx.update, build_tx.facts)
