"""Gradient accumulation with optax ``MultiSteps`` semantics.

``accumulate(tx, every=k)`` keeps the running mean of the gradients of ``k``
micro-steps. On every ``k``-th update the inner ``tx`` sees that mean (so rules in
it judge the step's gradient, not a micro-batch's) and its updates are returned;
on the other updates the updates are zero and ``tx``'s state is left as it was.

Which of the two happens is decided on the device (``mini_step + 1 == every``), not
on the host. Eagerly, the step reads that flag and runs one branch, so a non-final
micro-step does not run ``tx``. Under ``torch.compile`` both are computed and
``torch.where`` keeps one: one graph, no host sync. ``torch.cond`` would skip the
unused branch, but in torch 2.13 its branches may neither return nor write their
inputs ("Higher order ops do not support aliasing / input mutation"), so the
non-final branch must copy the inner state, and those copies cost more than the
update they save (docs/compile-notes.md: the update is memory-bound, so what counts
is bytes moved, not Adam's arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _compat
from .._compat import compiling
from ..core import _flat as flat
from ..core._base import (
    GradientTransformation,
    Params,
    State,
    check_state,
    is_int,
    params_device,
    require_transformation,
    shardable,
)
from ..core._compose import transform_active
from ..core._invariants import invariants


class AccumulateState(NamedTuple):
    """``mini_step``: int64 0-d, micro-steps since ``tx`` last ran (0 to every-1);
    ``acc``: the mean of their gradients; ``inner``: ``tx``'s state."""

    mini_step: Tensor
    acc: dict[str, Tensor]
    inner: State


invariants(AccumulateState, mini_step="nonnegative", acc="finite")


def _branch(pred: Tensor, yes: Callable[..., Any], no: Callable[..., Any], args: Any) -> Any:
    """``yes(*args)`` where ``pred`` holds, else ``no(*args)``; trees matched by key.

    Eagerly only the chosen branch runs; traced (compile, make_step's checks on
    shape-only tensors, or under a ``torch.func`` transform, where ``vmap`` cannot
    read the flag), both run and ``torch.where`` selects (module docstring).
    """
    if not (pred.is_meta or compiling() or transform_active()):
        return yes(*args) if bool(pred) else no(*args)
    return _compat.tree_map(lambda a, b: torch.where(pred, a, b), yes(*args), no(*args))


def accumulate(tx: GradientTransformation, every: int) -> GradientTransformation:
    """Run ``tx`` on the mean gradient of every ``every`` micro-steps (optax ``MultiSteps``).

    ``k`` micro-steps on ``k`` equal micro-batches equal one step on the concatenated
    batch (tested to 1e-9 in float64). Updates between are zero, so the parameters
    do not move; ``tx``'s state (Adam's count, moments) advances once per ``every``.

    Args:
        tx: the transformation to run on accumulated gradients, usually the whole
            chain (rules, then Adam).
        every: micro-steps per update (``every=1`` is ``tx`` itself).

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.accumulate(fg.adam(lr=0.1), every=2)
        >>> p = {"w": torch.zeros(1)}
        >>> s = tx.init(p)
        >>> u1, s = tx.update({"w": torch.tensor([1.0])}, s, p)
        >>> u2, s = tx.update({"w": torch.tensor([3.0])}, s, p)
        >>> u1["w"], u2["w"], int(s.inner.count)  # Adam's first step on the mean, 2.0
        (tensor([0.]), tensor([-0.1000]), 1)
    """
    require_transformation(tx, "fg.accumulate: tx")
    if not is_int(every) or every < 1:
        raise ValueError(
            f"fg.accumulate: every must be an int >= 1 (micro-steps per update), got {every!r}."
        )

    def init(params: Params) -> AccumulateState:
        return AccumulateState(
            torch.zeros((), dtype=torch.int64, device=params_device(params)),
            flat.zeros_like(params),  # flat for fg.params(model)'s layout
            tx.init(params),
        )

    # Both branches give the updates in the accumulator's layout (flat or per tensor).
    def final(acc: Params, inner: State, params: Params | None) -> tuple[Params, State]:
        updates, inner = tx.update(acc, inner, params)
        return flat.like(updates, flat.layout_of(acc)), inner  # type: ignore[return-value]

    def middle(acc: Params, inner: State, params: Params | None) -> tuple[Params, State]:
        return _compat.tree_map(torch.zeros_like, acc), inner

    def update(
        grads: Params, state: AccumulateState, params: Params | None = None
    ) -> tuple[Params, AccumulateState]:
        check_state(state, AccumulateState, "fg.accumulate")
        if state.acc.keys() != grads.keys():
            raise KeyError(
                f"fg.accumulate.update: the state was made for parameters "
                f"{sorted(state.acc)}, but the gradients are for {sorted(grads)}."
            )
        if every == 1:  # the mean of one gradient is that gradient
            updates, inner = tx.update(grads, state.inner, params)
            return updates, AccumulateState(state.mini_step, state.acc, inner)
        n = state.mini_step + 1
        # The running mean: exact on the first micro-step (acc is 0 there), and no
        # sum of k gradients that could overflow in half precision.
        grads = flat.like(grads, flat.layout_of(state.acc))  # type: ignore[assignment]
        acc = _compat.tree_map(lambda a, g: a + (g - a) / n, state.acc, grads)
        done = n == every
        updates, inner = _branch(done, final, middle, (acc, state.inner, params))
        new_acc = _compat.tree_map(lambda a: torch.where(done, 0.0, a), acc)
        return updates, AccumulateState(torch.where(done, 0, n), new_acc, inner)

    return shardable(
        GradientTransformation(init, update),
        tx,
        by_entry=True,
        remake=lambda parts: accumulate(parts[0], every),
    )
