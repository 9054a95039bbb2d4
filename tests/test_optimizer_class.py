"""fg.Optimizer (#23): funcgrad inside a torch.optim loop, against fg.make_step and
torch.optim: the seed rule and monitor, LR schedulers, state dicts, GradScaler,
torch.compile(opt.step)."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from references import dead_seed_model, seed_loss
from torch import nn
from torch._dynamo.utils import counters

import funcgrad as fg

D = torch.float64


def seed_tx(model, lr=1e-2):
    groups = fg.group_by_module(model)
    return fg.named_chain(
        ("monitor", fg.monitor(groups)),
        ("rule", fg.per_group(fg.rules.zero_fix(), groups)),
        ("adam", fg.adamw(lr=lr, weight_decay=0.1)),
    )


def torch_loop(model, opt, x, steps, scheduler=None, scaler=None):
    for _ in range(steps):
        opt.zero_grad()
        loss = seed_loss(model)(dict(model.named_parameters()), x)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if scheduler is not None:
            scheduler.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("path", ["general", "fused"])
def test_equals_make_step_with_the_rule_and_monitor(path, monkeypatch):
    """The same as fg.make_step on the same data (both branches fire): bit for bit on
    the general path (the same kernel); on torch's fused AdamW kernel (the eager
    default, funcgrad/optim/_fused.py) to its rounding, and the rule and monitor bit
    for bit."""
    from funcgrad.optim import _fused

    if path == "general":
        monkeypatch.setattr(_fused, "plan", lambda *args: None)
    tol = {"rtol": 0, "atol": 0} if path == "general" else {"rtol": 1e-13, "atol": 1e-15}
    x = torch.rand(3, 1, dtype=D)
    a, b = dead_seed_model(), dead_seed_model()
    tx = seed_tx(a)
    params = fg.params(a)
    state = tx.init(params)
    step = fg.make_step(seed_loss(a), tx)
    for _ in range(10):
        params, state, _ = step(params, state, x)
    opt = fg.Optimizer(b, seed_tx(b))
    assert (opt._core.fused is not None) == (path == "fused")
    got = torch_loop(b, opt, x, 10)
    for k in params:
        torch.testing.assert_close(got[k], params[k], **tol)
    stats = opt.tx_state["monitor"].stats
    assert bool(stats["fc1"]["all_zero"]) and not bool(stats["fc2"]["all_zero"])
    for g, s in state["monitor"].stats.items():
        for k, v in s.items():
            torch.testing.assert_close(stats[g][k], v, rtol=0, atol=0)
    assert int(opt.tx_state["adam"].count) == 10


def test_named_parameters_and_the_per_tensor_layout():
    x = torch.rand(3, 1, dtype=D)
    a, b = dead_seed_model(), dead_seed_model()
    want = torch_loop(a, fg.Optimizer(a, seed_tx(a)), x, 5)
    got = torch_loop(b, fg.Optimizer(b.named_parameters(), seed_tx(b)), x, 5)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14)


def test_a_closure_runs_once_with_grad_enabled_and_its_loss_is_returned():
    """torch.optim.Adam's contract (PyTorch Lightning passes a closure): the same steps as
    backward() then step(), and the closure's loss comes back."""
    x = torch.rand(3, 1, dtype=D)
    a, b = dead_seed_model(), dead_seed_model()
    want = torch_loop(a, fg.Optimizer(a, seed_tx(a)), x, 4)
    opt = fg.Optimizer(b, seed_tx(b))
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = seed_loss(b)(dict(b.named_parameters()), x)
        loss.backward()
        return loss

    for _ in range(4):
        with torch.no_grad():  # as a framework may call it
            loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor) and loss.ndim == 0
    assert calls == [True] * 4
    for n, p in b.named_parameters():
        torch.testing.assert_close(p.detach(), want[n], rtol=0, atol=0)


SCHEDULERS = {
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=7),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.05, total_steps=12, cycle_momentum=False
    ),
    "linear+sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=4),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
        ],
        milestones=[4],
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_schedulers_equal_torch_adamw(name):
    x = torch.rand(4, 1, dtype=D)
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(1, 5), nn.Tanh(), nn.Linear(5, 1)).to(D)
    b = copy.deepcopy(a)
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.05)
    want = torch_loop(a, ref, x, 12, SCHEDULERS[name](ref))
    opt = fg.Optimizer(b, fg.adamw(lr=1e-2, weight_decay=0.05))
    got = torch_loop(b, opt, x, 12, SCHEDULERS[name](opt))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]


