"""``torch.optim.LBFGS``'s state and ``fg.lbfgs``'s, both ways (for
``fg.state_from_torch`` / ``fg.state_to_torch``): torch keeps one state, on its first
parameter, with the history as lists; funcgrad keeps the same numbers with the
history in fixed-size buffers (funcgrad/optim/_lbfgs.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..optim._lbfgs import LBFGSState


def _check_order(names: list[str], params: Mapping[str, Tensor], who: str) -> None:
    if names != list(params):
        raise ValueError(
            f"{who}: L-BFGS keeps its history on one flat vector of the parameters in "
            f"order; the torch optimizer holds them as {names[:4]}..., params as "
            f"{list(params)[:4]}.... Pass params in the optimizer's order."
        )


def lbfgs_from_torch(
    node: LBFGSState,
    opt: torch.optim.Optimizer,
    names: list[str],
    params: Mapping[str, Tensor],
    who: str,
) -> LBFGSState:
    """``node`` (``tx.init``'s) with torch's LBFGS state, if it has one."""
    _check_order(names, params, who)
    first = opt.param_groups[0]["params"][0]
    st = opt.state.get(first) or {}
    if "n_iter" not in st:
        return node
    dirs, stps, ro = list(st["old_dirs"]), list(st["old_stps"]), list(st["ro"])
    history = len(node.ro)
    if len(dirs) > history:
        raise ValueError(
            f"{who}: torch's LBFGS holds {len(dirs)} curvature pairs; tx keeps "
            f"history_size={history}. Build tx with the optimizer's history_size."
        )
    like = node.d

    def vec(t: Any) -> Tensor:
        return torch.as_tensor(t).detach().to(like.dtype).reshape(-1).clone()

    old_dirs, old_stps, new_ro = node.old_dirs.clone(), node.old_stps.clone(), node.ro.clone()
    for i, (a, b, r) in enumerate(zip(dirs, stps, ro, strict=True)):
        old_dirs[i], old_stps[i], new_ro[i] = vec(a), vec(b), torch.as_tensor(r).to(like.dtype)
    i64, f64 = node.count, node.t
    d, prev = st.get("d"), st.get("prev_flat_grad")
    return node._replace(
        count=i64.new_tensor(int(st["n_iter"])),
        func_evals=i64.new_tensor(int(st.get("func_evals", 0))),
        d=node.d if d is None else vec(d),
        t=f64.new_tensor(float(st.get("t") or 0.0)),
        old_dirs=old_dirs,
        old_stps=old_stps,
        ro=new_ro,
        filled=i64.new_tensor(len(dirs)),
        head=i64.new_tensor(0),
        H_diag=f64.new_tensor(float(st.get("H_diag", 1.0))),
        prev_flat_grad=node.prev_flat_grad if prev is None else vec(prev),
        prev_loss=f64.new_tensor(float(st.get("prev_loss") or 0.0)),
    )


def lbfgs_to_torch(
    node: LBFGSState,
    opt: torch.optim.Optimizer,
    names: list[str],
    params: Mapping[str, Tensor],
    who: str,
) -> None:
    """Write ``node`` into torch's LBFGS (its first parameter's state)."""
    _check_order(names, params, who)
    first = opt.param_groups[0]["params"][0]
    for p in opt.param_groups[0]["params"]:
        opt.state.pop(p, None)
    if int(node.count) == 0:  # no iteration yet: torch's state starts at its step
        if int(node.func_evals):
            opt.state[first] = {"func_evals": int(node.func_evals), "n_iter": 0}
        return
    rows = [(int(node.head) + i) % len(node.ro) for i in range(int(node.filled))]
    opt.state[first] = {
        "func_evals": int(node.func_evals),
        "n_iter": int(node.count),
        "d": node.d.clone(),
        "t": float(node.t),
        "old_dirs": [node.old_dirs[r].clone() for r in rows],
        "old_stps": [node.old_stps[r].clone() for r in rows],
        "ro": [node.ro[r].clone() for r in rows],
        "H_diag": node.H_diag.to(node.d.dtype).clone(),
        "prev_flat_grad": node.prev_flat_grad.clone(),
        "prev_loss": float(node.prev_loss),
    }
