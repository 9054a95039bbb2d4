"""Rules against plain eager references written with Python if/else."""

from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch
from references import check_compiles, ref_zero_fix

from funcgrad import rules

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def make_group(kind: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 4, generator=g).to(dtype)
    b = torch.randn(4, generator=g).to(dtype)
    if kind == "all_zero":
        w, b = torch.zeros_like(w), -torch.zeros_like(b)  # -0.0 counts as zero
    elif kind == "some_zero":
        w[0, 1] = 0.0
        w[2, 3] = -0.0
        b[1] = 0.0
    elif kind == "one_nonzero":
        w, b = torch.zeros_like(w), torch.zeros_like(b)
        b[3] = 1e-3
    elif kind == "nonfinite":
        w[1, 1] = float("nan")
        b[0] = float("inf")
    return {"fc.weight": w, "fc.bias": b}


KINDS = ["all_zero", "some_zero", "one_nonzero", "none_zero", "nonfinite"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_zero_fix_matches_eager_reference(kind, dtype):
    group = make_group(kind, dtype)
    got = rules.zero_fix()(group)
    want = ref_zero_fix(group)
    for k in group:
        assert got[k].dtype == dtype and got[k].shape == group[k].shape
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, equal_nan=True)
        assert not (got[k] == 0).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_fix_eager_equals_the_traceable_rule(dtype):
    """The host-read form fg.Optimizer's eager step uses (funcgrad/rules/_eager.py) on
    every kind of group at once, with an empty tensor, a transposed one and custom
    values: the traceable rule's values and the reference's, bit for bit; a gradient
    with no zero comes back as the same tensor (no copy), the inputs are not written."""
    fix = rules.zero_fix(if_all_zero=2.0, if_zero=-0.1)
    groups = [make_group(kind, dtype) for kind in KINDS]
    groups[1]["fc.weight"] = groups[1]["fc.weight"].t()  # not contiguous
    groups[3]["empty"] = torch.zeros(0, 3, dtype=dtype)  # a group with no zero
    groups[0]["empty"] = torch.zeros(0, dtype=dtype)  # an all-zero group
    groups.append({"only": torch.zeros(0, dtype=dtype)})
    before = [{k: t.clone() for k, t in g.items()} for g in groups]
    got = fix._eager(groups)
    assert got is not None and len(got) == len(groups)
    for g, b, e in zip(groups, before, got, strict=True):
        want, ref = fix(b), ref_zero_fix(b, 2.0, -0.1)
        assert e.keys() == g.keys()
        for k in g:
            assert e[k].dtype == dtype and e[k].shape == g[k].shape
            torch.testing.assert_close(e[k], want[k], rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(e[k], ref[k], rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(g[k], b[k], rtol=0, atol=0, equal_nan=True)
    assert got[3]["fc.weight"] is groups[3]["fc.weight"]  # none_zero: passed through
    assert got[1]["fc.weight"] is not groups[1]["fc.weight"]


def test_zero_fix_eager_form_only_where_it_is_exact():
    """The host-read form is for exact zeros on plain CPU tensors outside transforms:
    a tolerance, a tensor under vmap or one that requires grad take the traceable rule."""
    assert rules.zero_fix(atol=1e-6)._eager is None
    assert rules.zero_fix(rtol=1e-5)._eager is None
    fix = rules.zero_fix()._eager
    assert fix([{"w": torch.zeros(2, requires_grad=True)}]) is None
    seen = []

    def per_sample(t: torch.Tensor) -> torch.Tensor:
        seen.append(fix([{"w": t}]))
        return t

    torch.func.vmap(per_sample)(torch.zeros(3, 2))
    assert seen == [None]


def test_zero_fix_custom_values():
    group = make_group("some_zero", torch.float64)
    torch.testing.assert_close(
        rules.zero_fix(if_all_zero=2.0, if_zero=-1.0)(group), ref_zero_fix(group, 2.0, -1.0)
    )
    z = make_group("all_zero", torch.float64)
    torch.testing.assert_close(
        rules.zero_fix(if_all_zero=2.0, if_zero=-1.0)(z), ref_zero_fix(z, 2.0, -1.0)
    )


def _py_norm(group):
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in group.values()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(
    "vals",
    [[0.0, -0.0], [0.0, float("nan")], [-0.0, float("-inf")], [0.0, 1e-40], [0.0, 2.0]],
)
def test_all_zero_edge_values_match_python(dtype, vals):
    """-0.0 is zero; NaN, -inf and a float32 subnormal are not (per dtype, as stored)."""
    torch._dynamo.reset()  # a fresh cache: no case runs eagerly past the recompile limit
    t = torch.tensor(vals, dtype=dtype)
    expected = all(v == 0 for v in t.double().tolist())
    assert bool(rules.all_zero()({"w": t, "b": torch.zeros(1, dtype=dtype)})) == expected
    compiled = torch.compile(rules.all_zero(), backend="aot_eager", fullgraph=True)
    assert bool(compiled({"w": t, "b": torch.zeros(1, dtype=dtype)})) == expected
    batched = torch.func.vmap(lambda w: rules.all_zero()({"w": w}))(
        torch.stack([t, torch.zeros_like(t)])
    )
    assert batched.tolist() == [expected, True]


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(
    "value", [0.5, 0.1, 1e-40, 1e-46, 6e4, 1 + 2**-11 + 2**-30, 0.0, -0.0, -3.7, -1e-46]
)
def test_zero_rules_give_the_values_of_torch_where_in_every_dtype(dtype, value):
    """replace_zeros and zero_fix (both branches) put ``value`` rounded once to the
    gradient's dtype, bit for bit as torch.where and torch.full do, eager, traced and
    vmapped: also values that round to zero or (1 + 2**-11 + 2**-30) round differently
    through float32. zero_fix used to pass its values through float32 (0.1 came out
    0.10000000149 in float64)."""
    torch._dynamo.reset()  # a fresh cache: no case runs eagerly past the recompile limit
    g = torch.Generator().manual_seed(0)
    t = torch.randn(1003, generator=g).to(dtype)
    t[torch.rand(1003, generator=g) < 0.3] = 0.0
    special = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 3.0]
    t[: len(special)] = torch.tensor(special, dtype=torch.float64).to(dtype)
    want = torch.where(t == 0, value, t)
    one = torch.ones(1, dtype=dtype)
    fix = rules.zero_fix(if_zero=value)
    for got in (
        rules.replace_zeros(value)({"w": t})["w"],
        fix({"w": t, "b": one})["w"],
        torch.compile(rules.replace_zeros(value), backend="aot_eager", fullgraph=True)({"w": t})[
            "w"
        ],
        torch.compile(fix, backend="aot_eager", fullgraph=True)({"w": t, "b": one})["w"],
        torch.func.vmap(lambda r: rules.replace_zeros(value)({"w": r})["w"])(t[None])[0],
        torch.func.vmap(lambda r: fix({"w": r, "b": one})["w"])(t[None])[0],
    ):
        assert got.dtype == dtype
        assert torch.equal(_bits(got), _bits(want))
    dead = rules.zero_fix(if_all_zero=value)({"w": torch.zeros(5, dtype=dtype)})["w"]
    assert torch.equal(_bits(dead), _bits(torch.full((5,), value, dtype=dtype)))


@pytest.mark.parametrize("kind", KINDS)
def test_conditions_match_python(kind):
    group = make_group(kind, torch.float64)
    vals = [v for t in group.values() for v in t.flatten().tolist()]
    zeros = sum(v == 0 for v in vals)
    assert bool(rules.all_zero()(group)) == (zeros == len(vals))
    assert bool(rules.any_zero()(group)) == (zeros > 0)
    assert bool(rules.any_nonfinite()(group)) == any(not math.isfinite(v) for v in vals)
    for p in (0.0, 0.1, 0.5, 0.99):
        assert bool(rules.zero_fraction_above(p)(group)) == (zeros / len(vals) > p)
    n = _py_norm(group) if kind != "nonfinite" else 0.0
    if n > 0:
        assert bool(rules.norm_above(n * 0.999)(group))
        assert not bool(rules.norm_above(n * 1.001)(group))


@pytest.mark.parametrize("dtype", DTYPES)
def test_actions_keep_dtype_and_match_reference(dtype):
    group = make_group("nonfinite", dtype)
    out = rules.replace_nonfinite(7.0)(group)
    for k, t in group.items():
        want = t.clone()
        want[~torch.isfinite(t)] = 7.0
        torch.testing.assert_close(out[k], want, rtol=0, atol=0)
    group = make_group("some_zero", dtype)
    for rule, ref in [
        (rules.fill(3.0), lambda t: torch.full_like(t, 3.0)),
        (rules.scale(-2.0), lambda t: t * -2.0),
        (rules.unchanged(), lambda t: t),
        (rules.replace_zeros(0.25), lambda t: torch.where(t == 0, 0.25, t)),
    ]:
        out = rule(group)
        for k, t in group.items():
            assert out[k].dtype == dtype
            torch.testing.assert_close(out[k], ref(t), rtol=0, atol=0)


@pytest.mark.parametrize("max_norm", [0.1, 1.0, 100.0])
def test_clip_norm_matches_torch_clip_grad_norm(max_norm):
    group = make_group("none_zero", torch.float64)
    got = rules.clip_norm(max_norm)(group)
    ps = [torch.nn.Parameter(t.clone()) for t in group.values()]
    for p, t in zip(ps, group.values(), strict=True):
        p.grad = t.clone()
    torch.nn.utils.clip_grad_norm_(ps, max_norm)
    for (k, _), p in zip(group.items(), ps, strict=True):
        torch.testing.assert_close(got[k], p.grad, rtol=1e-12, atol=0)


def test_when_equals_if_else_and_condition_operators():
    then, other = rules.fill(9.0), rules.scale(2.0)
    cond = rules.any_zero() & ~rules.all_zero()
    assert repr(cond) == "(any_zero() & ~all_zero())"
    for kind in KINDS:
        group = make_group(kind, torch.float32)
        c = bool(rules.any_zero()(group)) and not bool(rules.all_zero()(group))
        want = then(group) if c else other(group)
        got = rules.when(cond, then, otherwise=other)(group)
        for k in group:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, equal_nan=True)


