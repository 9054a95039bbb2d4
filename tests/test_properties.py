"""Property tests: random group layouts, shapes, dtypes and zero patterns."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from references import ref_zero_fix

import funcgrad as fg
from funcgrad import rules

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def groups_of_grads(draw):
    """A dict of 1-4 gradients with random shapes, one dtype, and a zero pattern:
    none, some, or all entries exactly zero (including -0.0)."""
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 4))
    shapes = [tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))) for _ in range(n)]
    zero_p = draw(st.sampled_from([0.0, 0.3, 0.9, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, shape in enumerate(shapes):
        t = torch.randn(shape, generator=g, dtype=torch.float64)
        mask = torch.rand(shape, generator=g) < zero_p
        t = torch.where(mask, torch.where(torch.rand(shape, generator=g) < 0.5, 0.0, -0.0), t)
        out[f"layer.p{i}"] = t.to(dtype)
    return out


RULES = [
    rules.zero_fix(),
    rules.zero_fix(if_all_zero=-2.0, if_zero=0.25),
    rules.fill(3.0),
    rules.replace_zeros(0.5),
    rules.replace_nonfinite(1.0),
    rules.scale(0.5),
    rules.clip_norm(0.1),
    rules.when(rules.zero_fraction_above(0.5), rules.fill(0.0), rules.scale(2.0)),
]


@SETTINGS
@given(groups_of_grads())
def test_rules_keep_keys_shapes_dtypes(group):
    for rule in RULES:
        out = rule(group)
        assert list(out) == list(group)
        for k, t in group.items():
            assert out[k].shape == t.shape and out[k].dtype == t.dtype, (rule, k)


@SETTINGS
@given(groups_of_grads())
def test_zero_fix_leaves_no_zeros_and_fills_dead_groups(group):
    out = rules.zero_fix()(group)
    assert not any((t == 0).any() for t in out.values())
    if all((t == 0).all() for t in group.values()):
        assert all((t == 1).all() for t in out.values())
    for k, t in group.items():  # non-zero entries are untouched
        nz = t != 0
        assert torch.equal(out[k][nz], t[nz])
    ref = ref_zero_fix(group)
    for k in group:
        assert torch.equal(out[k], ref[k])


@SETTINGS
@given(groups_of_grads(), st.sampled_from(["all_zero", "any_zero", "frac", "norm"]))
def test_when_equals_eager_if_else(group, which):
    cond = {
        "all_zero": rules.all_zero(),
        "any_zero": rules.any_zero(),
        "frac": rules.zero_fraction_above(0.4),
        "norm": rules.norm_above(1.5),
    }[which]
    then, other = rules.fill(7.0), rules.replace_zeros(-1.0)
    want = then(group) if bool(cond(group)) else other(group)
    got = rules.when(cond, then, otherwise=other)(group)
    for k in group:
        assert torch.equal(got[k], want[k])


@SETTINGS
@given(st.lists(groups_of_grads(), min_size=1, max_size=3), st.integers(0, 2))
def test_per_group_equals_loop_over_random_layouts(layers, n_ungrouped):
    grads, groups = {}, {}
    for li, layer in enumerate(layers):
        names = []
        for k, t in layer.items():
            name = f"m{li}.{k}"
            grads[name] = t
            names.append(name)
        groups[f"m{li}"] = names
    for j in range(n_ungrouped):  # parameters in no group must pass through
        grads[f"free{j}"] = torch.zeros(2)
    tx = fg.per_group(rules.zero_fix(), groups)
    out, _ = tx.update(grads, tx.init(grads))
    for names in groups.values():
        ref = ref_zero_fix({n: grads[n] for n in names})
        for n in names:
            assert torch.equal(out[n], ref[n])
    for j in range(n_ungrouped):
        assert out[f"free{j}"] is grads[f"free{j}"]
