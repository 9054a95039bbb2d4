"""per_group, chain, partition, monitor against eager reference loops."""

from __future__ import annotations

import re

import pytest
import torch
from references import check_compiles, ref_zero_fix

import funcgrad as fg

GROUPS = fg.Groups({"fc1": ("fc1.weight", "fc1.bias"), "fc2": ("fc2.weight", "fc2.bias")})


def grads(case: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(case)
    out = {
        "fc1.weight": torch.randn(2, 1, generator=g),
        "fc1.bias": torch.randn(2, generator=g),
        "fc2.weight": torch.randn(3, 2, generator=g),
        "fc2.bias": torch.randn(3, generator=g),
        "fc3.weight": torch.zeros(1, 3),  # in no group: must stay exactly as is
    }
    if case % 2 == 0:
        out["fc1.weight"].zero_()
        out["fc1.bias"].zero_()
    out["fc2.weight"][0, 0] = 0.0
    if case % 3 == 0:
        out["fc2.weight"].zero_()
        out["fc2.bias"].zero_()
    return out


def ref_per_group(gr):
    """The intended rule as a plain loop: group by group, eagerly."""
    out = dict(gr)
    for names in GROUPS.values():
        out.update(ref_zero_fix({n: gr[n] for n in names}))
    return out


def test_per_group_matches_reference_eager_and_compiled():
    tx = fg.per_group(fg.rules.zero_fix(), GROUPS)
    sets = [(grads(c), tx.init(grads(c))) for c in range(4)]
    outs = check_compiles(tx.update, *sets)
    for (g, _), (got, state) in zip(sets, outs, strict=True):
        want = ref_per_group(g)
        assert state == fg.EmptyState()
        for k in g:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
        assert torch.equal(got["fc3.weight"], torch.zeros(1, 3))


def test_chain_equals_manual_composition():
    lr = torch.tensor(0.1, dtype=torch.float64)
    tx = fg.chain(fg.monitor(GROUPS), fg.per_group(fg.rules.zero_fix(), GROUPS), fg.adam(lr=lr))
    params = {k: torch.ones_like(v) for k, v in grads(0).items()}
    state = tx.init(params)
    adam = fg.adam(lr=lr)
    astate = adam.init(params)
    sets = []
    for c in range(3):
        g = grads(c)
        sets.append((g, state, params))
        updates, state = tx.update(g, state, params)
        want, astate = adam.update(ref_per_group(g), astate, params)
        for k in g:
            torch.testing.assert_close(updates[k], want[k], rtol=0, atol=0)
    check_compiles(tx.update, *sets)


def test_named_chain_equals_chain_and_reads_by_name():
    lr = torch.tensor(0.1, dtype=torch.float64)
    parts = [fg.monitor(GROUPS), fg.per_group(fg.rules.zero_fix(), GROUPS), fg.adam(lr=lr)]
    tx = fg.named_chain(*zip(("monitor", "rule", "adam"), parts, strict=True))
    ref = fg.chain(*parts)
    params = {k: torch.ones_like(v) for k, v in grads(0).items()}
    state, rstate = tx.init(params), ref.init(params)
    sets = []
    for c in range(3):
        g = grads(c)
        sets.append((g, state, params))
        updates, state = tx.update(g, state, params)
        want, rstate = ref.update(g, rstate, params)
        for k in g:
            torch.testing.assert_close(updates[k], want[k], rtol=0, atol=0)
    assert list(state) == ["monitor", "rule", "adam"]
    assert torch.equal(state["adam"].mu["fc1.weight"], rstate.inner_states[2].mu["fc1.weight"])
    assert (
        state["monitor"].stats["fc1"]["all_zero"] == rstate.inner_states[0].stats["fc1"]["all_zero"]
    )
    check_compiles(tx.update, *sets)


def test_monitor_stats_match_python():
    tx = fg.monitor(GROUPS, stats=("zero_fraction", "all_zero", "norm", "any_nonfinite"))
    for c in range(4):
        g = grads(c)
        g["fc2.bias"][1] = float("nan") if c == 3 else g["fc2.bias"][1]
        out, state = tx.update(g, tx.init(g))
        assert out is g
        for name, members in GROUPS.items():
            vals = [v for n in members for v in g[n].flatten().tolist()]
            s = state.stats[name]
            assert s["zero_fraction"].item() == pytest.approx(sum(v == 0 for v in vals) / len(vals))
            assert s["all_zero"].item() == all(v == 0 for v in vals)
            assert s["any_nonfinite"].item() == any(v != v for v in vals)
            if not s["any_nonfinite"]:
                assert s["norm"].item() == pytest.approx(sum(v * v for v in vals) ** 0.5, rel=1e-6)
    check_compiles(tx.update, *[(grads(c), tx.init(grads(c))) for c in range(3)])


def test_partition_routes_each_label_and_matches_separate_runs():
    params = {k: torch.ones_like(v) for k, v in grads(0).items()}
    labels = {k: ("fast" if k.startswith("fc1") else "slow") for k in params}
    labels["fc3.weight"] = "frozen"
    tx = fg.partition(
        {"fast": fg.adam(lr=0.1), "slow": fg.adam(lr=0.001), "frozen": fg.set_to_zero()}, labels
    )
    state = tx.init(params)
    fast, slow = fg.adam(lr=0.1), fg.adam(lr=0.001)
    sub = {lab: {k: v for k, v in params.items() if labels[k] == lab} for lab in ("fast", "slow")}
    fs, ss = fast.init(sub["fast"]), slow.init(sub["slow"])
    sets = []
    for c in range(3):
        g = grads(c)
        sets.append((g, state, params))
        updates, state = tx.update(g, state, params)
        assert list(updates) == list(g)
        uf, fs = fast.update({k: g[k] for k in sub["fast"]}, fs, sub["fast"])
        us, ss = slow.update({k: g[k] for k in sub["slow"]}, ss, sub["slow"])
        for k, v in {**uf, **us}.items():
            torch.testing.assert_close(updates[k], v, rtol=0, atol=0)
        assert torch.equal(updates["fc3.weight"], torch.zeros(1, 3))
    check_compiles(tx.update, *sets)


def test_partition_errors():
    params = grads(1)
    with pytest.raises(KeyError, match=re.escape("labels have missing ['fc3.weight']")):
        fg.partition({"a": fg.adam()}, {k: "a" for k in params if k != "fc3.weight"}).init(params)


def test_apply_updates_and_errors():
    p = {"w": torch.ones(2, dtype=torch.bfloat16)}
    out = fg.apply_updates(p, {"w": torch.tensor([0.5, 1.0])})
    assert out["w"].dtype == torch.bfloat16 and out["w"].tolist() == [1.5, 2.0]
    with pytest.raises(KeyError, match=re.escape("updates have missing ['w']; unexpected ['v']")):
        fg.apply_updates(p, {"v": torch.ones(2)})


def test_per_group_errors():
    tx = fg.per_group(fg.rules.zero_fix(), fg.Groups({"fc9": ("fc9.weight",)}))
    with pytest.raises(
        KeyError,
        match=re.escape("group 'fc9' names parameter 'fc9.weight', which is not in the gradients"),
    ):
        tx.init(grads(0))
    with pytest.raises(
        TypeError, match=re.escape("Did you pass rules.zero_fix instead of rules.zero_fix(...)?")
    ):
        fg.per_group(fg.rules.zero_fix, GROUPS)  # type: ignore[arg-type]
    bad = fg.per_group(lambda g: {k: v[:1] for k, v in g.items()}, GROUPS)
    with pytest.raises(
        ValueError,
        match=re.escape("changed 'fc1.weight' from (2, 1) torch.float32 to (1, 1) torch.float32"),
    ):
        bad.update(grads(0), fg.EmptyState())
    with pytest.raises(
        TypeError,
        match=re.escape(
            "fg.chain: argument 1 must be a GradientTransformation (e.g. fg.adam()), got Rule."
        ),
    ):
        fg.chain(fg.adam(), fg.rules.zero_fix())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("fg.monitor: unknown stats ['mean']")):
        fg.monitor(GROUPS, stats=("mean",))