def test_rules_compile_to_one_graph():
    rule = rules.when(
        rules.any_nonfinite() | rules.norm_above(100.0),
        rules.replace_nonfinite(0.0),
        otherwise=rules.zero_fix(),
    )
    sets = [(make_group(k, torch.float32),) for k in KINDS]
    check_compiles(rule, *sets)
    check_compiles(rules.clip_norm(0.5), *sets[:3], rtol=1e-6, atol=1e-7)
    check_compiles(lambda g: rules.zero_fraction_above(0.3)(g), *sets)


def test_bad_hyperparameters_raise_clearly():
    with pytest.raises(
        ValueError, match=re.escape("fg.rules.clip_norm: max_norm must be > 0, got -1.0.")
    ):
        rules.clip_norm(-1.0)
    with pytest.raises(
        TypeError, match=re.escape("fg.rules.fill: value must be a real number, got '1'.")
    ):
        rules.fill("1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("fg.rules.replace_zeros: value must be finite")):
        rules.replace_zeros(float("nan"))
    with pytest.raises(
        TypeError, match=re.escape("Did you pass rules.fill instead of rules.fill(...)?")
    ):
        rules.when(rules.all_zero(), rules.fill)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=re.escape("fg.rules.when: condition must be a rule or condition")
    ):
        rules.when(rules.all_zero, rules.fill(1.0))  # type: ignore[arg-type]


