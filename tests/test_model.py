"""Model <-> dict helpers against the module's own autograd."""

from __future__ import annotations

import re

import pytest
import torch
from references import SeedModel, seed_loss
from torch import nn

import funcgrad as fg


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh())
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx):
        return self.head(self.body(self.emb(idx)))


def test_params_share_storage_and_skip_frozen():
    model = SeedModel()
    model.fc2.bias.requires_grad_(False)
    p = fg.params(model)
    assert list(p) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc3.weight", "fc3.bias"]
    for name, t in p.items():
        assert not t.requires_grad
        assert t.data_ptr() == model.get_parameter(name).data_ptr()


def test_tied_parameters_appear_once_and_follow_the_name():
    model = Tied()
    p = fg.params(model)
    assert "emb.weight" in p and "head.weight" not in p
    idx = torch.tensor([1, 2, 3])
    model.eval()
    new = {k: v + 1.0 for k, v in p.items()}
    out = fg.call(model, new, idx)
    ref = Tied()
    ref.load_state_dict(model.state_dict())
    ref.eval()
    with torch.no_grad():
        ref.emb.weight.add_(1.0)  # also moves head.weight: they are one tensor
        for n, t in ref.named_parameters():
            if n != "emb.weight":
                t.add_(1.0)
    torch.testing.assert_close(out, ref(idx))


@pytest.mark.parametrize("model_fn", [SeedModel, Tied])
def test_func_grad_over_call_equals_backward(model_fn):
    torch.manual_seed(0)
    model = model_fn().double()
    if model_fn is SeedModel:
        x = torch.rand(3, 1, dtype=torch.float64)
        loss_fn = seed_loss(model)
    else:
        x = torch.tensor([0, 3, 5, 6])

        def loss_fn(p, idx):
            return fg.call(model, p, idx).logsumexp(-1).mean()

    model.eval()  # train-mode BatchNorm cannot run under torch.func.grad (see below)
    grads = torch.func.grad(loss_fn)(fg.params(model), x)
    model.zero_grad()
    loss_fn(dict(model.named_parameters()), x).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-14)


def test_buffers_pass_through_and_update_in_train_mode():
    model = Tied()
    buf = fg.buffers(model)
    assert set(buf) == {"body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked"}
    before = buf["body.1.running_mean"].clone()
    fg.call(model, fg.params(model), torch.tensor([1, 2, 3]))
    assert int(model.body[1].num_batches_tracked) == 1
    assert not torch.equal(before, model.body[1].running_mean)
    # Explicit buffers replace the module's own.
    model.eval()
    other = {k: v.clone() for k, v in buf.items()}
    other["body.1.running_mean"].fill_(100.0)
    a = fg.call(model, fg.params(model), torch.tensor([1]))
    b = fg.call(model, fg.params(model), torch.tensor([1]), buffers=other)
    assert not torch.allclose(a, b)


def test_load_params_roundtrip_and_errors():
    model = SeedModel()
    new = {k: torch.randn_like(v) for k, v in fg.params(model).items()}
    fg.load_params(model, new)
    for k, v in new.items():
        assert torch.equal(model.get_parameter(k), v)
    with pytest.raises(
        KeyError,
        match=re.escape(
            "'fc1.wieght' is not a parameter of SeedModel (did you mean 'fc1.weight'?)"
        ),
    ):
        fg.load_params(model, {**new, "fc1.wieght": torch.ones(1)})
    partial = dict(new)
    del partial["fc3.bias"]
    with pytest.raises(KeyError, match=re.escape("trainable parameters ['fc3.bias'] are missing")):
        fg.load_params(model, partial)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "shape mismatch for 'fc1.weight': the model has (2, 1), the given tensor has (1, 2)"
        ),
    ):
        fg.load_params(model, {**new, "fc1.weight": torch.ones(1, 2)})
    with pytest.raises(
        TypeError,
        match=re.escape(
            "dtype mismatch for 'fc1.bias': the model has torch.float32, the given tensor has torch.float64"
        ),
    ):
        fg.load_params(model, {**new, "fc1.bias": torch.ones(2, dtype=torch.float64)})


def test_call_rejects_unknown_and_missing_names():
    model = SeedModel()
    p = fg.params(model)
    with pytest.raises(
        KeyError, match=re.escape("fg.call: 'fc4.weight' is not a parameter of SeedModel")
    ):
        fg.call(model, {**p, "fc4.weight": torch.ones(1)}, torch.rand(3, 1))
    with pytest.raises(
        KeyError, match=re.escape("fg.call: trainable parameters ['fc1.bias'] are missing")
    ):
        fg.call(model, {k: v for k, v in p.items() if k != "fc1.bias"}, torch.rand(3, 1))


def test_complex_params_are_rejected():
    with pytest.warns(UserWarning, match="Complex modules"):
        model = nn.Linear(2, 2).to(torch.complex64)
    with pytest.raises(TypeError, match=re.escape("'weight' has dtype torch.complex64")):
        fg.params(model)


def test_train_mode_batchnorm_under_grad_explains_itself():
    model = Tied()

    def loss_fn(p, idx):
        return fg.call(model, p, idx).sum()

    with pytest.raises(RuntimeError, match=re.escape("That is what BatchNorm does in train mode")):
        torch.func.grad(loss_fn)(fg.params(model), torch.tensor([1, 2, 3]))
    torch.func.replace_all_batch_norm_modules_(model)
    torch.func.grad(loss_fn)(fg.params(model), torch.tensor([1, 2, 3]))  # now fine


def _dropout_masks(use_sdpa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs of attention + nn.Dropout, eager and under torch.func.grad over
    functional_call, each after torch.manual_seed(0)."""
    e = 8

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(e, 2, dropout=0.3, batch_first=True)
            self.q = nn.Linear(e, e)
            self.drop = nn.Dropout(0.3)

        def forward(self, x):
            if use_sdpa:
                q = self.q(x)
                a = nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
            else:
                a = self.mha(x, x, x)[0]
            return self.drop(a)

    torch.manual_seed(1)
    m = Attn().double()
    x = torch.randn(2, 5, e, dtype=torch.float64)
    torch.manual_seed(0)
    eager = m(x).detach()
    torch.manual_seed(0)
    _, functional = torch.func.grad(
        lambda p, x: (lambda o: (o.sum(), o.detach()))(fg.call(m, p, x)), has_aux=True
    )(fg.params(m), x)
    return eager, functional


def test_multihead_attention_dropout_draws_other_masks_under_torch_func():
    """Pinned torch behaviour (2.13, reproduced without funcgrad): under torch.func.grad,
    nn.MultiheadAttention with dropout consumes the RNG differently, so the nn.Dropout
    after it draws other masks than eager torch with the same seed;
    F.scaled_dot_product_attention does not. docs/exact-zeros.md explains it. If
    this test fails, torch changed: update that page."""
    eager, functional = _dropout_masks(use_sdpa=False)
    assert not torch.equal(eager == 0, functional == 0)
    eager, functional = _dropout_masks(use_sdpa=True)
    assert torch.equal(eager, functional)
