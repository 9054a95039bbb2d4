"""The eager step's fast paths against a loop that takes every step's gradients with
torch.func.grad_and_value: plain-autograd gradients after the first call (equal bit
for bit on the seed MLP, the small GPT with aux and the BatchNorm ResNet with
buffers=True; buffer writes refused on every call, not only the first) and Adam's
borrowed buffers for large tensors (funcgrad/core/_scratch.py)."""

from __future__ import annotations

import optree
import pytest
import torch
from references import (
    TinyResNet,
    assert_trees_close,
    dead_seed_model,
    resnet_batches,
    resnet_model,
    seed_loss,
)
from torch import nn
from torch.func import grad_and_value
from workers.shard_workers import small_gpt

import funcgrad as fg
import funcgrad.core._scratch as fg_scratch
import funcgrad.step._gradients as fg_step


def reference(loss_fn, tx, params, state, batches_, has_aux=False, buffers=None):
    """Each step by hand: torch.func gradients, tx.update, apply_updates."""
    outs = []
    for batch in batches_:
        if buffers is None:
            grads, out = grad_and_value(loss_fn, has_aux=has_aux)(params, *batch)
        else:

            def with_bufs(p, b, *xs):
                local = {k: v.clone() for k, v in b.items()}
                return loss_fn(p, local, *xs), local

            grads, (out, buffers) = grad_and_value(with_bufs, has_aux=True)(params, buffers, *batch)
        updates, state = tx.update(grads, state, params)
        params = fg.apply_updates(params, updates)
        outs.append(out)
    return params, state, buffers, outs


class CountingGrad:
    """Counts the calls of torch.func.grad_and_value made by make_step."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *a, **kw):
        self.calls += 1
        return grad_and_value(*a, **kw)


@pytest.fixture
def counted(monkeypatch) -> CountingGrad:
    spy = CountingGrad()
    monkeypatch.setattr(fg_step, "grad_and_value", spy)
    return spy


def seed_case():
    model = dead_seed_model()
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)), fg.adam(lr=1e-2))
    g = torch.Generator().manual_seed(0)
    data = [(torch.rand(3, 1, generator=g, dtype=torch.float64),) for _ in range(5)]
    return model, seed_loss(model), tx, data, False


def gpt_case():
    m, tx = small_gpt()

    def loss(p, idx, tgt):
        logits = fg.call(m, p, idx)
        return nn.functional.cross_entropy(logits.reshape(-1, 11), tgt.reshape(-1)), logits

    g = torch.Generator().manual_seed(2)
    data = []
    for _ in range(4):
        idx = torch.randint(0, 11, (3, 9), generator=g)
        data.append((idx[:, :-1], idx[:, 1:]))
    return m, loss, tx, data, True


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 5, batch_first=True)
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def lstm_case():
    """An nn.LSTM (eager only: dynamo refuses it), float64."""
    torch.manual_seed(0)
    m = Recurrent().double()
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), fg.adam(lr=1e-2))

    def loss(p, x, y):
        return (fg.call(m, p, x) - y).square().mean()

    g = torch.Generator().manual_seed(3)
    data = [
        (torch.randn(4, 6, 3, generator=g, dtype=torch.float64),
         torch.randn(4, 1, generator=g, dtype=torch.float64))
        for _ in range(4)
    ]  # fmt: skip
    return m, loss, tx, data, False


@pytest.mark.parametrize("case", [seed_case, gpt_case, lstm_case])
@pytest.mark.parametrize("donate", [False, True])
def test_eager_step_equals_torch_func_steps_bit_for_bit(case, donate, counted):
    model, loss, tx, data, has_aux = case()
    params = {k: v.clone() for k, v in fg.params(model).items()}
    want_p, want_s, _, want_out = reference(loss, tx, params, tx.init(params), data, has_aux)
    calls_by_reference = counted.calls
    step = fg.make_step(loss, tx, has_aux=has_aux, donate=donate)
    params = {k: v.clone() for k, v in fg.params(model).items()}
    state = tx.init(params)
    for batch, out in zip(data, want_out, strict=True):
        got = step(params, state, *batch)
        params, state = got[0], got[1]
        assert_trees_close(got[2:], out if has_aux else (out,))
        assert not any(
            t.requires_grad for t in optree.tree_leaves(got) if isinstance(t, torch.Tensor)
        )
    assert_trees_close(params, want_p)
    assert_trees_close(state, want_s)
    # Only the first call went through torch.func; the others through plain autograd.
    assert counted.calls - calls_by_reference == 1


def test_eager_step_with_buffers_equals_torch_func_steps_bit_for_bit(counted):
    model: TinyResNet = resnet_model()
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)), fg.adam(lr=0.01))

    def loss(p, b, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x, buffers=b), y)

    data = resnet_batches(4)
    p0 = {k: v.clone() for k, v in fg.params(model).items()}
    b0 = {k: v.clone() for k, v in fg.buffers(model).items()}
    want_p, want_s, want_b, _ = reference(loss, tx, p0, tx.init(p0), data, buffers=b0)
    before = counted.calls
    step = fg.make_step(loss, tx, buffers=True, donate=True)
    params, buffers = fg.params(model), fg.buffers(model)
    state = tx.init(params)
    for x, y in data:
        params, state, buffers, _ = step(params, state, buffers, x, y)
    assert_trees_close((params, state, buffers), (want_p, want_s, want_b))
    assert counted.calls - before == 1
    assert int(model.block.bn2.num_batches_tracked) == 4  # donated into the module


def test_eager_step_refuses_a_buffer_write_after_the_first_call():
    """A model switched to train mode after the first steps: the autograd path finds
    the running-statistics write by the buffers' version counters, as torch.func did
    on the first call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).double().eval()
    tx = fg.adam(lr=1e-2)

    def loss(p, x):
        return fg.call(model, p, x).square().mean()

    step = fg.make_step(loss, tx, donate=True)
    params = fg.params(model)
    state = tx.init(params)
    x = torch.randn(5, 3, dtype=torch.float64)
    for _ in range(3):
        step(params, state, x)
    model.train()
    with pytest.raises(RuntimeError, match=r"fg\.call: .*buffers=True"):
        step(params, state, x)
    assert int(state.count) == 3  # the refused step changed neither params nor state
    with pytest.raises(RuntimeError, match=r"fg\.call: .*buffers=True"):
        fg.make_step(loss, tx)(params, state, x)  # the first call (torch.func) says the same


