"""The learning rate is state, not a hidden cell of ``tx`` (issue "Correct everywhere",
point 2): one ``tx`` shared by two ``fg.Optimizer`` s, by an ``fg.Optimizer`` and an
``fg.make_step``, and through every wrapper (``sharded``, ``chain``, ``named_chain``,
``partition``, ``accumulate``, ``skip_if_nonfinite``); each user against torch.optim
run on its own. Checkpoints: old files (no ``lr``) load; a saved lr is restored, and a
mismatch with tx's is reported."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from torch import nn

import funcgrad as fg

D = torch.float64


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(D)


X = torch.randn(8, 3, generator=torch.Generator().manual_seed(1), dtype=D)


def loss_of(model: nn.Module) -> torch.Tensor:
    return model(X).pow(2).mean()


def run(model, opt, steps, sched=None):
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def torch_adam(model, steps, sched=None):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return run(model, opt, steps, None if sched is None else sched(opt))


def close(got, want):
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14, msg=k)


WRAPPERS = {
    "plain": lambda tx: tx,
    "chain": lambda tx: fg.chain(fg.clip_by_global_norm(1e6), tx),
    "named_chain": lambda tx: fg.named_chain(("adam", tx)),
    "partition": lambda tx: fg.partition({"a": tx}, lambda params: dict.fromkeys(params, "a")),
    "accumulate": lambda tx: fg.accumulate(tx, 1),
    "skip_if_nonfinite": lambda tx: fg.skip_if_nonfinite(tx),
}


@pytest.mark.parametrize("wrap", list(WRAPPERS))
def test_one_tx_serves_two_optimizers_each_with_its_own_scheduler(wrap):
    """Today's bug: the second fg.Optimizer re-pointed the tx's lr cell, and the first
    (or the second) trained nothing. Each equals torch.optim.Adam with its scheduler."""
    tx = WRAPPERS[wrap](fg.adam(lr=1e-2))
    a, b = net(0), net(1)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    opt_a, opt_b = fg.Optimizer(a, tx), fg.Optimizer(b, tx)
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"] == 1e-2
    sched_a = torch.optim.lr_scheduler.LinearLR(opt_a, start_factor=0.5, total_iters=4)
    sched_b = torch.optim.lr_scheduler.ExponentialLR(opt_b, gamma=0.7)
    for _ in range(5):  # interleaved: each step of one between steps of the other
        for model, opt, sched in ((a, opt_a, sched_a), (b, opt_b, sched_b)):
            opt.zero_grad()
            loss_of(model).backward()
            opt.step()
            sched.step()
    want_a = torch_adam(
        ref_a, 5, lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=4)
    )
    want_b = torch_adam(ref_b, 5, lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7))
    close(dict(a.named_parameters()), want_a)
    close(dict(b.named_parameters()), want_b)
    # and tx itself is unchanged: a fresh state still starts at its own lr
    assert fg.get_lr(tx.init(fg.params(net(2)))) == [1e-2]


def test_make_step_from_a_tx_an_optimizer_took_trains_at_its_lr():
    """Today's bug: lr 0.0 until the optimizer steps. Equal to torch.optim.Adam."""
    tx = fg.adam(lr=1e-2)
    fg.Optimizer(net(0), tx)  # takes tx, never steps
    model = net(1)
    ref = copy.deepcopy(model)
    params = fg.params(model)
    state = tx.init(params)
    step = fg.make_step(lambda p: fg.call(model, p, X).pow(2).mean(), tx)
    for _ in range(5):
        params, state, _ = step(params, state)
    close(dict(params), torch_adam(ref, 5))


def test_sharded_optimizer_shows_and_follows_its_lr(one_rank):
    """Today's bug: fg.sharded hid the lr: param_groups showed 0.0 and LinearLR was
    ignored. Equal to torch.optim.Adam with the same scheduler."""
    model = net(0)
    ref = copy.deepcopy(model)
    opt = fg.Optimizer(model, fg.sharded(fg.adam(lr=1e-2)))
    assert opt.param_groups[0]["lr"] == 1e-2
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3)
    got = run(model, opt, 5, sched)
    close(
        got, torch_adam(ref, 5, lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.25, total_iters=3))
    )


def test_partition_keeps_each_optimizers_ratio_to_the_group_lr():
    """Two optimizers at 1e-2 and 3e-3 under one scheduler, two fg.Optimizers sharing
    the tx: each equals torch.optim's two-optimizer run under the same LambdaLR."""
    labels = lambda ps: {n: "w" if p.ndim == 2 else "b" for n, p in ps.items()}  # noqa: E731
    tx = fg.partition({"w": fg.adam(lr=1e-2), "b": fg.sgd(lr=3e-3, momentum=0.9)}, labels)
    factor = lambda e: 1.0 / (1.0 + e)  # noqa: E731
    results = []
    for seed in (0, 1):
        model = net(seed)
        ref = copy.deepcopy(model)
        opt = fg.Optimizer(model, tx)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        w = [p for p in ref.parameters() if p.ndim == 2]
        b = [p for p in ref.parameters() if p.ndim != 2]
        ta, ts = torch.optim.Adam(w, lr=1e-2), torch.optim.SGD(b, lr=3e-3, momentum=0.9)
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in (ta, ts)]
        results.append((model, opt, sched, ref, (ta, ts), scheds))
    for _ in range(5):
        for model, opt, sched, ref, torch_opts, scheds in results:
            opt.zero_grad()
            loss_of(model).backward()
            opt.step()
            sched.step()
            for o in torch_opts:
                o.zero_grad()
            loss_of(ref).backward()
            for o in (*torch_opts, *scheds):
                o.step()
    for model, _, _, ref, _, _ in results:
        close(dict(model.named_parameters()), dict(ref.named_parameters()))