def test_a_scheduler_drives_every_optimizer_keeping_their_ratios():
    """Muon at 0.02 and AdamW at 3e-3 in one fg.Optimizer with LambdaLR: each equals its
    torch.optim twin under the same LambdaLR."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2))
    b = copy.deepcopy(a)
    x = torch.randn(8, 3)

    def loss(m):
        return m(x).pow(2).mean()

    muon = torch.optim.Muon([a[0].weight, a[2].weight], lr=0.02)
    adamw = torch.optim.AdamW([a[0].bias, a[2].bias], lr=3e-3)
    factor = lambda e: 1.0 / (1.0 + e)  # noqa: E731
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in (muon, adamw)]
    labels = {n: "muon" if p.ndim == 2 else "adamw" for n, p in b.named_parameters()}
    opt = fg.Optimizer(
        b, fg.partition({"muon": fg.muon(lr=0.02), "adamw": fg.adamw(lr=3e-3)}, labels)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    for _ in range(5):
        for o in (muon, adamw, opt):
            o.zero_grad()
        loss(a).backward()
        loss(b).backward()
        muon.step()
        adamw.step()
        opt.step()
        for s in (*scheds, sched):
            s.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=n)


def test_a_funcgrad_schedule_is_kept_and_the_group_shows_its_next_value():
    """lr has one meaning, the value of the next step: under a funcgrad schedule the
    group shows sched(steps taken); a value written into the group is used for the
    next step only, then the schedule goes on. Equal to make_step doing the same."""
    x = torch.rand(4, 1, dtype=D)
    a, b = dead_seed_model(), dead_seed_model()
    sched = fg.cosine_decay(1e-2, 10)
    tx = fg.adam(lr=sched)
    step = fg.make_step(seed_loss(a), tx)
    params = fg.params(a)
    state = tx.init(params)
    opt = fg.Optimizer(b, fg.adam(lr=sched))
    for i in range(6):
        want_lr = float(sched(torch.tensor(float(i), dtype=D)))
        assert opt.param_groups[0]["lr"] == pytest.approx(want_lr, rel=1e-15)
        assert fg.get_lr(state) == [pytest.approx(want_lr, rel=1e-15)]
        if i == 3:  # written for one step, in both worlds
            opt.param_groups[0]["lr"] = 0.5
            state = fg.set_lr(state, 0.5)
        params, state, _ = step(params, state, x)
        torch_loop(b, opt, x, 1)
    for k, p in b.named_parameters():
        torch.testing.assert_close(p.detach(), params[k], rtol=1e-12, atol=1e-14)
    assert opt.param_groups[0]["lr"] == pytest.approx(float(sched(torch.tensor(6.0, dtype=D))))


def test_state_dict_round_trip_resumes_bit_for_bit():
    x = torch.rand(3, 1, dtype=D)
    a, b = dead_seed_model(), dead_seed_model()
    opt_a = fg.Optimizer(a, seed_tx(a))
    sched_a = torch.optim.lr_scheduler.CosineAnnealingLR(opt_a, T_max=8)
    want = torch_loop(a, opt_a, x, 8, sched_a)
    opt_b = fg.Optimizer(b, seed_tx(b))
    sched_b = torch.optim.lr_scheduler.CosineAnnealingLR(opt_b, T_max=8)
    torch_loop(b, opt_b, x, 4, sched_b)
    buf = io.BytesIO()
    torch.save(
        {"model": b.state_dict(), "opt": opt_b.state_dict(), "sched": sched_b.state_dict()}, buf
    )
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    c = dead_seed_model()
    c.load_state_dict(saved["model"])
    opt_c = fg.Optimizer(c, seed_tx(c))
    opt_c.load_state_dict(saved["opt"])
    sched_c = torch.optim.lr_scheduler.CosineAnnealingLR(opt_c, T_max=8)
    sched_c.load_state_dict(saved["sched"])
    got = torch_loop(c, opt_c, x, 4, sched_c)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_load_state_dict_of_another_model_or_tx_changes_nothing():
    a = dead_seed_model()
    opt = fg.Optimizer(a, seed_tx(a))
    torch_loop(a, opt, torch.rand(3, 1, dtype=D), 2)
    before = fg.state_dict(opt.tx_state)
    other = nn.Linear(1, 1).to(D)
    wrong_model = fg.Optimizer(other, fg.adamw()).state_dict()
    with pytest.raises(
        ValueError,
        match=re.escape("fg.Optimizer.load_state_dict: the state dict was saved for parameters"),
    ):
        opt.load_state_dict(wrong_model)
    wrong_tx = fg.Optimizer(dead_seed_model(), fg.sgd(lr=0.1, momentum=0.9)).state_dict()
    with pytest.raises((ValueError, TypeError, KeyError), match=re.escape("fg.load_state_dict")):
        opt.load_state_dict(wrong_tx)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "fg.Optimizer.load_state_dict: this state dict was not made by fg.Optimizer.state_dict()"
        ),
    ):
        opt.load_state_dict(torch.optim.AdamW(a.parameters()).state_dict())
    after = fg.state_dict(opt.tx_state)
    assert str(after) == str(before)


def test_grad_scaler_unscales_before_the_rule_and_skips_nonfinite_steps():
    """With GradScaler("cpu") (scale 2**16) the rule acts in the loss's units: equal to
    the unscaled run. A step whose gradients overflow changes nothing."""
    x = torch.rand(3, 1)
    a, b = dead_seed_model(torch.float32), dead_seed_model(torch.float32)
    want = torch_loop(a, fg.Optimizer(a, seed_tx(a)), x, 5)
    opt = fg.Optimizer(b, seed_tx(b))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    got = torch_loop(b, opt, x, 5, scaler=scaler)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
    before_p = {n: p.detach().clone() for n, p in b.named_parameters()}
    before_s = str(fg.state_dict(opt.tx_state))
    opt.zero_grad()
    scaler.scale(seed_loss(b)(dict(b.named_parameters()), x) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    for n, p in b.named_parameters():
        assert torch.equal(p.detach(), before_p[n])
    assert str(fg.state_dict(opt.tx_state)) == before_s
    assert scaler.get_scale() < 2.0**16  # the scaler backed off


def test_compiled_step_with_a_scheduler_driving_a_tensor_lr_does_not_recompile():
    """PyTorch's compiled-optimizer recipe: torch.compile(opt.step) with a tensor lr that
    a scheduler edits in place; 100 steps, one graph, equal to the eager optimizer."""
    x = torch.rand(3, 1, dtype=D)
    a, b = dead_seed_model(), dead_seed_model()

    def tx_for(m):
        groups = fg.group_by_module(m)
        return fg.chain(
            fg.per_group(fg.rules.zero_fix(), groups), fg.adamw(lr=torch.tensor(1e-2, dtype=D))
        )

    eager = fg.Optimizer(a, tx_for(a))
    want = torch_loop(a, eager, x, 100, torch.optim.lr_scheduler.CosineAnnealingLR(eager, 50))
    opt = fg.Optimizer(b, tx_for(b))
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 50)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(opt.step, backend="aot_eager")
    for _ in range(100):
        opt.zero_grad()
        seed_loss(b)(dict(b.named_parameters()), x).backward()
        compiled()
        sched.step()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for n, p in b.named_parameters():
        torch.testing.assert_close(p.detach(), want[n], rtol=1e-12, atol=1e-14)


def _missing_grad():
    m = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    opt = fg.Optimizer(m, fg.adam())
    m[0](torch.ones(1, 1)).sum().backward()
    opt.step()


def _sparse_grad():
    m = nn.Embedding(3, 2, sparse=True)
    opt = fg.Optimizer(m, fg.adam())
    m(torch.tensor([0])).sum().backward()
    opt.step()


ERRORS = [
    (
        "fg.Optimizer.step: '1.weight' has no .grad (it took no part in the loss",
        ValueError,
        _missing_grad,
    ),
    ("fg.Optimizer.step: 'weight' has a sparse gradient", TypeError, _sparse_grad),
    (
        "fg.Optimizer: tx names parameters the optimizer does not know",
        KeyError,
        lambda: fg.Optimizer(
            dead_seed_model().parameters(),
            fg.chain(
                fg.per_group(fg.rules.zero_fix(), fg.group_by_module(dead_seed_model())),
                fg.adam(),
            ),
        ),
    ),
    (
        "fg.Optimizer: the model has no trainable parameters",
        ValueError,
        lambda: fg.Optimizer(nn.Linear(1, 1).requires_grad_(False), fg.adam()),
    ),
    (
        "fg.Optimizer: tx must be a GradientTransformation (e.g. fg.adamw()), got Rule.",
        TypeError,
        lambda: fg.Optimizer(nn.Linear(1, 1), fg.rules.zero_fix()),
    ),
]


@pytest.mark.parametrize(("fragment", "exc", "trigger"), ERRORS, ids=[e[0][:40] for e in ERRORS])
def test_errors(fragment, exc, trigger):
    with pytest.raises(exc, match=re.escape(fragment)):
        trigger()


OPTIMIZERS = {
    "sgd": lambda: fg.sgd(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
    "rmsprop": lambda: fg.rmsprop(lr=0.01, momentum=0.5, centered=True),
    "adagrad": lambda: fg.adagrad(lr=0.1, lr_decay=0.1),
    "adafactor": lambda: fg.adafactor(lr=0.05, weight_decay=0.1),
    "lion": lambda: fg.lion(lr=0.01, weight_decay=0.1),
    "muon+adamw": lambda: fg.partition(
        {"muon": fg.muon(lr=0.02), "adamw": fg.adamw(lr=0.01)},
        {
            f"fc{i}.{k}": "muon" if k == "weight" else "adamw"
            for i in (1, 2, 3)
            for k in ("weight", "bias")
        },
    ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_equals_make_step(name):
    """#24's optimizers behind the seed rule (both branches): fg.Optimizer equals
    fg.make_step (float64)."""
    x = torch.rand(3, 1, dtype=D)
    a, b = dead_seed_model(), dead_seed_model()

    def tx_for(m):
        inner = OPTIMIZERS[name]()
        return fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), inner)

    tx = tx_for(a)
    params = fg.params(a)
    state = tx.init(params)
    step = fg.make_step(seed_loss(a), tx)
    for _ in range(5):
        params, state, _ = step(params, state, x)
    got = torch_loop(b, fg.Optimizer(b, tx_for(b)), x, 5)
    for k in got:
        torch.testing.assert_close(got[k], params[k], rtol=1e-12, atol=1e-14)