def test_when_rejects_rules_that_change_structure():
    group = make_group("some_zero", torch.float32)
    bad_dtype = rules.when(rules.all_zero(), lambda g: {k: t.double() for k, t in g.items()})
    with pytest.raises(
        ValueError, match=re.escape("changed 'fc.weight' from (3, 4) torch.float32")
    ):
        bad_dtype(group)


def ref_zero_fix_atol(group, atol, all_zero=1.0, zero=0.5):
    """The seed's rule where |g| <= atol counts as zero, written with host branches."""
    if all(bool((t.abs() <= atol).all()) for t in group.values()):
        return {k: torch.full_like(t, all_zero) for k, t in group.items()}
    return {
        k: torch.tensor(
            [zero if abs(v) <= atol else v for v in t.view(-1).tolist()], dtype=t.dtype
        ).view(t.shape)
        for k, t in group.items()
    }


@pytest.mark.parametrize("kind", KINDS)
def test_zero_tests_with_a_tolerance_match_the_reference(kind):
    group = make_group(kind, torch.float64)
    group["fc.bias"][2] = 1e-17  # "mathematically zero" noise from another kernel path
    atol = 1e-12
    want = ref_zero_fix_atol(group, atol)
    got = rules.zero_fix(atol=atol)(group)
    for k in group:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, equal_nan=True)
    near = [abs(v) <= atol for t in group.values() for v in t.view(-1).tolist()]
    assert bool(rules.all_zero(atol=atol)(group)) == all(near)
    assert bool(rules.any_zero(atol=atol)(group)) == any(near)
    assert bool(rules.zero_fraction_above(0.1, atol=atol)(group)) == (sum(near) > 0.1 * len(near))
    replaced = rules.replace_zeros(0.25, atol=atol)(group)
    for k, t in group.items():
        want_k = torch.where(t.abs() <= atol, torch.tensor(0.25, dtype=t.dtype), t)
        torch.testing.assert_close(replaced[k], want_k, rtol=0, atol=0, equal_nan=True)
    # Exact tests (the default) do not count 1e-17 as zero.
    assert not bool(rules.all_zero()({"b": torch.tensor([0.0, 1e-17])}))
    assert bool(rules.all_zero(atol=atol)({"b": torch.tensor([0.0, 1e-17])}))


