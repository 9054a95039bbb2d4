"""The zero tests' relative tolerance (``rtol=``: ``|g| <= atol + rtol * rms``, ``rms``
the group's root-mean-square gradient; docs/exact-zeros.md): its decisions against a
per-group loop written here, invariant to the loss's scale, the same in float32 and
float64 on torch's own attention and convolution + BatchNorm modules (whose
gradients are mathematically zero in places), an overflow never turning entries
into zeros, sharded equal to one process (tests/test_shard.py runs
``zero_fix(rtol=1e-5)``), compiled in one graph."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from references import check_compiles
from torch import nn

import funcgrad as fg
from funcgrad import rules

D = torch.float64


def by_hand_zeros(group, atol, rtol):
    """Which entries count as zero, written out: the group's RMS over all its entries."""
    n = sum(t.numel() for t in group.values())
    rms = math.sqrt(sum(float((t.double() ** 2).sum()) for t in group.values()) / n)
    bound = atol + rtol * rms if math.isfinite(rms) else atol
    return {k: t.abs().double() <= bound for k, t in group.items()}


def test_decisions_equal_a_loop_and_every_zero_test_takes_rtol():
    g = torch.Generator().manual_seed(0)
    group = {
        "w": torch.randn(5, 4, generator=g, dtype=D) * torch.rand(5, 4, generator=g, dtype=D) ** 8,
        "b": torch.tensor([0.0, 1e-9, -3e-7, 2.0], dtype=D),
    }
    for atol, rtol in [(0.0, 1e-3), (1e-8, 1e-2), (0.0, 0.3)]:
        want = by_hand_zeros(group, atol, rtol)
        fixed = rules.zero_fix(atol=atol, rtol=rtol)(group)
        replaced = rules.replace_zeros(7.0, atol, rtol=rtol)(group)
        for k in group:
            assert torch.equal(fixed[k] == 0.5, want[k]), (atol, rtol, k)
            assert torch.equal(replaced[k] == 7.0, want[k])
        count = sum(int(m.sum()) for m in want.values())
        assert bool(rules.any_zero(atol, rtol=rtol)(group)) == (count > 0)
        assert bool(rules.all_zero(atol, rtol=rtol)(group)) == (count == 24)
        assert bool(rules.zero_fraction_above(0.25, atol, rtol=rtol)(group)) == (count > 6)
    assert "rtol=0.001" in repr(rules.zero_fix(rtol=1e-3))
    with pytest.raises(ValueError, match=re.escape("fg.rules.zero_fix: rtol must be >= 0")):
        rules.zero_fix(rtol=-1.0)


def test_the_same_entries_at_any_loss_scale():
    """Scaling the gradients by 2**30 or 2**-30 (exact in floating point) changes no
    decision under rtol; under atol it does."""
    g = torch.Generator().manual_seed(1)
    group = {
        "w": torch.randn(50, generator=g, dtype=D) * torch.rand(50, generator=g, dtype=D) ** 12
    }
    base = rules.zero_fix(rtol=1e-4)(group)["w"] == 0.5
    for s in (2.0**30, 2.0**-30):
        scaled = rules.zero_fix(rtol=1e-4)({"w": group["w"] * s})["w"] == 0.5
        assert torch.equal(scaled, base)
    assert not torch.equal(
        rules.zero_fix(atol=1e-6)({"w": group["w"] * 2.0**-30})["w"] == 0.5,
        rules.zero_fix(atol=1e-6)(group)["w"] == 0.5,
    )


def test_an_overflow_does_not_make_finite_entries_zero():
    group = {"w": torch.tensor([float("inf"), 1.0, 1e-3]), "b": torch.tensor([0.0])}
    out = rules.zero_fix(rtol=1e-2)(group)
    assert out["w"][1] == 1.0 and out["w"][2] == 1e-3 and out["b"][0] == 0.5


class ConvBN(nn.Module):
    """A convolution's bias right before a train-mode BatchNorm: its gradient is
    mathematically zero."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class Encoder(nn.Module):
    """torch's TransformerEncoderLayer: the key part of its in_proj_bias has a
    mathematically zero gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 50)

    def forward(self, ids):
        return self.head(self.layer(self.emb(ids)))


def _grads(kind, dtype, scale):
    torch.manual_seed(0)
    m = (ConvBN() if kind == "convbn" else Encoder().eval()).to(dtype)
    gen = torch.Generator().manual_seed(1)
    if kind == "convbn":
        x, y = (
            torch.randn(4, 3, 8, 8, generator=gen).to(dtype),
            torch.randint(0, 3, (4,), generator=gen),
        )
        b = fg.buffers(m)

        def loss(p):
            out = fg.call(m, p, x, buffers={k: v.clone() for k, v in b.items()})
            return nn.functional.cross_entropy(out, y) * scale

    else:
        ids = torch.randint(0, 50, (4, 12), generator=gen)

        def loss(p):
            out = fg.call(m, p, ids)
            return nn.functional.cross_entropy(out.reshape(-1, 50), ids.reshape(-1)) * scale

    p = {k: v.detach() for k, v in fg.params(m).items()}
    return torch.func.grad(loss)(p), fg.group_by_module(m)


@pytest.mark.parametrize("kind", ["encoder", "convbn"])
def test_float32_and_float64_decide_alike_at_every_loss_scale(kind):
    """zero_fix(rtol=1e-5): the same entries count as zero in float32 and float64, with
    the loss scaled by 1e-4, 1 and 1e4 (docs/exact-zeros.md measures the models)."""
    for scale in (1e-4, 1.0, 1e4):
        g64, groups = _grads(kind, D, scale)
        g32, _ = _grads(kind, torch.float32, scale)
        for names in groups.values():
            a = rules.zero_fix(rtol=1e-5)({k: g64[k] for k in names})
            b = rules.zero_fix(rtol=1e-5)({k: g32[k] for k in names})
            for k in names:
                assert torch.equal(a[k] == 0.5, b[k] == 0.5), (kind, scale, k)


def test_compiled_in_one_graph_equal_to_eager():
    model = copy.deepcopy(Encoder().eval()).double()
    groups = fg.group_by_module(model)
    tx = fg.chain(fg.per_group(rules.zero_fix(rtol=1e-5), groups), fg.adam(lr=1e-3))
    params = {k: v.detach().clone() for k, v in fg.params(model).items()}
    g, _ = _grads("encoder", D, 1.0)
    g2 = {k: 2 * v for k, v in g.items()}
    s0 = tx.init(params)
    _, s1 = tx.update(g, s0, params)
    check_compiles(tx.update, (g, s0, params), (g2, s1, params))  # one graph, equal
