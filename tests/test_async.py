"""fg.make_step(compile="async"): eager steps while the compiled step builds in a
background thread, then the compiled step; against compile=True's run and the eager
step (funcgrad/step/_async.py, Background)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

import funcgrad as fg

GAVE_UP = 'fg.make_step(compile="async"): the compiled step could not be built, so the step goes on eagerly'


def _setup(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)).to(dtype)

    def loss(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(12):
        x = torch.randn(6, 5, generator=g, dtype=dtype)
        x[:, 0] = 0.0  # exact zeros in a gradient column: the seed rule's second branch
        data.append((x, torch.randint(0, 3, (6,), generator=g)))
    data[3][0].zero_()  # dead ReLUs downstream: whole zero groups, the first branch
    return model, loss, data


def _run(dtype, compile, wait_at=None):
    model, loss, data = _setup(dtype)
    groups = fg.group_by_module(model)
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adam(lr=1e-2))
    params = fg.params(model)
    state = tx.init(params)
    step = fg.make_step(loss, tx, compile=compile, donate=True)
    paths = []
    for i, (x, y) in enumerate(data):
        if i == wait_at:
            assert step.wait_compiled(600)
        params, state, _ = step(params, state, x, y)
        paths.append(step.is_compiled)
    return {k: v.clone() for k, v in params.views().items()}, state, paths


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float64, dict(rtol=1e-12, atol=1e-14)), (torch.float32, dict(rtol=1e-5, atol=1e-6))],
)
def test_async_steps_eagerly_then_compiled_and_equals_compile_true(dtype, tol):
    """With inductor: the first steps eager, then (after the build is awaited) the
    compiled step, without a step lost or repeated: the same parameters and state as
    compile=True's run, with the seed rule firing both branches."""
    torch._dynamo.reset()
    got, got_state, paths = _run(dtype, "async", wait_at=4)
    assert paths[0] is False and all(paths[4:]) and paths.index(True) <= 4
    want, want_state, _ = _run(dtype, True)
    assert int(got_state.inner_states[1].count) == int(want_state.inner_states[1].count) == 12
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol)
    _, _, eager_paths = _run(dtype, False)
    assert not any(eager_paths)


def test_the_switch_compiles_once():
    """The background build traces with copies of the first call's inputs; the real
    inputs pass its guards: one frame compiled over the whole run."""
    torch._dynamo.reset()
    counter = CompileCounter()
    _, _, paths = _run(torch.float64, {"scope": "async", "backend": counter}, wait_at=2)
    assert all(paths[2:]) and counter.frame_count == 1


