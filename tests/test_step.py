"""make_step end to end: against torch.optim + an eager rule, eager vs compiled,
donated vs not, and its errors."""

from __future__ import annotations

import re

import pytest
import torch
from references import (
    SeedModel,
    assert_one_graph,
    assert_trees_close,
    dead_seed_model,
    ref_zero_fix,
    seed_loss,
)
from torch._dynamo.utils import counters

import funcgrad as fg
from funcgrad.step._handle import Step


def reference_run(model: SeedModel, x: torch.Tensor, steps: int) -> dict[str, torch.Tensor]:
    """torch.optim.Adam, with the intended rule applied to .grad by a plain loop."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    layers = [model.fc1, model.fc2, model.fc3]
    for _ in range(steps):
        opt.zero_grad()
        seed_loss(model)(dict(model.named_parameters()), x).backward()
        for layer in layers:
            group = {n: p.grad for n, p in layer.named_parameters()}
            fixed = ref_zero_fix(group)
            for n, p in layer.named_parameters():
                p.grad = fixed[n]
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def make(model, **kw):
    groups = fg.group_by_module(model)
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adam(lr=1e-2))
    return tx, fg.make_step(seed_loss(model), tx, **kw)


def test_eager_step_equals_torch_optim_with_the_rule():
    x = torch.rand(3, 1, dtype=torch.float64)
    ref_model, model = dead_seed_model(), dead_seed_model()
    want = reference_run(ref_model, x, 20)
    tx, step = make(model)
    params = fg.params(model)
    state = tx.init(params)
    for _ in range(20):
        params, state, _ = step(params, state, x)
    for k in want:
        torch.testing.assert_close(params[k], want[k], rtol=1e-10, atol=1e-12)
    assert int(state.inner_states[1].count) == 20


@pytest.fixture(scope="module")
def compiled_seed():
    """One inductor-compiled donated step, shared by the tests below (compiling is
    the slow part on 2 cores)."""
    torch._dynamo.reset()
    counters.clear()
    model = dead_seed_model(torch.float32)
    tx, step = make(model, compile=True, donate=True)
    return model, tx, step


def test_compiled_donated_equals_eager_and_compiles_once(compiled_seed):
    model, tx, step = compiled_seed
    eager_model = dead_seed_model(torch.float32)
    etx, estep = make(eager_model)
    x = torch.rand(3, 1)
    params, state = fg.params(model), tx.init(fg.params(model))
    eparams, estate = fg.params(eager_model), etx.init(fg.params(eager_model))
    state_leaves = [t for t in state.inner_states[1].mu.values()]
    for i in range(20):
        xi = x + 0.01 * i
        out = step(params, state, xi)
        eparams, estate, eloss = estep(eparams, estate, xi)
        assert out[0] is params and out[1] is state  # donated: the same tensors back
        assert_trees_close((params, state, out[2]), (eparams, estate, eloss), rtol=1e-6, atol=1e-6)
    assert_one_graph()
    # The module sees every update: fg.params(model) shares storage with it.
    for n, p in model.named_parameters():
        assert p.data_ptr() == params[n].data_ptr()
        torch.testing.assert_close(p.detach(), eparams[n], rtol=1e-6, atol=1e-6)
    assert all(a is b for a, b in zip(state.inner_states[1].mu.values(), state_leaves, strict=True))
    # fc1 really was all-zero, and the rule made it move.
    assert not torch.equal(params["fc1.bias"], torch.full((2,), -10.0))


def test_the_step_says_whether_it_ran_compiled(compiled_seed):
    """make_step returns an fg.make_step Step: is_compiled says which path the last call
    took; wait_compiled without a background build says whether the step is compiled."""
    model, tx, step = compiled_seed
    assert isinstance(step, Step) and repr(step).startswith("<fg.make_step step")
    params = fg.params(model)
    step(params, tx.init(params), torch.rand(3, 1))
    assert step.is_compiled and step.wait_compiled(0.0)
    _, eager = make(dead_seed_model(torch.float32))
    assert not eager.is_compiled and not eager.wait_compiled()


def test_donated_equals_not_donated():
    x = torch.rand(3, 1, dtype=torch.float64)
    a, b = dead_seed_model(), dead_seed_model()
    txa, stepa = make(a, donate=True)
    txb, stepb = make(b, donate=False)
    pa, pb = fg.params(a), fg.params(b)
    sa, sb = txa.init(pa), txb.init(pb)
    for _ in range(5):
        pa, sa, la = stepa(pa, sa, x)
        pb, sb, lb = stepb(pb, sb, x)
        assert_trees_close((pa, sa, la), (pb, sb, lb))
    # Not donated: the module did not move.
    assert torch.equal(b.fc2.weight, dead_seed_model().fc2.weight)


def test_lr_schedule_and_tensor_lr_do_not_recompile():
    torch._dynamo.reset()
    counters.clear()
    model = torch.nn.Linear(4, 2)
    lr = torch.tensor(0.1, dtype=torch.float64)
    for opt in (fg.adam(lr=fg.cosine_decay(0.1, 200)), fg.adamw(lr=lr)):
        torch._dynamo.reset()
        counters.clear()
        params = {k: v.clone() for k, v in fg.params(model).items()}
        state = opt.init(params)
        step = fg.make_step(
            lambda p, x: fg.call(model, p, x).square().mean(),
            opt,
            compile={"backend": "aot_eager"},
            donate=True,
        )
        x = torch.randn(8, 4)
        for i in range(200):
            if i == 100:
                lr.fill_(0.01)  # edited in place: read by the graph, no recompile
            step(params, state, x)
        assert_one_graph()
        assert int(state.count) == 200


def test_has_aux():
    model = torch.nn.Linear(2, 1)

    def loss(p, x):
        out = fg.call(model, p, x)
        return out.square().mean(), {"mean_out": out.mean()}

    tx = fg.adam()
    p = fg.params(model)
    _, _, loss_value, aux = fg.make_step(loss, tx, has_aux=True)(p, tx.init(p), torch.ones(3, 2))
    torch.testing.assert_close(aux["mean_out"], model(torch.ones(3, 2)).mean().detach())
    torch.testing.assert_close(loss_value, model(torch.ones(3, 2)).square().mean().detach())


def test_step_errors_before_tracing():
    torch._dynamo.reset()
    counters.clear()
    model = SeedModel()
    tx, step = make(model, compile={"backend": "aot_eager"}, donate=True)
    params = fg.params(model)
    state = tx.init(params)
    x = torch.rand(3, 1)
    with pytest.raises(
        TypeError, match=re.escape("cannot be called with params and 2 batch argument(s)")
    ):
        step(params, state, x, x)
    with pytest.raises(
        TypeError, match=re.escape("cannot be called with params and 0 batch argument(s)")
    ):
        step(params, state)
    other = fg.adam()
    with pytest.raises(
        TypeError,
        match=re.escape("fg.chain.update: got a state that this chain's init did not make"),
    ):
        step(params, other.init(params), x)
    with pytest.raises(KeyError, match=re.escape("the state does not fit these gradients")):
        small = {"fc1.weight": params["fc1.weight"]}
        bad_state = fg.chain(fg.per_group(fg.rules.unchanged(), {}), fg.adam(lr=1e-2)).init(small)
        step(params, bad_state, x)
    with pytest.raises(
        ValueError, match=re.escape("fg.make_step: params['fc1.weight'] requires grad")
    ):
        step(dict(model.named_parameters()), state, x)
    aliased = dict(params)
    aliased["fc2.bias"] = params["fc2.weight"][0]
    with pytest.raises(
        ValueError, match=re.escape("params['fc2.bias'] shares memory with params['fc2.weight']")
    ):
        step(aliased, state, x)
    with pytest.raises(
        TypeError, match=re.escape("fg.make_step: tx must be a GradientTransformation")
    ):
        fg.make_step(seed_loss(model), fg.rules.zero_fix())  # type: ignore[arg-type]
    # Nothing above reached the compiler.
    assert counters["stats"]["unique_graphs"] == 0


class Scaled(torch.nn.Module):
    """A Linear with a learned 0-d temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.lin(x) * self.temperature


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compiled_donated_step_updates_0d_params(dtype):
    """torch 2.13 drops an in-place write into a 0-d float64 input under compile;
    funcgrad writes 0-d donated tensors through a 1-element view."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled_model, eager_model = Scaled().to(dtype), Scaled().to(dtype)
    eager_model.load_state_dict(compiled_model.state_dict())
    tx = fg.adam(lr=0.1)
    x = torch.randn(4, 3, dtype=dtype)

    def run(model, **kw):
        step = fg.make_step(lambda p, x: fg.call(model, p, x).square().mean(), tx, **kw)
        params = fg.params(model)
        state = tx.init(params)
        for _ in range(3):
            params, state, _ = step(params, state, x)
        return params

    got = run(compiled_model, compile={"backend": "aot_eager"}, donate=True)
    want = run(eager_model)
    assert float(got["temperature"]) != 1.5
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    assert float(compiled_model.temperature.detach()) == float(got["temperature"])


def test_the_step_returns_a_named_tuple_of_its_parts():
    """(params, state, loss) a plain tuple; with aux or buffers (four or five parts) a
    NamedTuple, buffers after state, aux last; the same values as unpacked, eagerly and
    under vmap (an ensemble's stacked params)."""
    model = torch.nn.Linear(3, 2).double()
    tx = fg.sgd(lr=0.1)
    x = torch.randn(4, 3, dtype=torch.float64)

    def loss(p, x):
        return fg.call(model, p, x).square().mean()

    def loss_aux(p, x):
        out = fg.call(model, p, x)
        return out.square().mean(), {"mean": out.mean()}

    p = {k: v.detach().clone() for k, v in model.named_parameters()}
    out = fg.make_step(loss, tx)(p, tx.init(p), x)
    assert type(out) is tuple
    new, _, value = out
    torch.testing.assert_close(value, loss(p, x))
    aux = fg.make_step(loss_aux, tx, has_aux=True)(p, tx.init(p), x)
    assert aux._fields == ("params", "state", "loss", "aux")
    torch.testing.assert_close(aux.aux["mean"], fg.call(model, p, x).mean())
    for k in p:
        torch.testing.assert_close(aux.params[k], new[k])
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).double()
    bn = fg.make_step(lambda p, b, x: fg.call(net, p, x, buffers=b).square().mean(), tx,
                      buffers=True)  # fmt: skip
    q = {k: v.detach().clone() for k, v in net.named_parameters()}
    b = {k: v.clone() for k, v in net.named_buffers()}
    got = bn(q, tx.init(q), b, x)
    assert got._fields == ("params", "state", "buffers", "loss")
    assert int(got.buffers["1.num_batches_tracked"]) == 1
    assert got.loss is got[3]
    stacked = {k: torch.stack([v, v + 1]) for k, v in p.items()}
    step = fg.make_step(loss_aux, tx, has_aux=True)
    ens = torch.func.vmap(lambda p: step(p, tx.init(p), x), randomness="same")(stacked)
    assert type(ens).__name__ == "StepResultAux"
    torch.testing.assert_close(ens.loss[0], value)
