"""``fg.Optimizer``'s eager step on torch.optim's own foreach implementations.

For the elementwise optimizers torch has no fused kernel for (RMSprop, Adamax, NAdam,
RAdam, Adadelta, Rprop), an eager ``fg.Optimizer.step`` calls torch.optim's
functional form of the optimizer with ``foreach=True`` (``torch.optim.rmsprop.rmsprop``
and its siblings: what ``torch.optim.RMSprop(foreach=True).step()`` runs), on the
parameters and funcgrad's own state tensors, in place: torch's in-place multi-tensor
ops, no temporaries of funcgrad's. The values are those of torch's foreach optimizer
with the same arguments, bit for bit (``tests/test_fused_step.py``), in float32 and
float64; float16 and bfloat16 parameters take the general path, which computes them in
float32 as every funcgrad optimizer does.

ASGD runs funcgrad's own arithmetic here, on torch's multi-tensor ops (:func:`_asgd`),
not torch's foreach ASGD: that one computes ``eta`` from its float32 step tensors, and
so differs from torch's own default (single-tensor) ASGD by 3e-9 in float64
(``tests/test_optim_db.py`` holds funcgrad to the default at 1e-12); funcgrad computes
it as the default does, and this path equals funcgrad's general path bit for bit.

Each entry here says which of the state's per-tensor fields torch takes, in its order
(:attr:`Foreach.slots`), which 0-d fields torch keeps once per parameter where funcgrad
keeps one per group (:attr:`Foreach.carried`: NAdam's ``mu_product``), and how to
call torch (:attr:`Foreach.call`). torch increments its per-parameter ``step`` tensors
itself: each call gets fresh ones at the state's count.
funcgrad/optim/_fused.py decides when this path runs (``plan``) and keeps the count and
the hyperparameters' schedules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor
from torch.optim import adadelta, adamax, nadam, radam, rmsprop, rprop

from ._hparams import torch_scalar_dtype, value64

Lists = list[list[Tensor]]

DTYPES = (torch.float32, torch.float64)  # the low-precision ones take the general path
_OFF = MappingProxyType(
    {"foreach": True, "differentiable": False, "capturable": False, "has_complex": False}
)


@dataclass(frozen=True)
class Foreach:
    """How to run one optimizer on torch's foreach implementation."""

    slots: Callable[[Mapping[str, Any], Mapping[str, Any]], list[str]]  # (kwargs, hyperparams)
    carried: tuple[str, ...]
    # (params, grads, slot lists, carried lists, steps, values, kwargs, weight decay)
    call: Callable[[list[Tensor], list[Tensor], Lists, Lists, list[Tensor], Any, Any, float], None]


def _rmsprop_slots(kwargs: Mapping[str, Any], hp: Mapping[str, Any]) -> list[str]:
    return [
        "square_avg",
        *(["momentum_buffer"] if "momentum" in hp else []),
        *(["grad_avg"] if kwargs.get("centered") else []),
    ]


def _rmsprop(ps: Any, gs: Any, ss: Lists, cs: Lists, st: Any, v: Any, kw: Any, w: float) -> None:
    centered = bool(kw.get("centered"))
    momentum = v.get("momentum", 0.0)
    square, rest = ss[0], ss[1:]
    buffers = rest.pop(0) if momentum != 0.0 else []
    rmsprop.rmsprop(
        ps, gs, square, rest[0] if centered else [], buffers, st, maximize=bool(kw["maximize"]),
        lr=v["lr"], alpha=v["alpha"], eps=v["eps"], weight_decay=w, momentum=momentum,
        centered=centered, **_OFF,
    )  # fmt: skip


def _adamax(ps: Any, gs: Any, ss: Lists, cs: Lists, st: Any, v: Any, kw: Any, w: float) -> None:
    b1, b2 = v["betas"]
    adamax.adamax(
        ps, gs, ss[0], ss[1], st, maximize=bool(kw["maximize"]), eps=v["eps"], beta1=b1,
        beta2=b2, lr=v["lr"], weight_decay=w, **_OFF,
    )  # fmt: skip


def _nadam(ps: Any, gs: Any, ss: Lists, cs: Lists, st: Any, v: Any, kw: Any, w: float) -> None:
    b1, b2 = v["betas"]
    nadam.nadam(
        ps, gs, ss[0], ss[1], cs[0], st, maximize=bool(kw["maximize"]),
        decoupled_weight_decay=bool(kw["decoupled_weight_decay"]), beta1=b1, beta2=b2,
        lr=v["lr"], weight_decay=w, momentum_decay=v["momentum_decay"], eps=v["eps"], **_OFF,
    )  # fmt: skip


def _radam(ps: Any, gs: Any, ss: Lists, cs: Lists, st: Any, v: Any, kw: Any, w: float) -> None:
    b1, b2 = v["betas"]
    radam.radam(
        ps, gs, ss[0], ss[1], st, maximize=bool(kw["maximize"]),
        decoupled_weight_decay=bool(kw["decoupled_weight_decay"]), beta1=b1, beta2=b2,
        lr=v["lr"], weight_decay=w, eps=v["eps"], **_OFF,
    )  # fmt: skip


def _adadelta(ps: Any, gs: Any, ss: Lists, cs: Lists, st: Any, v: Any, kw: Any, w: float) -> None:
    adadelta.adadelta(
        ps, gs, ss[0], ss[1], st, lr=v["lr"], rho=v["rho"], eps=v["eps"], weight_decay=w,
        maximize=bool(kw["maximize"]), **_OFF,
    )  # fmt: skip


