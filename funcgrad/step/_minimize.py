"""``fg.make_step`` for an optimizer that evaluates the loss itself (``fg.lbfgs``: its
transformation carries ``facts.minimize``, funcgrad/optim/_lbfgs.py): the step hands
it ``evaluate(x)``, the loss and its gradient at the flat parameter vector ``x``,
compiled when ``compile=`` asks (one graph, reused by every evaluation), and runs its
iterations eagerly (each decision reads a loss on the host, as torch's LBFGS does)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.func import grad_and_value

from ..core._base import GradientTransformation, LossFn, Params, State
from ..core._compose import transform_active
from ..core._flat import Flat
from ..core._vector import flat_vector, unflatten
from ._checks import compile_scope
from ._handle import Step, result_type


def minimize_step(
    loss_fn: LossFn,
    tx: GradientTransformation,
    *,
    has_aux: bool,
    compile: Any,
    donate: bool,
    per_sample: Any,
    buffers: bool,
) -> Step:
    """``step(params, state, *batch) -> (params, state, loss[, aux])`` for ``tx`` with
    ``facts.minimize``; ``loss`` (and ``aux``) from the first evaluation, as torch's
    ``LBFGS.step`` returns the closure's first loss."""
    who = "fg.make_step"
    if per_sample is not None or buffers:
        raise ValueError(
            f"{who}: fg.lbfgs is a full-batch method that evaluates the loss itself; "
            "per_sample= and buffers=True do not apply to it. Evaluate in eval mode (no "
            "buffer updates) and clip nothing per sample."
        )
    scope, options = compile_scope(compile)
    if scope == "async":
        raise ValueError(
            f'{who}: compile="async" compiles a whole step in the background; fg.lbfgs\'s '
            "step is host-side iterations around many evaluations. Use compile=True (or "
            '"gradients"): the evaluation is compiled once and reused.'
        )
    value_and_grad = grad_and_value(loss_fn, has_aux=has_aux)
    if scope is not None:
        value_and_grad = torch.compile(value_and_grad, fullgraph=True, **options)
    minimize = tx.facts.minimize
    assert minimize is not None

    def step(params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        if isinstance(params, Flat):
            params.check_attached(who)
        if transform_active():
            raise ValueError(
                f"{who}: fg.lbfgs decides each iteration from loss values read on the "
                "host, which a torch.func transform (vmap, grad) cannot trace. Run it "
                "outside the transform."
            )
        like = dict(params.items())

        def evaluate(x: Tensor) -> tuple[float, Tensor, Any]:
            grads, out = value_and_grad(unflatten(x, like), *args)
            loss = out[0] if has_aux else out
            flat = torch.cat([grads[k].reshape(-1) for k in like])
            return float(loss.detach()), flat, out

        x, state, first = minimize(evaluate, flat_vector(like, who), state)
        new = unflatten(x, like)
        if donate:
            with torch.no_grad():
                for k, p in like.items():
                    p.copy_(new[k])
            out_params: Any = params
        else:
            out_params = new
        return (out_params, state, *first) if has_aux else (out_params, state, first)

    return Step(step, is_compiled=scope is not None, result=result_type(False, has_aux))
