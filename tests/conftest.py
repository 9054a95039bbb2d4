"""Shared fixtures: the seed model, and a checker that runs a function eagerly and
under torch.compile(fullgraph=True), asserting equal results and one graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo.testing
from torch import nn

import funcgrad as fg


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
    import optree

    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    assert sa == sb, f"structures differ: {sa} vs {sb}"
    for x, y in zip(la, lb, strict=True):
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
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    outs = []
    for args in arg_sets:
        eager = fn(*args)
        comp = compiled(*args)
        assert_trees_close(comp, eager, rtol=rtol, atol=atol)
        outs.append(eager)
    assert counter.frame_count == 1, f"expected one compiled frame, got {counter.frame_count}"
    return outs