def test_set_lr_and_get_lr():
    """get_lr reads the value the next step uses (a schedule's value too, never a
    factor); set_lr writes it; a schedule goes on from the step after."""
    tx = fg.partition(
        {"w": fg.adam(lr=1e-2), "b": fg.sgd(lr=lambda c: 0.1 / (1 + c))}, {"w": "w", "b": "b"}
    )
    params = {"w": torch.zeros(2, dtype=D), "b": torch.zeros(1, dtype=D)}
    state = tx.init(params)
    assert fg.get_lr(state) == [1e-2, 0.1]
    new = fg.set_lr(state, [1e-3, 0.5])
    assert fg.get_lr(new) == [1e-3, 0.5] and fg.get_lr(state) == [1e-2, 0.1]
    grads = {"w": torch.ones(2, dtype=D), "b": torch.ones(1, dtype=D)}
    updates, after = tx.update(grads, new, params)
    torch.testing.assert_close(updates["w"], torch.full((2,), -1e-3, dtype=D))
    torch.testing.assert_close(updates["b"], torch.full((1,), -0.5, dtype=D))
    assert fg.get_lr(after) == [1e-3, 0.05]  # the schedule's value for the second step
    with pytest.raises(
        ValueError,
        match=re.escape("fg.set_lr: the state holds 2 optimizer states, got 1 learning rates"),
    ):
        fg.set_lr(state, [1e-3])
    with pytest.raises(ValueError, match=re.escape("Invalid learning rate: -1.0")):
        fg.set_lr(state, -1.0)


def test_a_checkpoint_restores_its_lr_and_reports_a_mismatch(tmp_path):
    model = net(0)
    params = fg.params(model)
    tx = fg.chain(fg.clip_by_global_norm(1.0), fg.adam(lr=1e-2))
    state = fg.set_lr(tx.init(params), 5e-3)
    fg.save_checkpoint(tmp_path / "a.ckpt", params, state)
    with pytest.warns(
        UserWarning,
        match=re.escape(
            "hyperparameter at state.inner_states[1].hyperparams['lr'] is 0.005, tx's is 0.01"
        ),
    ):
        _, loaded, _ = fg.load_checkpoint(tmp_path / "a.ckpt", params, tx)
    assert fg.get_lr(loaded) == [5e-3]
    # the same lr: silent
    fg.save_checkpoint(tmp_path / "b.ckpt", params, tx.init(params))
    _, loaded, _ = fg.load_checkpoint(tmp_path / "b.ckpt", params, tx)
    assert fg.get_lr(loaded) == [1e-2]


@pytest.mark.parametrize("saved_lr", [None, 5e-3])
def test_a_state_dict_from_before_hyperparameters_were_state_loads(saved_lr):
    """A state saved before every hyperparameter was state (no "hyperparams"; with an
    "lr" entry from when the learning rate alone was state, or none from before that)
    loads: the other hyperparameters are tx's, a saved float lr is restored."""
    params = {"w": torch.zeros(2, dtype=D)}
    tx = fg.adam(lr=1e-2, betas=(0.8, 0.9))
    _, state = tx.update({"w": torch.ones(2, dtype=D)}, tx.init(params), params)
    sd = fg.state_dict(state)
    del sd["hyperparams"]
    if saved_lr is None:
        loaded = fg.load_state_dict(tx, params, sd)
    else:
        sd["lr"] = torch.tensor(saved_lr, dtype=D)
        with pytest.warns(UserWarning, match=re.escape("hyperparams['lr'] is 0.005, tx's is 0.01")):
            loaded = fg.load_state_dict(tx, params, sd)
    assert int(loaded.count) == 1
    assert fg.get_hyperparams(loaded) == [
        {"lr": saved_lr or 1e-2, "betas": (0.8, 0.9), "eps": 1e-8}
    ]
    torch.testing.assert_close(loaded.mu["w"], state.mu["w"], rtol=0, atol=0)


def test_optimizer_state_dict_round_trip_keeps_the_scheduled_lr():
    """fg.Optimizer restores its group's lr (torch's part) and its state's lr, with no
    warning (its group writes the state's lr at every step)."""
    a = net(0)
    opt = fg.Optimizer(a, fg.adam(lr=1e-2))
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    run(a, opt, 3, sched)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "m": a.state_dict()}, buf)
    want = run(a, opt, 2, sched)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b = net(1)
    b.load_state_dict(saved["m"])
    opt_b = fg.Optimizer(b, fg.adam(lr=1e-2))
    opt_b.load_state_dict(saved["opt"])  # no warning (warnings from funcgrad fail tests)
    sched_b = torch.optim.lr_scheduler.ExponentialLR(opt_b, gamma=0.5)
    sched_b.load_state_dict(saved["sched"])
    got = run(b, opt_b, 2, sched_b)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_set_lr_between_compiled_steps_recompiles_nothing_and_equals_eager():
    """The lr is a graph input: changing it (fg.set_lr, a schedule of your own written
    into the state) does not recompile, and the steps equal the eager ones."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    runs = []
    for compile in (False, {"backend": counter}):
        model = net(0)
        tx = fg.chain(
            fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)), fg.adamw(lr=1e-2)
        )
        step = fg.make_step(
            lambda p, model=model: fg.call(model, p, X).pow(2).mean(), tx, compile=compile
        )
        params = fg.params(model)
        state = tx.init(params)
        for i in range(6):
            state = fg.set_lr(state, 1e-2 / (1 + i))
            params, state, _ = step(params, state)
        runs.append(dict(params))
    assert counter.frame_count == 1
    for k in runs[0]:
        torch.testing.assert_close(runs[1][k], runs[0][k], rtol=0, atol=0)
