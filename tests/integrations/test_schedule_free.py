"""fg.schedule_free_adamw / fg.schedule_free_sgd against the reference package
(facebookresearch's ``schedulefree``, code nobody here wrote; in the ``integrations``
and ``bench`` extras): the training-mode parameters after every step and the
evaluation parameters (``opt.eval()``) at the end, then training on from them, in
float64 to 1e-12, with warmup, weight decay, ``r`` and ``weight_lr_power``; three ways
(the transformation in a functional loop with ``fg.schedule_free_eval``,
``fg.Optimizer(model, tx)`` with ``train()``/``eval()``, and param groups), the seed
rule in front. Run by ``make test-integrations``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import funcgrad as fg

schedulefree = pytest.importorskip("schedulefree")

D = torch.float64
TOL = dict(rtol=1e-12, atol=1e-14)
CONFIGS = {
    "default": {},
    "warmup": dict(warmup_steps=3),
    "weight_decay": dict(weight_decay=0.1),
    "r and power": dict(r=0.5, weight_lr_power=1.0, warmup_steps=2),
}
KINDS = {
    "adamw": (schedulefree.AdamWScheduleFree, fg.schedule_free_adamw, dict(lr=0.01)),
    "sgd": (schedulefree.SGDScheduleFree, fg.schedule_free_sgd, dict(lr=0.05, momentum=0.8)),
}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).to(D)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 3, generator=g, dtype=D), torch.randn(8, 2, generator=g, dtype=D)


def loss_of(m: nn.Module, i: int) -> torch.Tensor:
    x, y = batch(i)
    return ((m(x) - y) ** 2).mean()


def package_run(m: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[dict]:
    out = []
    for i in steps:
        opt.zero_grad()
        loss_of(m, i).backward()
        opt.step()
        out.append({k: p.detach().clone() for k, p in m.named_parameters()})
    return out


def check(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for k in w:
            torch.testing.assert_close(g[k], w[k], **TOL)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_drop_in_equals_the_package(kind, config):
    """fg.Optimizer(model, fg.schedule_free_*(...)) and the package's optimizer, each
    train() / 5 steps / eval() / train() / 3 steps / eval(): the parameters after every
    step and in eval mode, equal."""
    ref_cls, make, base = KINDS[kind]
    kw = {**base, **CONFIGS[config]}
    m_ref, m = model(), model()
    ref, opt = ref_cls(m_ref.parameters(), **kw), fg.Optimizer(m, make(**kw))
    for o in (ref, opt):
        o.train()
    check(package_run(m, opt, range(5)), package_run(m_ref, ref, range(5)))
    for o in (ref, opt):
        o.eval()
    check([dict(m.named_parameters())], [dict(m_ref.named_parameters())])
    for o in (ref, opt):
        o.train()
    check(package_run(m, opt, range(5, 8)), package_run(m_ref, ref, range(5, 8)))
    for o in (ref, opt):
        o.eval()
    check([dict(m.named_parameters())], [dict(m_ref.named_parameters())])


@pytest.mark.parametrize("kind", list(KINDS))
def test_functional_loop_and_eval_point_equal_the_package(kind):
    """fg.make_step with the seed rule in front (the same rule applied to .grad by hand
    before the package's step): y after every step, and fg.schedule_free_eval at the
    end equal to the package's eval-mode parameters."""
    ref_cls, make, base = KINDS[kind]
    kw = {**base, "warmup_steps": 2, "weight_decay": 0.05}
    m_ref, m = model(), model()
    groups = fg.group_by_module(m)
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), groups), make(**kw))
    step = fg.make_step(lambda p, i: loss_of_params(m, p, i), tx)
    ref = ref_cls(m_ref.parameters(), **kw)
    ref.train()
    params = {k: v.detach().clone() for k, v in fg.params(m).items()}
    state = tx.init(params)
    for i in range(6):
        params, state, _ = step(params, state, i)
        ref.zero_grad()
        loss_of(m_ref, i).backward()
        with torch.no_grad():
            by_hand = fg.chain(fg.per_group(fg.rules.zero_fix(), groups))
            grads = {k: p.grad for k, p in m_ref.named_parameters()}
            fixed, _ = by_hand.update(grads, by_hand.init(grads))
            for k, p in m_ref.named_parameters():
                p.grad.copy_(fixed[k])
        ref.step()
        check([params], [dict(m_ref.named_parameters())])
    ref.eval()
    check([fg.schedule_free_eval(params, state)], [dict(m_ref.named_parameters())])


def loss_of_params(m: nn.Module, p: dict, i: int) -> torch.Tensor:
    x, y = batch(i)
    return ((fg.call(m, p, x) - y) ** 2).mean()


def test_param_groups_equal_the_package():
    """Two param groups with their own lr and weight decay, as the package takes them."""
    m_ref, m = model(), model()

    def groups(net):
        return [
            {"params": [net[0].weight, net[2].weight], "weight_decay": 0.1},
            {"params": [net[0].bias, net[2].bias], "lr": 0.02, "warmup_steps": 2},
        ]

    ref = schedulefree.AdamWScheduleFree(groups(m_ref), lr=0.01)
    opt = fg.Optimizer(groups(m), fg.schedule_free_adamw(lr=0.01))
    for o in (ref, opt):
        o.train()
    check(package_run(m, opt, range(6)), package_run(m_ref, ref, range(6)))
    for o in (ref, opt):
        o.eval()
    check([dict(m.named_parameters())], [dict(m_ref.named_parameters())])


def test_a_state_dict_saved_in_eval_mode_resumes_as_the_package():
    """Saved in eval mode (as the package asks), loaded into a fresh optimizer and model:
    train() goes back to y and training goes on equal to an uninterrupted run."""
    m_ref, m = model(), model()
    ref = schedulefree.SGDScheduleFree(m_ref.parameters(), lr=0.05)
    opt = fg.Optimizer(m, fg.schedule_free_sgd(lr=0.05))
    for o in (ref, opt):
        o.train()
    package_run(m_ref, ref, range(4))
    package_run(m, opt, range(4))
    opt.eval()
    saved_model, saved_opt = copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict())
    m2 = model()
    m2.load_state_dict(saved_model)
    opt2 = fg.Optimizer(m2, fg.schedule_free_sgd(lr=0.05))
    opt2.load_state_dict(saved_opt)
    opt2.train()
    check(package_run(m2, opt2, range(4, 7)), package_run(m_ref, ref, range(4, 7)))
