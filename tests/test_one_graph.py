"""One graph for every combination of ``compile`` / ``donate`` / ``buffers`` /
``per_sample`` over 6 steps (issue "Correct everywhere", point 3: the default
``compile=True, donate=False`` step recompiled after its first step, guarding on a
cache of ``fg.Flat``), and ``fg.params`` inside a compiled function."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

import funcgrad as fg


def model_and_loss(mode: str):
    torch.manual_seed(0)
    if mode == "buffers":
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))

        def loss(p, b, x, y):
            return ((fg.call(model, p, x, buffers=b) - y) ** 2).mean()

        return model, loss
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))

    def loss(p, x, y):
        return ((fg.call(model, p, x) - y) ** 2).mean()

    return model, loss


COMBOS = list(
    itertools.product(("step", "gradients"), (False, True), ("plain", "buffers", "per_sample"))
)


@pytest.mark.parametrize("scope,donate,mode", COMBOS)
def test_six_steps_compile_one_graph(scope, donate, mode):
    """Counted with dynamo's own counter backend (guards are dynamo's, whatever the
    backend); the default path under inductor is counted below."""
    torch._dynamo.reset()
    model, loss = model_and_loss(mode)
    groups = fg.group_by_module(model)
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adam(lr=1e-2))
    counter = CompileCounter()
    step = fg.make_step(
        loss,
        tx,
        compile={"scope": scope, "backend": counter},
        donate=donate,
        buffers=mode == "buffers",
        per_sample=fg.per_group(fg.rules.clip_norm(1.0), groups) if mode == "per_sample" else None,
    )
    params = fg.params(model)
    state = tx.init(params)
    g = torch.Generator().manual_seed(0)
    bufs = fg.buffers(model)
    for _ in range(6):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
        if mode == "buffers":
            params, state, bufs, _ = step(params, state, bufs, x, y)
        else:
            params, state, _ = step(params, state, x, y)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs in 6 steps"


def test_the_default_compiled_step_compiles_once_with_inductor():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model, loss = model_and_loss("plain")
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)), fg.adam())
    step = fg.make_step(loss, tx, compile=True)  # donate=False: the default
    params = fg.params(model)
    state = tx.init(params)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    for _ in range(6):
        params, state, _ = step(params, state, x, y)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"]


def test_fg_params_inside_a_compiled_function_says_to_call_it_outside():
    model = nn.Linear(2, 1)

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return fg.call(model, fg.params(model), x).sum()

    with pytest.raises(
        Exception, match=re.escape("fg.params(model) was called inside a torch.compile'd function")
    ):
        f(torch.ones(3, 2))
    # outside, then passed in: works, one graph
    params = fg.params(model)

    @torch.compile(fullgraph=True, backend="eager")
    def g(p, x):
        return fg.call(model, p, x).sum()

    torch.testing.assert_close(g(params, torch.ones(3, 2)), model(torch.ones(3, 2)).sum())
