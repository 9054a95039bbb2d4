"""L-BFGS, step-for-step equal to ``torch.optim.LBFGS`` with the same arguments, its
strong-Wolfe line search included (:func:`lbfgs`).

L-BFGS evaluates the loss itself, several times a step (its iterations, its line
search), and decides from the values on the host, so it is no ``update(grads, state)``:
its transformation carries ``facts.minimize``, which ``fg.make_step`` (the loss
function given) and ``fg.Optimizer.step(closure)`` call with an ``evaluate`` callback.
The algorithm works on one flat vector of all parameters (torch's layout: the
parameters in order, flattened) and keeps its history in fixed-size buffers, so the
state has one structure from ``init`` on (checkpoints load into ``tx.init``'s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core._base import GradientTransformation, Params, check_floating, is_int, with_facts
from ..core._invariants import invariants
from ..core._vector import flat_vector
from ._hparams import (
    LearningRate,
    OptimizerInfo,
    check_bool,
    check_hyperparameters,
    check_lr,
    check_number,
    hyper,
    hyperparameters,
    is_schedule,
    optimizer,
    scalar,
    start_value,
)
from ._line_search import Point, line_search

Evaluate = Callable[[Tensor], tuple[float, Tensor, Any]]
"""``evaluate(x) -> (loss as a float, flat gradient, what the evaluation returned)``."""


class LBFGSState(NamedTuple):
    """State of :func:`lbfgs` (torch's, on the flat parameter vector): ``count`` (int64
    0-d, iterations taken over all steps: torch's ``n_iter``), ``func_evals``, the last
    direction ``d`` and step length ``t``, the curvature pairs ``old_dirs``/``old_stps``
    (``history_size`` rows; ``filled`` of them in use, the oldest at row ``head``) with
    ``ro`` (1 / y.s), ``H_diag`` (the initial inverse Hessian's scale),
    ``prev_flat_grad``, ``prev_loss``, and ``hyperparams`` (``lr``, ``tolerance_grad``,
    ``tolerance_change``)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    func_evals: Tensor
    d: Tensor
    t: Tensor
    old_dirs: Tensor
    old_stps: Tensor
    ro: Tensor
    filled: Tensor
    head: Tensor
    H_diag: Tensor
    prev_flat_grad: Tensor
    prev_loss: Tensor
    hyperparams: Any = None


def _check_tolerance(name: str) -> Any:
    def check(x: Any) -> None:
        check_number(x, name, lambda v: v >= 0.0, f"Invalid {name}: {{}}")

    return check


invariants(
    LBFGSState, count="nonnegative", func_evals="nonnegative", d="finite",
    old_dirs="finite", old_stps="finite", filled="nonnegative", head="nonnegative",
    prev_flat_grad="finite", hyperparams="finite",
)  # fmt: skip
hyperparameters(
    LBFGSState,
    lr=check_lr,
    tolerance_grad=_check_tolerance("tolerance_grad"),
    tolerance_change=_check_tolerance("tolerance_change"),
)


def _count_arg(x: Any, name: str, low: int) -> int:
    if not is_int(x) or x < low:
        raise ValueError(f"fg.lbfgs: {name}={x!r}; expected an int >= {low}.")
    return x


def lbfgs(
    lr: LearningRate = 1.0,
    max_iter: int = 20,
    max_eval: int | None = None,
    tolerance_grad: float = 1e-7,
    tolerance_change: float = 1e-9,
    history_size: int = 100,
    line_search_fn: str | None = None,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    r"""L-BFGS, equal step for step to ``torch.optim.LBFGS`` with the same arguments
    (``line_search_fn="strong_wolfe"`` included).

    One step runs up to ``max_iter`` iterations and ``max_eval`` evaluations of the
    loss (``max_iter * 5 // 4`` when None): each takes the direction
    :math:`d = -H g` from the last ``history_size`` curvature pairs (the two-loop
    recursion), then moves by :math:`t d`, with :math:`t` = ``lr`` (on the first
    iteration ``min(1, 1 / |g|_1) * lr``) or found by a line search satisfying the
    strong Wolfe conditions; it stops early when the gradient's largest entry is at
    most ``tolerance_grad`` or the step or the loss changes by less than
    ``tolerance_change``.

    It evaluates the loss itself, so it runs where the loss function is given, not
    through ``tx.update``:

    - ``fg.make_step(loss_fn, fg.lbfgs(...))``: ``step(params, state, *batch)``
      evaluates ``loss_fn(params, *batch)`` and its gradient as often as the step
      needs (with ``compile=``, that evaluation is compiled: one graph, reused by
      every evaluation; the iterations and the line search run eagerly, as torch's,
      since each decision reads a loss on the host) and returns the loss of the first
      evaluation, as torch's ``step`` does;
    - ``fg.Optimizer(model, fg.lbfgs(...)).step(closure)``, as ``torch.optim.LBFGS``.

    The parameters form one flat vector (one dtype, one device); the state keeps the
    history in ``2 * history_size`` vectors of its size from the start (torch's grows
    to that). ``lr``, ``tolerance_grad`` and ``tolerance_change`` are held in the
    state (``fg.set_hyperparams``); the others are the transformation's.
    ``maximize`` (torch 2.14's keyword): maximize the loss (minimize its negative).

    Examples:
        >>> import torch, funcgrad as fg
        >>> target = torch.tensor([1.0, -2.0])
        >>> loss = lambda p: ((p["w"] - target) ** 2).sum() + p["w"].pow(4).sum()
        >>> step = fg.make_step(loss, fg.lbfgs(line_search_fn="strong_wolfe"))
        >>> params = {"w": torch.zeros(2)}
        >>> params, state, first = step(params, fg.lbfgs().init(params))
        >>> first, params["w"], int(state.count)
        (tensor(5.), tensor([ 0.5897, -0.8351]), 6)
    """
    _count_arg(max_iter, "max_iter", 1)
    # torch fills max_eval in at construction: its param group (and fg.Optimizer's)
    # shows the number, which a later max_iter written into the group leaves as it is
    evals = max_iter * 5 // 4 if max_eval is None else _count_arg(max_eval, "max_eval", 1)
    return _lbfgs(
        lr, max_iter, evals, tolerance_grad, tolerance_change, history_size, line_search_fn,
        maximize=maximize,
    )  # fmt: skip


@optimizer
def _lbfgs(
    lr: LearningRate,
    max_iter: int,
    max_eval: int,
    tolerance_grad: float,
    tolerance_change: float,
    history_size: int,
    line_search_fn: str | None,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """:func:`lbfgs` with ``max_eval`` filled in (what its param groups hold)."""
    check_bool(maximize, "maximize", "fg.lbfgs")
    lr = scalar(lr)
    if is_schedule(lr):
        raise TypeError(
            "fg.lbfgs: lr is a float or a 0-d tensor, not a schedule (its state counts "
            "iterations, many per step). Change it between steps: fg.set_hyperparams(state, "
            "lr=...), or a torch scheduler on fg.Optimizer's param_groups."
        )
    check_hyperparameters(
        LBFGSState, lr=lr, tolerance_grad=tolerance_grad, tolerance_change=tolerance_change
    )
    _count_arg(max_iter, "max_iter", 1)
    evals = _count_arg(max_eval, "max_eval", 1)
    _count_arg(history_size, "history_size", 1)
    if line_search_fn not in (None, "strong_wolfe"):
        raise ValueError(
            f"fg.lbfgs: line_search_fn={line_search_fn!r}; only 'strong_wolfe' or None (a "
            "fixed step of lr) are supported, as in torch.optim.LBFGS."
        )
    hp = {
        "lr": hyper(lr),
        "tolerance_grad": hyper(tolerance_grad),
        "tolerance_change": hyper(tolerance_change),
    }

    def init(params: Params) -> LBFGSState:
        check_floating(params, "fg.lbfgs.init")
        x = flat_vector(params, "fg.lbfgs.init")
        n = x.numel()

        def zero(dtype: torch.dtype) -> Tensor:
            return torch.zeros((), dtype=dtype, device=x.device)

        i64, f64 = torch.int64, torch.float64
        return LBFGSState(
            count=zero(i64), func_evals=zero(i64), d=x.new_zeros(n), t=zero(f64),
            old_dirs=x.new_zeros(history_size, n), old_stps=x.new_zeros(history_size, n),
            ro=x.new_zeros(history_size), filled=zero(i64), head=zero(i64),
            H_diag=zero(f64) + 1.0, prev_flat_grad=x.new_zeros(n), prev_loss=zero(f64),
            hyperparams={k: start_value(v, x) for k, v in hp.items()},
        )  # fmt: skip

    def update(grads: Params, state: Any, params: Params | None = None) -> Any:
        raise TypeError(
            "fg.lbfgs evaluates the loss itself (its iterations and line search), so it "
            "has no update(grads, state): run it with fg.make_step(loss_fn, fg.lbfgs(...)) "
            "or fg.Optimizer(model, fg.lbfgs(...)).step(closure), alone (not inside "
            "fg.chain: rules in front would need each evaluation's gradients)."
        )

    def minimize(
        evaluate: Evaluate, x: Tensor, state: LBFGSState
    ) -> tuple[Tensor, LBFGSState, Any]:
        if not isinstance(state, LBFGSState):
            raise TypeError(f"fg.lbfgs: expected an LBFGSState, got {type(state).__name__}.")
        if state.old_dirs.shape != (history_size, x.numel()):
            raise ValueError(
                f"fg.lbfgs: the state holds {tuple(state.old_dirs.shape)} history for "
                f"{x.numel()} parameter entries and history_size={history_size}; build it "
                "with tx.init(params) for these parameters."
            )
        if maximize:  # torch 2.14's: minimize -f, the loss and the gradient negated

            def negated(x: Tensor, inner: Evaluate = evaluate) -> tuple[float, Tensor, Any]:
                loss, g, result = inner(x)
                return -loss, g.neg(), result

            evaluate = negated
        return _minimize(evaluate, x, state, max_iter, evals, line_search_fn is not None)

    tx = GradientTransformation(init, update)
    return with_facts(tx, optimizer=OptimizerInfo("fg.lbfgs", LBFGSState, hp), minimize=minimize)


# ---- the algorithm (Nocedal & Wright, "Numerical Optimization", algorithm 7.4; its
# line search: _line_search.py); the decisions and the order of the arithmetic are
# torch's, so the iterates are the same numbers


def _minimize(
    evaluate: Evaluate, x: Tensor, state: LBFGSState, max_iter: int, max_eval: int, search: bool
) -> tuple[Tensor, LBFGSState, Any]:
    """One ``torch.optim.LBFGS.step``: returns the new flat parameters, the state and
    what the first evaluation returned."""
    hp = state.hyperparams
    lr, tol_grad, tol_change = (float(hp[k]) for k in ("lr", "tolerance_grad", "tolerance_change"))
    dtype = x.dtype
    iters, func_evals = int(state.count), int(state.func_evals)

    loss, g, first = evaluate(x)
    evals, func_evals = 1, func_evals + 1
    if g.abs().max() <= tol_grad:
        return x, state._replace(func_evals=state.func_evals.new_tensor(func_evals)), first

    rows = [(int(state.head) + i) % len(state.ro) for i in range(int(state.filled))]
    dirs = [state.old_dirs[r] for r in rows]
    stps = [state.old_stps[r] for r in rows]
    ro = [state.ro[r] for r in rows]
    d: Tensor = state.d
    t: Any = float(state.t)
    h_diag: Any = state.H_diag.to(dtype)
    prev_g: Tensor = state.prev_flat_grad
    prev_loss = float(state.prev_loss)
    history = len(state.ro)

    k = 0
    while k < max_iter:
        k += 1
        iters += 1
        if iters == 1:  # the first iteration ever: steepest descent
            d = g.neg()
            dirs, stps, ro, h_diag = [], [], [], 1
        else:
            y = g.sub(prev_g)
            s = d.mul(t)
            ys = y.dot(s)
            if ys > 1e-10:  # a pair with positive curvature joins the history
                if len(dirs) == history:
                    del dirs[0], stps[0], ro[0]
                dirs.append(y)
                stps.append(s)
                ro.append(1.0 / ys)
                h_diag = ys / y.dot(y)
            d = _two_loop(g, dirs, stps, ro, h_diag)
        prev_g = g.clone()
        prev_loss = loss
        if iters == 1:  # torch's first guess: the min of a float and a 0-d tensor
            guess: Any = min(1.0, 1.0 / g.abs().sum())
            t = guess * lr
        else:
            t = lr
        slope = g.dot(d)
        if slope > -tol_change:
            break
        if search:
            base = x

            def at(step: Any, base: Tensor = base, d: Tensor = d) -> tuple[float, Tensor]:
                f, grad, _ = evaluate(base.add(d, alpha=step))
                return f, grad

            start = Point(0, loss, g, slope)
            # torch's line search keeps its own tolerance_change (1e-9), not the group's
            loss, g, t, used = line_search(at, d, start, t, 1e-9, max_eval - evals)
            x = x.add(d, alpha=t)
            optimal = bool(g.abs().max() <= tol_grad)
        else:
            x = x.add(d, alpha=t)
            used, optimal = 0, False
            if k != max_iter:  # torch does not evaluate after the last iteration
                loss, g, _ = evaluate(x)
                used, optimal = 1, bool(g.abs().max() <= tol_grad)
        evals += used
        func_evals += used
        if k == max_iter or evals >= max_eval or optimal:
            break
        if d.mul(t).abs().max() <= tol_change or abs(loss - prev_loss) < tol_change:
            break

    old_dirs, old_stps, new_ro = (
        torch.zeros_like(b) for b in (state.old_dirs, state.old_stps, state.ro)
    )
    for i, (a, b, r) in enumerate(zip(dirs, stps, ro, strict=True)):
        old_dirs[i], old_stps[i], new_ro[i] = a, b, r
    i64, f64 = state.count, state.t
    return (
        x,
        state._replace(
            count=i64.new_tensor(iters),
            func_evals=i64.new_tensor(func_evals),
            d=d,
            t=f64.new_tensor(float(t)),
            old_dirs=old_dirs,
            old_stps=old_stps,
            ro=new_ro,
            filled=i64.new_tensor(len(dirs)),
            head=i64.new_tensor(0),
            H_diag=f64.new_tensor(float(h_diag)),
            prev_flat_grad=prev_g,
            prev_loss=f64.new_tensor(float(prev_loss)),
        ),
        first,
    )


def _two_loop(
    g: Tensor, dirs: list[Tensor], stps: list[Tensor], ro: list[Tensor], h_diag: Any
) -> Tensor:
    """The L-BFGS direction ``-H g`` from the curvature pairs (Nocedal & Wright, 7.4)."""
    q = g.neg()
    alphas: list[Any] = [None] * len(dirs)
    for i in range(len(dirs) - 1, -1, -1):
        alphas[i] = stps[i].dot(q) * ro[i]
        q.add_(dirs[i], alpha=-alphas[i])
    r = torch.mul(q, h_diag)
    for i in range(len(dirs)):
        beta = dirs[i].dot(r) * ro[i]
        r.add_(stps[i], alpha=alphas[i] - beta)
    return r