def _rprop(ps: Any, gs: Any, ss: Lists, cs: Lists, st: Any, v: Any, kw: Any, w: float) -> None:
    if st[0].item() == 0:  # torch: step_size = full_like(grad, lr) at the first step
        for size in ss[1]:
            size.fill_(v["lr"])
    low, high = v["step_sizes"]
    minus, plus = v["etas"]
    rprop.rprop(
        ps, gs, ss[0], ss[1], st, maximize=bool(kw["maximize"]), step_size_min=low,
        step_size_max=high, etaminus=minus, etaplus=plus, **_OFF,
    )  # fmt: skip


def _asgd(ps: Any, gs: Any, ss: Lists, cs: Lists, st: Any, v: Any, kw: Any, w: float) -> None:
    """funcgrad's own ASGD (funcgrad/optim/_asgd.py: its scalars from the kept ``eta``
    and ``mu`` as torch's default ASGD computes them, then its kernel's operations in
    its order) on torch's in-place multi-tensor ops: the general path's values, bit for
    bit, not torch's foreach ASGD's (which takes ``eta`` from float32 step tensors)."""
    f64 = torch.float64
    kept_eta, kept_mu = cs[0][0], cs[1][0]
    t = st[0].to(f64) + 1.0  # this step's count
    lr, lambd = torch.tensor(v["lr"], dtype=f64), torch.tensor(v["lambd"], dtype=f64)
    first = bool(t == 1.0)
    eta = (lr.to(kept_eta.dtype) if first else kept_eta).to(f64)
    mu = kept_mu.to(f64)
    alpha, t0 = torch.tensor(v["alpha"], dtype=f64), torch.tensor(v["t0"], dtype=f64)
    new_eta = (lr / torch.pow(1.0 + lambd * lr * t, alpha)).to(kept_eta.dtype)
    new_mu = (1.0 / torch.clamp(t - t0, min=1.0)).to(kept_mu.dtype)
    dev = ps[0].device  # the 0-d factors where the lists are
    g = torch._foreach_neg(gs) if kw["maximize"] else gs
    if w != 0.0:
        g = torch._foreach_add(g, torch._foreach_mul(ps, torch.tensor(w, dtype=f64, device=dev)))
    new = torch._foreach_mul(ps, (1.0 - lambd * eta).to(dev))
    torch._foreach_add_(new, torch._foreach_mul(g, (-eta).to(dev)))
    ax = ss[0]
    if bool(mu == 1.0):
        torch._foreach_copy_(ax, new)
    else:  # ax + (new - ax) * mu
        moved = torch._foreach_sub(new, ax)
        torch._foreach_mul_(moved, mu.to(dev))
        torch._foreach_add_(ax, moved)
    torch._foreach_sub_(new, ps)  # the update, added as the general path adds it
    torch._foreach_add_(ps, new)
    kept_eta.copy_(new_eta)  # the first per-parameter copy: what step() carries on
    kept_mu.copy_(new_mu)


def _fixed(*fields: str) -> Callable[[Mapping[str, Any], Mapping[str, Any]], list[str]]:
    return lambda kwargs, hp: list(fields)


FOREACH: Mapping[str, Foreach] = MappingProxyType(
    {
        "fg.rmsprop": Foreach(_rmsprop_slots, (), _rmsprop),
        "fg.adamax": Foreach(_fixed("exp_avg", "exp_inf"), (), _adamax),
        "fg.nadam": Foreach(_fixed("exp_avg", "exp_avg_sq"), ("mu_product",), _nadam),
        "fg.radam": Foreach(_fixed("exp_avg", "exp_avg_sq"), (), _radam),
        "fg.adadelta": Foreach(_fixed("square_avg", "acc_delta"), (), _adadelta),
        "fg.rprop": Foreach(_fixed("prev", "step_size"), (), _rprop),
        "fg.asgd": Foreach(_fixed("ax"), ("eta", "mu"), _asgd),
    }
)


def fits(who: str, state: Any) -> bool:
    """Whether the coming step's hyperparameter values keep torch's foreach step equal
    to funcgrad's own: RMSprop built with momentum that a schedule or a param group sets
    to 0 updates its buffer in funcgrad and not in torch."""
    hp = state.hyperparams
    if who != "fg.rmsprop" or "momentum" not in hp:
        return True
    return bool(value64(hp["momentum"], state.count + 1).item() != 0.0)


def per_parameter(t: Tensor, n: int) -> list[Tensor]:
    """``n`` distinct 0-d tensors holding ``t``'s value (torch updates each in place)."""
    return list(t.detach().reshape(1).expand(n).clone().unbind(0))


def step(
    who: str,
    ps: list[Tensor],
    gs: list[Tensor],
    ss: Lists,
    carried: list[Tensor],
    count: Tensor,
    values: Mapping[str, Any],
    kwargs: Mapping[str, Any],
    weight_decay: float,
) -> list[Tensor]:
    """One step of ``who`` on torch's foreach implementation, in place; the carried
    0-d values after it (each as one tensor)."""
    n = len(ps)
    cs = [per_parameter(c, n) for c in carried]
    # torch keeps a parameter's step as a CPU tensor in its scalar dtype (not capturable)
    steps = per_parameter(count.detach().to("cpu", torch_scalar_dtype()), n)
    FOREACH[who].call(ps, gs, ss, cs, steps, values, kwargs, weight_decay)
    return [c[0].clone() for c in cs]


__all__ = ["DTYPES", "FOREACH", "Foreach", "fits", "step"]
