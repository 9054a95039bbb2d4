"""One graph for every combination of ``compile`` / ``donate`` / ``buffers`` /
``per_sample`` over 6 steps (issue "Correct everywhere", point 3: the default
``compile=True, donate=False`` step recompiled after its first step, guarding on a
cache of ``fg.Flat``), and ``fg.params`` inside a compiled function."""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
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


class _Restarts(logging.Handler):
    """Counts dynamo's "Restarting analysis" records (its INFO log) while attached."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("Restarting analysis")

    def __enter__(self) -> _Restarts:
        self.log = logging.getLogger("torch._dynamo.convert_frame")
        self.level = self.log.level
        self.log.setLevel(logging.INFO)
        self.log.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.log.removeHandler(self)
        self.log.setLevel(self.level)


def _cold() -> contextlib.AbstractContextManager[None]:
    """Inductor's FX graph and AOTAutograd caches off: the restart happens in a cold
    compile only (a cached graph skips the pass that asks for it)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


def test_the_compiled_step_is_traced_once_with_inductor():
    """Every optimizer state holds its lr as a 0-d float64 tensor; as a CPU graph input
    it made inductor restart dynamo's analysis once (the step traced twice, ~2 s of a
    cold MLP compile). funcgrad/step/_scalars.py passes it as a 1-element view."""

    def plain(p: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
        return p - lr * p

    torch._dynamo.reset()
    with _cold(), _Restarts() as seen:  # the detector sees the restart where it happens
        torch.compile(plain, fullgraph=True)(torch.ones(3), torch.tensor(0.1, dtype=torch.float64))
    assert seen.count >= 1, "this torch no longer restarts on a 0-d float64 input"

    for donate in (False, True):
        torch._dynamo.reset()
        model, loss = model_and_loss("plain")
        tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)), fg.adam())
        step = fg.make_step(loss, tx, compile=True, donate=donate)
        params = fg.params(model)
        state = tx.init(params)
        x, y = torch.randn(8, 4), torch.randn(8, 3)
        with _cold(), _Restarts() as seen:
            for _ in range(3):
                params, state, _ = step(params, state, x, y)
        assert seen.count == 0, f"donate={donate}: the step was traced {1 + seen.count} times"


def test_two_states_share_one_compiled_step_each_with_its_own_lr():
    """One compiled donated step, called in turn with two (params, state) pairs whose
    learning rates differ (fg.set_lr): each pair ends where its own eager run does."""
    torch._dynamo.reset()
    model, loss = model_and_loss("plain")
    model.double()
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)), fg.adam(lr=1e-2))
    shared = fg.make_step(loss, tx, compile=True, donate=True)
    eager = fg.make_step(loss, tx, donate=True)
    start = {k: p.detach().clone() for k, p in model.named_parameters()}

    def pair(lr: float):
        params = {k: v.clone() for k, v in start.items()}  # one tensor per parameter
        return params, fg.set_lr(tx.init(params), lr)

    (pa, sa), (pb, sb) = pair(1e-2), pair(3e-2)
    (qa, ra), (qb, rb) = pair(1e-2), pair(3e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x, y = torch.randn(8, 4, generator=g).double(), torch.randn(8, 3, generator=g).double()
        out = shared(pa, sa, x, y)
        assert out[0] is pa and out[1] is sa  # donated: the caller's own, written into
        shared(pb, sb, x, y)
        eager(qa, ra, x, y)
        eager(qb, rb, x, y)
    assert fg.get_lr(sa) == [1e-2] and fg.get_lr(sb) == [3e-2]
    for got, want in ((pa, qa), (pb, qb)):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12)
    assert not all(torch.equal(pa[k], pb[k]) for k in pa)  # the two lrs did differ


@pytest.mark.parametrize("container", [dict, collections.OrderedDict])
def test_a_custom_state_with_a_0d_float64_leaf_compiles_equal_to_eager(container):
    """A user's transformation keeping a 0-d float64 CPU tensor in its state (a plain
    dict, whose leaf the compiled step passes as a view, or an OrderedDict, left as a
    0-d input): the compiled donated step equals the eager one and writes the leaf."""

    def scaled() -> fg.GradientTransformation:
        def init(params):
            return container(scale=torch.tensor(1.0, dtype=torch.float64))

        def update(grads, state, params=None):
            s = state["scale"] * 0.5
            out = {k: g * s.to(g.dtype) for k, g in grads.items()}
            return out, container(scale=s)

        return fg.GradientTransformation(init, update)

    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        model, loss = model_and_loss("plain")
        model.double()
        tx = fg.chain(scaled(), fg.adam(lr=1e-2))
        params = {k: p.detach().clone() for k, p in model.named_parameters()}
        state = tx.init(params)
        step = fg.make_step(loss, tx, compile=compiled, donate=True)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            x, y = torch.randn(8, 4, generator=g).double(), torch.randn(8, 3, generator=g).double()
            step(params, state, x, y)
        results.append((params, state))
    (pe, se), (pc, sc) = results
    assert se.inner_states[0]["scale"].item() == sc.inner_states[0]["scale"].item() == 0.125
    for k in pe:
        torch.testing.assert_close(pc[k], pe[k], rtol=1e-12, atol=1e-12)