def test_a_build_that_fails_warns_once_and_trains_eagerly():
    """A loss that reads a tensor on the host cannot be one graph: the build fails in
    the background, one RuntimeWarning names it, and every step runs eagerly, equal to
    compile=False's run."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()

    def loss(p, x):
        out = fg.call(model, p, x).square().mean()
        return out * 2 if float(out) > 0.5 else out  # a host read

    x = torch.randn(5, 4, dtype=torch.float64)
    results = []
    for compile in (False, {"scope": "async", "backend": "eager"}):
        tx = fg.sgd(lr=0.1)
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        state = tx.init(params)
        step = fg.make_step(loss, tx, compile=compile)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            params, state, _ = step(params, state, x)
            if compile is not False:
                assert not step.wait_compiled(600)
            for _ in range(3):
                params, state, _ = step(params, state, x)
                assert step.is_compiled is False
        mine = [w for w in caught if 'compile="async"' in str(w.message)]
        assert len(mine) == (0 if compile is False else 1)
        if mine:
            assert str(mine[0].message).startswith(GAVE_UP)
        results.append(params)
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k])


def test_funcgrad_runs_eagerly_while_another_thread_traces(monkeypatch):
    """torch's is_compiling() reads one flag for the process, set while dynamo traces
    in any thread (here set by hand, as a background build sets it). funcgrad asks
    dynamo's per-thread question instead: fg.params, fg.call and an eager step work in
    this thread meanwhile, and equal a run without the flag."""
    import torch.compiler

    def run():
        torch.manual_seed(0)
        model = nn.Linear(3, 2).double()
        params = fg.params(model)  # refuses inside a traced function
        tx = fg.adam(lr=0.1)
        step = fg.make_step(lambda p, x: fg.call(model, p, x).square().mean(), tx, donate=True)
        state = tx.init(params)
        for _ in range(3):
            step(params, state, torch.ones(4, 3, dtype=torch.float64))
        return {k: v.clone() for k, v in params.views().items()}

    want = run()
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling()
    got = run()
    for k in want:
        assert torch.equal(got[k], want[k])


def _option_case(case):
    """(model, loss, tx, make_step kwargs, batches) for one make_step option, float64,
    the seed rule firing both branches (a zero input column; one all-zero batch)."""
    torch.manual_seed(0)
    bn = case == "buffers"
    # No bias before BatchNorm: its gradient is zero only up to rounding, where the
    # rule's exact-zero test flips between kernels (docs/exact-zeros.md).
    layers = [nn.Linear(5, 8, bias=not bn)] + ([nn.BatchNorm1d(8)] if bn else [])
    layers += [nn.ReLU(), nn.Linear(8, 3)]
    model = nn.Sequential(*layers).double()
    groups = fg.group_by_module(model)
    rule = fg.per_group(fg.rules.zero_fix(), groups)
    lr = fg.cosine_decay(0.05, decay_steps=8) if case == "schedule" else 0.05
    tx = fg.chain(rule, fg.adam(lr=lr))
    kwargs = {}
    if case == "buffers":
        kwargs["buffers"] = True

        def loss(p, b, x, y):
            return nn.functional.cross_entropy(fg.call(model, p, x, buffers=b), y)
    else:

        def loss(p, x, y):
            return nn.functional.cross_entropy(fg.call(model, p, x), y)

    if case == "per_sample":
        kwargs["per_sample"] = fg.per_group(fg.rules.clip_norm(0.5), groups)
    if case == "ghost_clip":
        kwargs["per_sample"] = fg.ghost_clip(0.5)
    if case == "accumulate":
        tx = fg.accumulate(tx, every=3)
    g = torch.Generator().manual_seed(1)
    batches = []
    for i in range(10):
        x = torch.randn(6, 5, generator=g, dtype=torch.float64)
        x[:, 0] = 0.0
        if i == 3:
            x.zero_()
        batches.append((x, torch.randint(0, 3, (6,), generator=g)))
    return model, loss, tx, kwargs, batches


def _run_option(case, compile, wait_at=None):
    model, loss, tx, kwargs, batches = _option_case(case)
    params = fg.params(model)
    state = tx.init(params)
    bufs = (fg.buffers(model),) if case == "buffers" else ()
    step = fg.make_step(loss, tx, compile=compile, donate=True, **kwargs)
    paths = []
    for i, batch in enumerate(batches):
        if i == wait_at:
            assert step.wait_compiled(600)
        out = step(params, state, *bufs, *batch)
        params, state = out[0], out[1]
        bufs = (out[2],) if bufs else ()
        paths.append(step.is_compiled)
    got = {k: v.clone() for k, v in params.views().items()}
    got.update({f"buffer:{k}": v.clone() for b in bufs for k, v in b.items()})
    return got, paths


@pytest.mark.parametrize("case", ["buffers", "per_sample", "ghost_clip", "accumulate", "schedule"])
def test_async_with_each_step_option_equals_the_eager_run(case):
    """buffers=True (train-mode BatchNorm), per_sample= (vmapped, and fg.ghost_clip,
    whose forward hook sees the eager steps' shadow modules), fg.accumulate and a schedule:
    eager steps, the switch (after the build is awaited at step 4), then compiled
    (inductor) steps give the parameters (and running statistics) of an all-eager run
    in float64: no step lost, repeated or half-applied at the switch, and the
    background build's own step on copies left nothing behind (accumulate's counter,
    the schedule's count, BatchNorm's num_batches_tracked)."""
    want, _ = _run_option(case, False)
    got, paths = _run_option(case, "async", wait_at=4)
    assert paths[0] is False and all(paths[4:])
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-13, msg=k)


class _TiedLM(nn.Module):
    """An embedding tied to the output head, as GPTs do."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, 8)
        self.mix = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        h = self.tok(idx)
        for layer in self.mix:
            h = torch.tanh(layer(h))
        return self.head(h)


def _tied_run(compile, steps=None):
    torch.manual_seed(0)
    model = _TiedLM().double()
    tx = fg.adam(lr=1e-2)

    def loss(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x).reshape(-1, 11), y.reshape(-1))

    params = fg.params(model)
    state = tx.init(params)
    step = fg.make_step(loss, tx, compile=compile, donate=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 11, (4, 6), generator=g), torch.randint(0, 11, (4, 6), generator=g)
    done, compiled_steps = 0, 0
    while (steps is None and compiled_steps < 3) or (steps is not None and done < steps):
        step(params, state, x, y)
        done += 1
        compiled_steps += bool(step.is_compiled)
        assert steps is not None or done < 100_000, "the build never finished"
    return {k: v.clone() for k, v in params.views().items()}, done


def test_async_build_traces_the_module_while_eager_steps_run_it():
    """Eager steps run the module (functional_call swaps its tensors in and out) for
    the whole build, while dynamo traces the same module in the other thread: the
    build sees the module as it is (the tied weight tied), compiles, and the run
    equals an eager one. Before the eager steps ran on a shadow of the module
    (funcgrad/model/_model.py, shadowing), the build failed on char_gpt's model:
    "trainable parameters ['head.weight'] are missing"; this test, 3 runs of 4."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got, done = _tied_run("async")
    want, _ = _tied_run(False, steps=done)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)
