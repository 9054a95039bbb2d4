"""Train-mode BatchNorm (and any buffer written in forward) in the functional step:
make_step(buffers=True) against eager torch training in train mode."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from test_rules import ref_zero_fix
from torch import nn
from torch._dynamo.utils import counters

import funcgrad as fg


class PeakTracker(nn.Module):
    """A module that is not BatchNorm but updates a registered buffer in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("peak", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.peak.copy_(torch.maximum(self.peak, x.detach().abs().amax()))
        return x


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c, momentum=None)  # cumulative moving average

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    def __init__(self, c: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1)
        self.block = Block(c)
        self.peak = PeakTracker()
        self.head = nn.Linear(c, classes)
        with torch.no_grad():
            self.head.bias.fill_(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.peak(self.block(self.stem(x))).mean((2, 3)))


def make_model(dtype=torch.float64) -> TinyResNet:
    torch.manual_seed(0)
    return TinyResNet().to(dtype)


def batches(n: int, dtype=torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(6, 1, 5, 5, generator=g, dtype=dtype), torch.randint(0, 3, (6,), generator=g))
        for _ in range(n)
    ]


def reference(model: TinyResNet, data) -> TinyResNet:
    """Eager torch in train mode: backward, the rule on each layer's .grad, Adam."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    groups = fg.group_by_module(model)
    named = dict(model.named_parameters())
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for names in groups.values():
            fixed = ref_zero_fix({n: named[n].grad for n in names})
            for n in names:
                named[n].grad = fixed[n]
        opt.step()
    return model


def funcgrad_run(model: TinyResNet, data, **kw):
    groups = fg.group_by_module(model)
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adam(lr=0.01))

    def loss_fn(p, b, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x, buffers=b), y)

    step = fg.make_step(loss_fn, tx, buffers=True, **kw)
    params, buffers = fg.params(model), fg.buffers(model)
    state = tx.init(params)
    for x, y in data:
        params, state, buffers, _ = step(params, state, buffers, x, y)
    return params, buffers


def assert_matches_reference(params, buffers, ref: TinyResNet, tol: float = 1e-9) -> None:
    for k, v in params.items():
        torch.testing.assert_close(v, ref.get_parameter(k).detach(), rtol=tol, atol=tol)
    for k, v in buffers.items():
        want = ref.get_buffer(k)
        assert v.dtype == want.dtype, k
        torch.testing.assert_close(v, want, rtol=tol, atol=tol)


def test_eager_step_with_buffers_equals_eager_torch_training():
    data = batches(4)
    ref = reference(make_model(), data)
    model = make_model()
    params, buffers = funcgrad_run(model, data)
    assert_matches_reference(params, buffers, ref)
    assert int(buffers["block.bn2.num_batches_tracked"]) == 4
    assert float(buffers["peak.peak"]) > 0
    # Not donated: the module's own buffers did not move.
    assert int(model.block.bn1.num_batches_tracked) == 0


def test_buffers_really_change_the_model_output():
    """The check above is not empty: running statistics after training differ from
    the initial ones, so eval-mode outputs differ too."""
    data = batches(4)
    model = make_model()
    before = copy.deepcopy(model).eval()(data[0][0])
    funcgrad_run(model, data, donate=True)
    after = model.eval()(data[0][0])
    assert not torch.allclose(before, after)


@pytest.fixture(scope="module")
def compiled_resnet_run():
    """One inductor-compiled donated run of 100 steps, shared by the tests below."""
    torch._dynamo.reset()
    counters.clear()
    data = batches(100)
    model = make_model()
    params, buffers = funcgrad_run(model, data, compile=True, donate=True)
    graphs = counters["stats"]["unique_graphs"]
    breaks = dict(counters["graph_break"])
    return model, params, buffers, data, graphs, breaks


def test_compiled_donated_step_with_buffers_equals_eager_torch(compiled_resnet_run):
    model, params, buffers, data, graphs, breaks = compiled_resnet_run
    assert graphs == 1 and not breaks  # one graph for 100 steps: 0 recompiles
    ref = reference(make_model(), data)
    assert_matches_reference(params, buffers, ref, tol=1e-9)
    # Donated: the module holds the trained params and running statistics ...
    for k, v in fg.buffers(model).items():
        assert v.data_ptr() == buffers[k].data_ptr(), k
    assert int(model.block.bn1.num_batches_tracked) == 100
    # ... so evaluation after training uses them, like a torch-trained model.
    x = data[0][0]
    torch.testing.assert_close(model.eval()(x), ref.eval()(x), rtol=1e-9, atol=1e-9)


def _without_buffers():
    """A train-mode ResNet, a loss that does not pass buffers, Adam, one input."""
    model = make_model()

    def loss_fn(p, x):
        return fg.call(model, p, x).sum()

    return loss_fn, fg.adam(), fg.params(model), batches(1)[0][0]


def test_step_without_buffers_explains_the_fix_eager_and_compiled():
    loss_fn, tx, params, x = _without_buffers()
    for compile in (
        False,
        {"backend": "aot_eager"},
        {"scope": "gradients", "backend": "aot_eager"},
    ):
        torch._dynamo.reset()
        step = fg.make_step(loss_fn, tx, compile=compile)
        with pytest.raises(
            RuntimeError, match=re.escape("build it with fg.make_step(..., buffers=True)")
        ):
            step(params, tx.init(params), x)


def test_per_sample_gradients_with_train_mode_batchnorm_are_refused():
    loss_fn, tx, params, x = _without_buffers()
    step = fg.make_step(loss_fn, tx, per_sample=fg.clip_by_global_norm(1.0))
    with pytest.raises(
        RuntimeError, match=re.escape("BatchNorm in train mode: batch statistics mix the samples")
    ):
        step(params, tx.init(params), x)


def test_buffers_step_errors():
    model = make_model()
    tx = fg.adam()

    def loss_fn(p, b, x):
        return fg.call(model, p, x, buffers=b).sum()

    params = fg.params(model)
    x = batches(1)[0][0]
    step = fg.make_step(loss_fn, tx, buffers=True)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "fg.make_step(buffers=True): the step is called as step(params, state, buffers, *batch)"
        ),
    ):
        step(params, tx.init(params), x)
    bad = dict(fg.buffers(model))
    bad["block.bn9.running_mean"] = bad.pop("block.bn1.running_mean")
    with pytest.raises(
        KeyError,
        match=re.escape(
            "fg.call: 'block.bn9.running_mean' is not a buffer of TinyResNet (did you mean 'block.bn2.running_mean'?)"
        ),
    ):
        step(params, tx.init(params), bad, x)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "loss_fn(p, b, x) cannot be called with params, buffers and 2 batch argument(s)"
        ),
    ):
        step(params, tx.init(params), fg.buffers(model), x, x)