def test_eager_step_under_no_grad_with_an_unused_parameter(counted):
    """torch.func.grad ignores an outer no_grad and gives zeros to unused parameters;
    so does the autograd path."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(3, 1), "unused": nn.Linear(3, 1)}).double()
    tx = fg.adam(lr=1e-2)

    def loss(p, x):
        return fg.call(
            model["used"], {k[5:]: v for k, v in p.items() if k.startswith("used.")}, x
        ).sum()

    x = torch.randn(4, 3, dtype=torch.float64)
    p0 = fg.params(model)
    want_p, want_s, _, _ = reference(loss, tx, dict(p0), tx.init(p0), [(x,)] * 3)
    step = fg.make_step(loss, tx)
    params, state = dict(p0), tx.init(p0)
    with torch.no_grad():
        for _ in range(3):
            params, state, _ = step(params, state, x)
    assert_trees_close((params, state), (want_p, want_s))
    assert torch.equal(state.mu["unused.weight"], torch.zeros(1, 3, dtype=torch.float64))


def test_eager_step_with_a_loss_that_ignores_the_parameters(counted):
    """No autograd graph at all: zero gradients, as torch.func.grad gives."""
    params = {"w": torch.ones(2, dtype=torch.float64)}
    tx = fg.adam(lr=0.1)
    step = fg.make_step(lambda p, x: x.sum(), tx)
    state = tx.init(params)
    for _ in range(3):
        params, state, loss = step(params, state, torch.ones(3, dtype=torch.float64))
    assert torch.equal(params["w"], torch.ones(2, dtype=torch.float64)) and float(loss) == 3.0
    assert int(state.count) == 3 and counted.calls == 1


def test_eager_donated_step_with_borrowed_buffers_equals_the_reference(monkeypatch):
    """Large CPU parameters: the donated eager step's Adam writes into buffers kept
    from the previous step (funcgrad/core/_scratch.py). Against the torch.func loop, bit
    for bit, over steps that include a skipped NaN batch, a forward that raises and a
    transformation that raises after Adam wrote its borrowed buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 3))
    model = model.double()
    assert model[2].weight.numel() >= fg_scratch.BIG > model[0].weight.numel()
    fail = {"now": False}

    def after_adam(updates, params):
        if fail["now"]:
            raise ValueError("boom after Adam")
        return updates

    def make(check):
        return fg.skip_if_nonfinite(
            fg.chain(
                fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)),
                fg.adamw(lr=1e-2, weight_decay=0.1, amsgrad=True, mask=lambda n, p: p.ndim > 1),
                fg.stateless(check),
            )
        )

    def loss(p, x):
        return fg.call(model, p, x).square().mean()

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 8, generator=g, dtype=torch.float64),) for _ in range(6)]
    data[2] = (torch.full((5, 8), float("nan"), dtype=torch.float64),)
    p0 = {k: v.clone() for k, v in fg.params(model).items()}
    ref_tx = make(lambda u, p: u)
    want_p, want_s, _, _ = reference(loss, ref_tx, p0, ref_tx.init(p0), data)

    taken = []
    empty = fg_scratch.Scratch.empty
    monkeypatch.setattr(fg_scratch.Scratch, "empty", lambda *a: taken.append(1) or empty(*a))
    tx = make(after_adam)
    step = fg.make_step(loss, tx, donate=True)
    params = fg.params(model)
    state = tx.init(params)
    for i, batch in enumerate(data):
        if i == 3:
            with pytest.raises(RuntimeError, match="cannot be multiplied"):
                step(params, state, torch.ones(5, 9, dtype=torch.float64))
            fail["now"] = True
            with pytest.raises(ValueError, match="boom after Adam"):
                step(params, state, *batch)
            fail["now"] = False
        step(params, state, *batch)
    assert_trees_close((params, state), (want_p, want_s))
    assert int(state.skipped) == 1
    assert len(taken) >= 7 * 5  # 7 calls reach Adam; 5 buffers each (AdamW, amsgrad)


def test_per_sample_rules_in_a_donated_eager_step_with_a_large_layer():
    """The donated eager step (which lends buffers to large tensors' updates) with a
    per-sample rule, run under vmap where out= buffers do not apply, equals the
    undonated step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 200), nn.ReLU(), nn.Linear(200, 200)).double()
    rule = fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model))
    tx = fg.adam(lr=1e-2)

    def loss(p, x):
        return fg.call(model, p, x).square().mean()

    x = torch.randn(6, 4, dtype=torch.float64)
    donated = fg.make_step(loss, tx, per_sample=rule, donate=True)
    plain = fg.make_step(loss, tx, per_sample=rule)
    p = {k: v.clone() for k, v in fg.params(model).items()}
    q = {k: v.clone() for k, v in p.items()}
    s, t = tx.init(p), tx.init(q)
    for _ in range(3):
        donated(p, s, x)
        q, t, _ = plain(q, t, x)
    assert_trees_close((p, s), (q, t))