def test_tolerant_rules_compile_to_one_graph():
    sets = [(make_group(k, torch.float32),) for k in KINDS[:3]]
    check_compiles(rules.zero_fix(atol=1e-6), *sets)


def test_pre_release_spellings_are_gone():
    """The pre-release shims are removed: ``rules.identity`` (``fg.rules.unchanged``;
    ``fg.identity`` is the transformation) and ``zero_fix(all_zero=, zero=)``."""
    assert not hasattr(rules, "identity")
    with pytest.raises(
        TypeError, match=re.escape("zero_fix() got an unexpected keyword argument 'all_zero'")
    ):
        rules.zero_fix(all_zero=2.0)  # type: ignore[call-arg]


@pytest.mark.parametrize("rows", [False, True])
def test_eager_bool_reductions_equal_torch_all_and_any(rows):
    """funcgrad's rules reduce masks through _rule_base.all_ / any_, which eagerly on
    the CPU take min / max of the mask's bytes (torch's bool all / any are far
    slower there): the same as torch's, per row too, on every kind of mask."""
    from funcgrad.rules import _rule_base as rb

    g = torch.Generator().manual_seed(0)
    masks = [torch.rand(7, 33, generator=g) < p for p in (0.0, 0.02, 0.5, 0.98, 1.0)] + [
        (torch.rand(33, 7, generator=g) < 0.9).t(),  # not contiguous
        (torch.rand(7, 66, generator=g) < 0.9)[:, ::2],  # strided rows
        torch.ones(7, 1, dtype=torch.bool),
    ]
    masks[2][3] = True  # a row all True, among rows that are not
    masks[3][4] = False
    for m in masks:
        assert rb._bytes(m) is not None  # the fast path is what is tested
        want_all = m.all(dim=-1, keepdim=True) if rows else m.all()
        want_any = m.any(dim=-1, keepdim=True) if rows else m.any()
        with rb.rows() if rows else contextlib.nullcontext():
            got_all, got_any = rb.all_(m), rb.any_(m)
        assert got_all.dtype == got_any.dtype == torch.bool
        assert torch.equal(got_all, want_all) and torch.equal(got_any, want_any)
    empty = torch.zeros(0, dtype=torch.bool)  # torch's answers: all() True, any() False
    assert rb._bytes(empty) is None
    assert bool(rb.all_(empty)) and not bool(rb.any_(empty))
    # under vmap the mask is a wrapped tensor: torch's own reductions
    wrapped = []

    def per_row(t):
        wrapped.append(rb._bytes(t) is None)
        return rb.all_(t)

    assert torch.equal(torch.func.vmap(per_row)(masks[2]), masks[2].all(dim=-1))
    assert wrapped == [True]
