"""Skipping steps whose gradients are not finite, without a host sync."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..core._base import (
    GradientTransformation,
    Params,
    State,
    check_state,
    params_device,
    require_transformation,
    shardable,
)
from ..core._invariants import invariants
from ..core._tree import tree_map
from ..rules import any_nonfinite


class SkipIfNonfiniteState(NamedTuple):
    """``inner``: the wrapped state; ``skipped``: int64 count of skipped steps;
    ``last_finite``: whether the latest step's gradients were all finite."""

    inner: State
    skipped: Tensor
    last_finite: Tensor


invariants(SkipIfNonfiniteState, skipped="nonnegative")


def skip_if_nonfinite(tx: GradientTransformation) -> GradientTransformation:
    """Run ``tx``, but a step whose gradients hold NaN or +-Inf changes nothing.

    On such a step the updates are zero (params stay as they are) and the inner
    state is kept; ``skipped`` counts those steps. The decision is a 0-d bool tensor
    used in ``torch.where``: no graph break, no GPU sync.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.skip_if_nonfinite(fg.adam(lr=0.1))
        >>> p = {"w": torch.zeros(1)}
        >>> u, s = tx.update({"w": torch.tensor([float("nan")])}, tx.init(p), p)
        >>> u["w"], int(s.skipped), int(s.inner.count)
        (tensor([0.]), 1, 0)
    """
    require_transformation(tx, "fg.skip_if_nonfinite: tx")

    nonfinite = any_nonfinite()  # its masks reduced through _rule_base.any_ (fast eagerly)

    def init(params: Params) -> SkipIfNonfiniteState:
        device = params_device(params)
        return SkipIfNonfiniteState(
            tx.init(params),
            torch.zeros((), dtype=torch.int64, device=device),
            torch.ones((), dtype=torch.bool, device=device),
        )

    def update(
        grads: Params, state: SkipIfNonfiniteState, params: Params | None = None
    ) -> tuple[Params, SkipIfNonfiniteState]:
        check_state(state, SkipIfNonfiniteState, "fg.skip_if_nonfinite")
        ok = ~nonfinite(grads) if len(grads) else torch.ones_like(state.last_finite)
        updates, inner = tx.update(grads, state.inner, params)
        updates = {k: torch.where(ok, u, torch.zeros_like(u)) for k, u in updates.items()}
        return updates, SkipIfNonfiniteState(
            tree_map(lambda new, old: torch.where(ok, new, old), inner, state.inner),
            state.skipped + (~ok).to(torch.int64),
            ok,
        )

    return shardable(
        GradientTransformation(init, update),
        tx,
        by_entry=True,
        remake=lambda parts: skip_if_nonfinite(parts[0]),
    )
