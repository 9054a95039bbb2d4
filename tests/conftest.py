"""Shared fixtures: the seed model, and a checker that runs a function eagerly and
under torch.compile(fullgraph=True), asserting equal results and one graph."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import funcgrad as fg

# tests/integrations/ needs ``funcgrad[integrations]`` (Lightning, transformers): it runs
# from ``make test-integrations`` (FUNCGRAD_INTEGRATIONS=1), not from ``make test``.
collect_ignore_glob = [] if os.environ.get("FUNCGRAD_INTEGRATIONS") else ["integrations/*"]

# ``make test-fast`` (FUNCGRAD_FAST=1): a test skips where it would call torch.compile,
# so the edit loop runs the eager references only; ``make test`` runs everything.
if os.environ.get("FUNCGRAD_FAST"):

    def _skip_compile(*args: Any, **kwargs: Any) -> Any:
        pytest.skip("compiles: skipped by make test-fast (make test runs it)")

    torch.compile = _skip_compile  # type: ignore[assignment]


class SeedModel(nn.Module):
    """The model of the original question: 1 -> 2 -> 3 -> 1 with ReLUs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1, 2)
        self.fc2 = nn.Linear(2, 3)
        self.fc3 = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def seed_loss(model: nn.Module) -> Callable[..., torch.Tensor]:
    def loss(params: fg.Params, x: torch.Tensor) -> torch.Tensor:
        return torch.mean(torch.square(5.0 - fg.call(model, params, x).sum()))

    return loss


@pytest.fixture
def seed_model() -> SeedModel:
    torch.manual_seed(0)
    return SeedModel()


def assert_trees_close(a: Any, b: Any, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Equal trees, entry by entry by path: a ``fg.Flat`` compares as the dict of its
    per-name views, so the flat and the per-tensor layouts compare with each other."""
    from funcgrad._tree import leaves_with_paths

    pa, pb = leaves_with_paths(a), leaves_with_paths(b)
    assert [p for p, _ in pa] == [p for p, _ in pb], f"structures differ: {pa} vs {pb}"
    for (_, x), (_, y) in zip(pa, pb, strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, equal_nan=True)
        else:
            assert x == y


def check_compiles(
    fn: Callable[..., Any],
    *arg_sets: tuple[Any, ...],
    backend: str = "aot_eager",
    rtol: float = 0.0,
    atol: float = 0.0,
) -> list[Any]:
    """Run ``fn`` on each argument tuple eagerly and compiled; equal results, one frame.

    Several argument sets with the same structure but other values prove that the
    compiled function neither graph-breaks nor recompiles on new values.
    """
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    outs = []
    for args in arg_sets:
        eager = fn(*args)
        comp = compiled(*args)
        assert_trees_close(comp, eager, rtol=rtol, atol=atol)
        outs.append(eager)
    assert_one_graph()
    return outs


def assert_one_graph() -> None:
    """One graph was captured and nothing recompiled.

    Counted with dynamo's own counters: ``unique_graphs`` counts graphs handed to the
    backend, so a recompile shows as a second graph. (A backend-side frame counter
    also counts dynamo's internal restart when it turns a 0-d tensor's float into a
    graph input, which is not a recompile.)
    """
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"expected one compiled graph, got {graphs}: {dict(counters['stats'])}"
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
