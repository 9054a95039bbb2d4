"""The flat layout (funcgrad/core/_flat.py): fg.params(model) keeps the trainable parameters
in one buffer per (device, dtype), the module's parameters being views of it.

Every test compares against an independent reference: torch.optim, the per-tensor
layout (a params dict built by hand, which the rest of the suite checks against
torch.optim and Python loops), or a checkpoint written before the flat layout.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from references import assert_trees_close
from torch import nn

import funcgrad as fg
from funcgrad.core._flat import Flat

FIXTURES = Path(__file__).parent / "fixtures"


def mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(dtype)


def batches(n: int, dtype: torch.dtype = torch.float64) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 4, generator=g, dtype=dtype), torch.randn(16, 3, generator=g, dtype=dtype))
        for _ in range(n)
    ]


def seed_tx(model: nn.Module, **adam: object) -> fg.GradientTransformation:
    groups = fg.group_by_module(model)
    return fg.chain(
        fg.monitor(groups),
        fg.per_group(fg.rules.zero_fix(), groups),
        fg.adamw(**{"lr": 1e-2, "weight_decay": 0.1, **adam}),  # type: ignore[arg-type]
    )


def per_tensor(model: nn.Module) -> dict[str, torch.Tensor]:
    """The per-tensor layout: a params dict built by hand."""
    return {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}


def train(model: nn.Module, params, tx, steps: int = 4, compile=False, dead: bool = True):
    loss = lambda p, x, y: ((fg.call(model, p, x) - y) ** 2).mean()  # noqa: E731
    step = fg.make_step(loss, tx, donate=True, compile=compile)
    state = tx.init(params)
    dtype = next(iter(params.values())).dtype
    for i, (x, y) in enumerate(batches(steps, dtype)):
        if dead and i % 2 == 0:  # an all-zero layer: the seed rule's first branch fires
            x = torch.zeros_like(x)
        params, state, _ = step(params, state, x, y)
    return params, state


def test_params_are_views_of_one_buffer_and_stay_the_modules() -> None:
    model = mlp()
    p = fg.params(model)
    assert isinstance(p, Flat) and len(p.buffers) == 1
    assert p.buffers[0].numel() == sum(t.numel() for t in model.parameters())
    for k, t in model.named_parameters():
        assert p[k].data_ptr() == t.data_ptr() and p[k].shape == t.shape
    # a second call returns the same buffers; load_state_dict writes what the step trains
    assert fg.params(model).buffers[0] is p.buffers[0]
    model.load_state_dict({k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()})
    assert torch.equal(p.buffers[0], torch.full_like(p.buffers[0], 0.5))


@pytest.mark.parametrize("compile", [False, {"backend": "aot_eager"}])
def test_flat_equals_per_tensor_layout(compile) -> None:
    """The seed rule (both branches) + monitor + AdamW with amsgrad, 4 donated steps."""
    a, b = mlp(), mlp()
    pa, sa = train(a, fg.params(a), seed_tx(a, amsgrad=True), compile=compile)
    pb, sb = train(b, per_tensor(b), seed_tx(b, amsgrad=True), compile=compile)
    assert isinstance(pa, Flat) and isinstance(sa.inner_states[2].mu, Flat)
    assert not isinstance(pb, Flat)
    assert_trees_close(dict(pa), dict(pb))
    assert_trees_close(sa.inner_states[2], sb.inner_states[2])
    # monitor's norm is one reduction over a segment instead of a norm of norms
    assert_trees_close(sa.inner_states[0], sb.inner_states[0], rtol=1e-12)
    for k, t in a.named_parameters():  # the module trained in place
        assert torch.equal(t.detach(), pb[k])


def stack(layers: int = 5) -> nn.Module:
    """Equal layers: their groups are adjacent segments of one size in the buffer."""
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Linear(4, 6)]
    for _ in range(layers):
        mods += [nn.ReLU(), nn.Linear(6, 6)]
    return nn.Sequential(*mods, nn.ReLU(), nn.Linear(6, 3)).to(torch.float64)


STACK_RULES = {
    "zero_fix": fg.rules.zero_fix(),
    "zero_fix_atol": fg.rules.zero_fix(atol=1e-3),
    "norm_clip": fg.rules.when(
        fg.rules.norm_above(0.05), fg.rules.clip_norm(0.02), otherwise=fg.rules.scale(2.0)
    ),
    "zero_fraction": fg.rules.when(fg.rules.zero_fraction_above(0.3), fg.rules.fill(0.0)),
    "any_zero_or_nonfinite": fg.rules.when(
        fg.rules.any_zero() | fg.rules.any_nonfinite(), fg.rules.replace_zeros(0.25)
    ),
    "all_zero": fg.rules.when(fg.rules.all_zero(), fg.rules.fill(1.0)),
}


def test_blocks_of_groups_that_repeat() -> None:
    from funcgrad.rules._per_group import _blocks

    # adjacent groups of one size; then a run of two; then single groups
    spans = [(0, 4), (4, 8), (8, 12), (12, 14), (14, 16), (20, 24), (24, 30)]
    assert _blocks(spans, 30) == [
        (0, 4, 3, ((0, 4, True),)),
        (12, 2, 2, ((0, 2, True),)),
        (20, 4, 1, ((0, 4, True),)),
        (24, 6, 1, ((0, 6, True),)),
    ]
    # blocks of three groups (2, 6, 3 entries; a transformer's modules), then a head
    spans = [(11 * r + a, 11 * r + e) for r in range(3) for a, e in ((0, 2), (2, 8), (8, 11))]
    assert _blocks([*spans, (33, 38)], 38) == [
        (0, 11, 3, ((0, 2, True), (2, 8, True), (8, 11, True))),
        (33, 5, 1, ((0, 5, True),)),
    ]
    # evenly spaced with a gap between (an entry in no group); the last block's gap
    # would pass the buffer's end: that block is left out
    spaced = [(6 * r, 6 * r + 4) for r in range(4)]
    assert _blocks(spaced, 24) == [(0, 6, 4, ((0, 4, True), (4, 6, False)))]
    assert _blocks(spaced, 22) == [
        (0, 6, 3, ((0, 4, True), (4, 6, False))),
        (18, 4, 1, ((0, 4, True),)),
    ]
    # nothing repeats: each group alone; no groups: nothing
    assert [k for _, _, k, _ in _blocks([(0, 3), (3, 5), (5, 9)], 9)] == [1, 1, 1]
    assert _blocks([], 0) == []


class Block(nn.Module):
    """Four modules of different sizes: grouped per module, the blocks of a stack
    repeat with a period of four groups (a transformer's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.up = nn.Linear(6, 4)
        self.down = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc(x))
        return self.norm(x + self.down(torch.relu(self.up(x))))


def blocks(n: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), *[Block() for _ in range(n)], nn.Linear(6, 3)).double()


AOT = {"backend": "aot_eager"}
# Traced, each case compiles two steps (13-20 s on 2 cores): one rule per kind of
# statistic (zero_fix: all_zero and any_zero; norm_clip: the norm; zero_fraction: the
# mean of a count; any_zero_or_nonfinite: the nonfinite check, combined with |) traced;
# zero_fix_atol and all_zero only eagerly (their statistics are zero_fix's); inductor on
# the blocks (rows of four kinds of module) only.
TRACED_RULES = ("zero_fix", "norm_clip", "zero_fraction", "any_zero_or_nonfinite")
ROWS_CASES = [
    *[(n, False, "stack") for n in STACK_RULES],
    *[(n, AOT, "stack") for n in TRACED_RULES],
    *[(n, False, "blocks") for n in STACK_RULES],
    *[(n, False, "blocks-gaps") for n in ("zero_fix", "norm_clip")],
    ("zero_fix", AOT, "blocks"),
    ("any_zero_or_nonfinite", AOT, "blocks"),
    ("norm_clip", True, "blocks"),
]


@pytest.mark.parametrize(("name", "compile", "arch"), ROWS_CASES)
def test_equal_layers_ruled_as_rows_equal_the_per_tensor_layout(name, compile, arch, monkeypatch):
    """Groups that repeat (a stack of equal layers; blocks of four different modules)
    are ruled once per column of the blocks, as the rows of a (k, period) view: every
    statistic per row, the same result as each group alone (the per-tensor layout)."""
    import funcgrad.rules._rule_base as rb

    rows_seen = []
    real_rows = rb.rows

    def spy():
        rows_seen.append(True)
        return real_rows()

    monkeypatch.setattr(rb, "rows", spy)
    # Compiled, a buffer of few groups is ruled per group on the per-name gradients
    # (test_compiled_step_rules_the_per_name_gradients); rows are what is tested here.
    monkeypatch.setattr("funcgrad.rules._per_group.FEW_GROUPS", 0)

    def tx(m):
        groups = fg.group_by_module(m)
        if arch == "blocks-gaps":  # the norms in no group: a gap column in every block
            groups = fg.Groups({g: n for g, n in groups.items() if not g.endswith("norm")})
        return fg.chain(fg.per_group(STACK_RULES[name], groups), fg.adam(1e-2))

    torch._dynamo.reset()  # each parametrization compiles new steps of the same code
    build = stack if arch == "stack" else blocks
    assert arch in ("stack", "blocks", "blocks-gaps")
    a, b = build(), build()
    with torch.no_grad():  # a dead layer inside the run: the all-zero branches fire
        for m in (a, b):
            if arch == "stack":
                m[4].weight.zero_()
            else:  # relu(up(x)) = 0: up's gradients are all zero, down.weight's too
                m[2].up.weight.zero_(), m[2].up.bias.fill_(-100.0)
    pa, sa = train(a, fg.params(a), tx(a), compile=compile)
    assert rows_seen, "the run of equal layers was not ruled as rows"
    # The reference: each group alone, per tensor, eagerly (a compiled step on plain
    # per-tensor dicts is held to eager across tests/test_one_graph.py; compiling the
    # reference here too doubled this test's time).
    pb, sb = train(b, per_tensor(b), tx(b), compile=False)
    rtol = 1e-12 if compile is not True else 1e-5  # inductor's kernels round differently
    assert_trees_close(dict(pa), dict(pb), rtol=rtol, atol=1e-12)
    assert_trees_close(sa.inner_states[1], sb.inner_states[1], rtol=rtol, atol=1e-12)


def gapped() -> nn.Module:
    """Linear layers with LayerNorms before, between and after them."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.LayerNorm(4), nn.Linear(4, 6), nn.ReLU(), nn.LayerNorm(6), nn.Linear(6, 6),
        nn.ReLU(), nn.Linear(6, 3), nn.LayerNorm(3),
    ).double()  # fmt: skip


PARTS_SEEN: list[tuple[str, ...]] = []
_real_parts_in = Flat._parts_in


def _parts_spy(self, b, start, stop):
    out = _real_parts_in(self, b, start, stop)
    if out is not None:
        PARTS_SEEN.append(tuple(out))
    return out


@pytest.mark.parametrize("name", ["zero_fix", "norm_clip"])
def test_compiled_step_rules_the_per_name_gradients(name, monkeypatch) -> None:
    """Compiled, a buffer of few groups is ruled per group on the backward's per-name
    gradients (Flat._packed_from; the flat gradient is then dead code), the entries in
    no group (the LayerNorms: before, between and after the groups) passed through
    from them too: the same as the eager step, which rules slices of the flat
    gradient, and as the per-tensor layout."""
    seen = PARTS_SEEN  # a module's list: dynamo replays appends to it, not to a closure's
    seen.clear()
    monkeypatch.setattr(Flat, "_parts_in", _parts_spy)

    def tx(m):
        groups = fg.group_by_module(m, types=(nn.Linear,))
        return fg.chain(fg.per_group(STACK_RULES[name], groups), fg.adam(1e-2))

    torch._dynamo.reset()
    runs = {}
    for key, compile, layout in (("compiled", AOT, fg.params), ("eager", False, fg.params),
                                 ("per tensor", False, per_tensor)):  # fmt: skip
        m = gapped()
        with torch.no_grad():
            m[4].weight.zero_()  # no gradient reaches layers 0-3: group 1's is all zero
        runs[key] = train(m, layout(m), tx(m), compile=compile)
        if key == "compiled":  # every group and every gap read from the per-name gradients
            assert set(seen) == {
                ("0.weight", "0.bias"), ("1.weight", "1.bias"), ("3.weight", "3.bias"),
                ("4.weight", "4.bias"), ("6.weight", "6.bias"), ("7.weight", "7.bias"),
                tuple(n for n, _ in m.named_parameters()),  # the writes' fence: all of them
            }  # fmt: skip
            seen.clear()
    assert not seen  # eagerly, the rules read slices of the flat gradient
    (pc, sc), (pe, se), (pt, st) = runs["compiled"], runs["eager"], runs["per tensor"]
    for want, state in ((dict(pe), se), (pt, st)):
        assert_trees_close(dict(pc), want, rtol=1e-12, atol=1e-12)
        assert_trees_close(sc.inner_states[1], state.inner_states[1], rtol=1e-12, atol=1e-12)
    if name == "zero_fix":  # its first branch (all zero -> 1.0) trained layer 1
        assert not torch.equal(pc["1.weight"], gapped()[1].weight)


def test_flat_adamw_equals_torch_optim() -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    params = fg.params(model)
    tx = fg.adamw(lr=1e-2, weight_decay=0.1)
    loss = lambda p, x, y: ((fg.call(model, p, x) - y) ** 2).mean()  # noqa: E731
    step = fg.make_step(loss, tx, donate=True)
    state = tx.init(params)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches(5):
        params, state, _ = step(params, state, x, y)
        opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        opt.step()
        for k, t in ref.named_parameters():
            torch.testing.assert_close(params[k], t.detach(), rtol=1e-10, atol=1e-12)


def test_mask_that_splits_a_buffer_falls_back_to_views() -> None:
    """Decay on weights only: one buffer holds decayed and undecayed tensors."""
    mask = lambda name, p: p.dim() > 1  # noqa: E731
    a, b = mlp(), mlp()
    pa, sa = train(a, fg.params(a), seed_tx(a, mask=mask))
    pb, sb = train(b, per_tensor(b), seed_tx(b, mask=mask))
    assert isinstance(sa.inner_states[2].mu, Flat)
    assert_trees_close(dict(pa), dict(pb))
    assert_trees_close(sa.inner_states[2], sb.inner_states[2])


def test_mixed_dtypes_one_buffer_each() -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        m[2].double()
        return m

    class Cast(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner[2](self.inner[1](self.inner[0](x.float())).double())

    a, b = Cast(build()), Cast(build())
    pa = fg.params(a)
    assert [t.dtype for t in pa.buffers] == [torch.float32, torch.float64]
    pa, sa = train(a, pa, seed_tx(a))
    pb, sb = train(b, per_tensor(b), seed_tx(b))
    assert_trees_close(dict(pa), dict(pb))
    assert_trees_close(sa.inner_states[2], sb.inner_states[2])


def test_cpu_buffers_are_capped_at_module_boundaries(monkeypatch) -> None:
    """On the CPU a buffer holds at most ``CPU_BUCKET_BYTES``: a module's own
    parameters stay together where they fit, a larger tensor is a buffer of its own
    (its gradient is then never copied into a flat one), other devices keep one."""
    import funcgrad.core._layout as layout_mod
    from funcgrad.core._flat import Layout

    def lay(**shapes: tuple[int, ...]) -> list[list[str]]:
        named = {
            k.replace("_", "."): torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()
        }
        layout = Layout.for_tensors(named)
        for b, names in enumerate(layout.members):  # each buffer packed without gaps
            at = 0
            for n in names:
                _, off, shape = layout.entries[layout.index[n]]
                assert off == at and shape == tuple(named[n].shape)
                at += named[n].numel()
            assert layout.sizes[b] == at
        return [list(m) for m in layout.members]

    monkeypatch.setattr(layout_mod, "CPU_BUCKET_BYTES", 100 * 8)  # 100 float64 entries
    # 60 + 30 fit; 40 more would not: the next module starts a buffer
    assert lay(a_w=(6, 10), a_b=(30,), b_w=(40,), c_w=(50,)) == [
        ["a.w", "a.b"],
        ["b.w", "c.w"],
    ]
    # a module over the cap is split per tensor, its large tensor alone
    assert lay(a_w=(5,), b_w=(20, 10), b_b=(20,), c_w=(3,)) == [
        ["a.w"],
        ["b.w"],
        ["b.b", "c.w"],
    ]
    # exactly the cap fits; two dtypes never share a buffer
    named = {"a.w": torch.zeros(100, dtype=torch.float64), "b.w": torch.zeros(3)}
    assert [list(m) for m in Layout.for_tensors(named).members] == [["a.w"], ["b.w"]]
    meta = {f"{i}.w": torch.zeros(100, device="meta") for i in range(4)}
    assert len(Layout.for_tensors(meta).sizes) == 1  # not the CPU: no cap
    # the real cap: the update-heavy model's 16 MiB matrices are one buffer each
    monkeypatch.undo()
    big = {f"{i}.w": torch.empty(2048, 2048) for i in range(3)}
    assert len(Layout.for_tensors(big).sizes) == 3


def assert_same_training(model: nn.Module, flat, per, compile) -> None:
    """``train``'s results on the flat layout (``model``'s) equal the per-tensor ones
    (params, Adam's and monitor's state), and the module holds the flat params."""
    (pa, sa), (pb, sb) = flat, per
    rtol = 1e-12 if compile is not True else 1e-5
    assert_trees_close(dict(pa), dict(pb), rtol=rtol, atol=1e-12)
    assert_trees_close(sa.inner_states[2], sb.inner_states[2], rtol=rtol, atol=1e-12)
    assert_trees_close(sa.inner_states[0], sb.inner_states[0], rtol=rtol, atol=1e-12)
    for k, t in model.named_parameters():
        assert torch.equal(t.detach(), pa[k])


@pytest.mark.parametrize("compile", [False, {"backend": "aot_eager"}, True])
def test_capped_buffers_equal_the_per_tensor_layout(compile, monkeypatch) -> None:
    """Several buffers of one dtype, one module split across two (its group is ruled
    per tensor there, the others per segment): the same training as per tensor."""
    import funcgrad.core._layout as layout_mod

    monkeypatch.setattr(layout_mod, "CPU_BUCKET_BYTES", 40 * 8)  # modules of 30, 42, 42, 21
    torch._dynamo.reset()
    a, b = stack(2), stack(2)
    pa = fg.params(a)
    assert pa.layout.members == (
        ("0.weight", "0.bias"),
        ("2.weight",),
        ("2.bias",),
        ("4.weight",),
        ("4.bias", "6.weight", "6.bias"),
    )
    pa, sa = train(a, pa, seed_tx(a, amsgrad=True), compile=compile)
    pb, sb = train(b, per_tensor(b), seed_tx(b, amsgrad=True), compile=compile)
    assert_same_training(a, (pa, sa), (pb, sb), compile)


def test_large_cpu_tensors_are_buffers_of_their_own(monkeypatch) -> None:
    """On the CPU a tensor of at least ``CPU_ALONE_BYTES`` is a buffer of its own (its
    gradient is never copied into a flat one); the smaller tensors around it, its own
    module's included, go on filling the open buffer."""
    import funcgrad.core._layout as layout_mod
    from funcgrad.core._flat import Layout

    monkeypatch.setattr(layout_mod, "CPU_ALONE_BYTES", 36 * 8)  # a 6x6 float64 matrix
    pa = fg.params(stack(2))
    assert pa.layout.members == (
        ("0.weight", "0.bias", "2.bias", "4.bias", "6.weight", "6.bias"),
        ("2.weight",),
        ("4.weight",),
    )
    monkeypatch.setattr(layout_mod, "CPU_BUCKET_BYTES", 10 * 8)  # and the cap still holds
    named = {"a.w": torch.zeros(8, dtype=torch.float64), "b.w": torch.zeros(40, dtype=torch.float64),
             "b.b": torch.zeros(2, dtype=torch.float64), "c.w": torch.zeros(3, dtype=torch.float64)}  # fmt: skip
    assert Layout.for_tensors(named).members == (("a.w", "b.b"), ("b.w",), ("c.w",))
    meta = {f"{i}.w": torch.zeros(100, device="meta") for i in range(4)}
    assert len(Layout.for_tensors(meta).sizes) == 1  # not the CPU: one buffer
    monkeypatch.undo()  # the real threshold: 1 MiB
    real = {"a.w": torch.empty(512, 512), "a.b": torch.empty(512), "b.w": torch.empty(511, 512)}
    assert Layout.for_tensors(real).members == (("a.w",), ("a.b", "b.w"))


@pytest.mark.parametrize("compile", [False, True])
def test_groups_split_by_large_tensors_equal_the_per_tensor_layout(compile, monkeypatch) -> None:
    """Modules whose weight is a buffer of its own and whose bias shares one with
    other modules: each such group is ruled whole (its statistics over both), the
    same training as per tensor, with an all-zero layer on every other step; compiled,
    the split groups read the backward's per-name gradients."""
    import funcgrad.core._layout as layout_mod

    monkeypatch.setattr(layout_mod, "CPU_ALONE_BYTES", 36 * 8)
    torch._dynamo.reset()
    a, b = stack(4), stack(4)
    pa = fg.params(a)
    assert len(pa.layout.sizes) == 5  # one shared buffer, four 6x6 weights alone
    seen = PARTS_SEEN
    seen.clear()
    monkeypatch.setattr(Flat, "_parts_in", _parts_spy)
    pa, sa = train(a, pa, seed_tx(a, amsgrad=True), compile=compile)
    pb, sb = train(b, per_tensor(b), seed_tx(b, amsgrad=True), compile=compile)
    if compile:
        assert {("2.weight",), ("2.bias",), ("8.weight",)} <= set(seen)
    assert_same_training(a, (pa, sa), (pb, sb), compile)


def test_low_precision_flat_equals_per_tensor() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        a, b = mlp(dtype), mlp(dtype)
        pa, _ = train(a, fg.params(a), fg.adam(lr=1e-2), dead=False)
        pb, _ = train(b, per_tensor(b), fg.adam(lr=1e-2), dead=False)
        assert_trees_close(dict(pa), dict(pb))


def test_compiled_low_precision_rules_the_per_name_gradients(monkeypatch) -> None:
    """In bfloat16 and float16, the compiled flat step rules each group on the
    per-name gradients too (their dtype is their buffer's), with the same values as
    the compiled per-tensor step and the eager flat step."""
    seen = PARTS_SEEN
    monkeypatch.setattr(Flat, "_parts_in", _parts_spy)
    for dtype in (torch.bfloat16, torch.float16):
        torch._dynamo.reset()
        seen.clear()
        runs = {}
        for key, compile, layout in (("compiled", AOT, fg.params), ("eager", False, fg.params),
                                     ("per tensor", AOT, per_tensor)):  # fmt: skip
            m = mlp(dtype)
            runs[key] = train(m, layout(m), seed_tx(m), compile=compile)
            if key == "compiled":  # both groups (and monitor's) read the per-name gradients
                assert {("0.weight", "0.bias"), ("2.weight", "2.bias")} <= set(seen)
        (pc, sc), (pe, se), (pt, st) = runs["compiled"], runs["eager"], runs["per tensor"]
        assert all(t.dtype == dtype for t in pc.values())
        for want, state in ((dict(pe), se), (pt, st)):
            assert_trees_close(dict(pc), want)
            assert_trees_close(sc.inner_states[2], state.inner_states[2])


def test_frozen_tied_and_single_parameter() -> None:
    emb = nn.Embedding(5, 4)
    head = nn.Linear(4, 5, bias=False)
    head.weight = emb.weight  # tied
    norm = nn.LayerNorm(4)
    norm.bias.requires_grad_(False)  # frozen
    model = nn.Sequential(emb, norm, head)
    p = fg.params(model)
    assert list(p) == ["0.weight", "1.weight"]
    assert p.buffers[0].numel() == 5 * 4 + 4
    assert model[2].weight.data_ptr() == p["0.weight"].data_ptr()
    one = nn.Linear(3, 1, bias=False)
    q = fg.params(one)
    assert list(q) == ["weight"] and q["weight"].data_ptr() == one.weight.data_ptr()
    tx = fg.adam(lr=0.1)
    loss = lambda p, x: fg.call(one, p, x).sum()  # noqa: E731
    q, _, _ = fg.make_step(loss, tx, donate=True)(q, tx.init(q), torch.ones(2, 3))
    assert torch.allclose(one.weight.detach(), q["weight"])


def test_reallocated_module_is_an_error_not_a_detached_copy() -> None:
    model = mlp(torch.float32)
    params = fg.params(model)
    tx = fg.adam()
    state = tx.init(params)
    loss = lambda p, x, y: ((fg.call(model, p, x) - y) ** 2).mean()  # noqa: E731
    step = fg.make_step(loss, tx, donate=True)
    x, y = (t.float() for t in batches(1)[0])
    params, state, _ = step(params, state, x, y)
    model.double()
    with pytest.raises(RuntimeError, match=re.escape("Call fg.params(model) again")):
        step(params, state, x, y)
    fresh = fg.params(model)  # the fix works
    assert fresh.buffers[0].dtype == torch.float64
    fg.make_step(loss, tx, donate=True)(fresh, tx.init(fresh), x.double(), y.double())
    with torch.no_grad():
        model[0].weight.data = torch.zeros(8, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=re.escape("'0.weight' is no longer the tensor")):
        fg.make_step(loss, tx)(fresh, tx.init(fresh), x.double(), y.double())


def test_meta_device_init_then_to_empty() -> None:
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    stale = fg.params(model)
    model.to_empty(device="cpu")
    nn.init.ones_(model.weight)
    nn.init.zeros_(model.bias)
    loss = lambda p, x: fg.call(model, p, x).sum()  # noqa: E731
    tx = fg.adam()
    with pytest.raises(RuntimeError, match=re.escape("Call fg.params(model) again")):
        fg.make_step(loss, tx)(stale, tx.init(fg.params(model)), torch.ones(1, 3))
    params = fg.params(model)
    assert params["weight"].data_ptr() == model.weight.data_ptr()
    assert torch.equal(params["weight"], torch.ones(2, 3))


def test_channels_last_keeps_the_per_tensor_layout() -> None:
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    p = fg.params(conv)
    assert not isinstance(p, Flat)
    assert p["weight"].data_ptr() == conv.weight.data_ptr()


def test_parametrized_weight_trains_the_original() -> None:
    """torch.nn.utils.parametrize: the parameter is the original; the computed weight is
    recomputed from its view in every forward."""
    from torch.nn.utils import parametrize

    class Symmetric(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w.triu() + w.triu(1).transpose(-1, -2)

    def build() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()
        parametrize.register_parametrization(m[0], "weight", Symmetric())
        return m

    a, b = build(), build()
    x, _ = batches(1)[0]
    assert isinstance(fg.params(a), Flat)
    pa, _ = train(a, fg.params(a), fg.adam(lr=1e-2), dead=False)
    pb, _ = train(b, per_tensor(b), fg.adam(lr=1e-2), dead=False)
    assert_trees_close(dict(pa), dict(pb))
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_per_sample_and_buffers_on_flat_params() -> None:
    a, b = mlp(), mlp()
    rule = fg.per_group(fg.rules.clip_norm(0.1), fg.group_by_module(a))
    results = []
    for m, p in ((a, fg.params(a)), (b, per_tensor(b))):
        loss = lambda p, x, y, m=m: ((fg.call(m, p, x) - y) ** 2).mean()  # noqa: E731
        step = fg.make_step(loss, fg.adam(lr=1e-2), per_sample=rule)
        s = fg.adam(lr=1e-2).init(p)
        for x, y in batches(2):
            p, s, _ = step(p, s, x, y)
        results.append(dict(p))
    assert_trees_close(*results)

    def bn() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).double()

    outs = []
    for m in (bn(), bn()):
        p = fg.params(m) if not outs else per_tensor(m)
        loss = lambda p, b, x, y, m=m: ((fg.call(m, p, x, buffers=b) - y) ** 2).mean()  # noqa: E731
        step = fg.make_step(loss, fg.adam(lr=1e-2), buffers=True, donate=True)
        s, bufs = fg.adam(lr=1e-2).init(p), fg.buffers(m)
        for x, y in batches(3):
            p, s, bufs, _ = step(p, s, bufs, x, y)
        outs.append((dict(p), dict(bufs)))
    assert_trees_close(outs[0], outs[1])


def test_checkpoint_written_before_the_flat_layout_loads_and_resumes() -> None:
    """tests/fixtures/before_flat.ckpt: 3 steps saved by funcgrad before the flat layout
    (per-tensor state) and before the learning rate was state (no ``lr`` entry).

    What is portable is compared bit for bit: the loaded tensors against the file's. The
    continuation is compared bit for bit against a reference computed here (the same
    checkpoint resumed in the per-tensor layout), and with a tolerance against the
    params the old version reached on the machine that wrote the fixture
    (before_flat_after6.pt): other CPUs take other kernel paths (docs/testing.md)."""
    from funcgrad.io._checkpoint import _read

    path = FIXTURES / "before_flat.ckpt"
    payload = _read(path)
    assert "lr" not in payload["state"]["inner_states"]["2"]  # written before lr was state
    loss = lambda m: lambda p, x, y: ((fg.call(m, p, x) - y) ** 2).mean()  # noqa: E731
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 4, generator=g, dtype=torch.float64) for _ in range(6)]
    ys = [torch.randn(16, 3, generator=g, dtype=torch.float64) for _ in range(6)]
    runs = []
    for layout in (fg.params, per_tensor):
        model = mlp()
        tx = seed_tx(model, amsgrad=True)
        params, state, extra = fg.load_checkpoint(path, layout(model), tx)
        assert extra == {"step": 3}
        assert isinstance(state.inner_states[2].mu, Flat) == (layout is fg.params)
        # loaded: the file's tensors, bit for bit; the learning rate is tx's
        assert_trees_close(dict(params), payload["params"])
        adam = state.inner_states[2]
        for field in ("mu", "nu", "nu_max"):
            assert_trees_close(
                dict(getattr(adam, field)), payload["state"]["inner_states"]["2"][field]
            )
        assert int(adam.count) == 3 and fg.get_lr(state) == fg.get_lr(tx.init(params))
        step = fg.make_step(loss(model), tx, donate=True)
        for i in range(3, 6):
            params, state, _ = step(params, state, xs[i], ys[i])
        runs.append(dict(params))
    assert_trees_close(runs[0], runs[1])  # this machine: flat == per tensor, bit for bit
    expected = torch.load(FIXTURES / "before_flat_after6.pt", weights_only=True)
    assert_trees_close(runs[0], expected, rtol=1e-12, atol=1e-14)  # the old version's


def test_checkpoints_move_both_ways_between_layouts(tmp_path: Path) -> None:
    a, b = mlp(), mlp()
    pa, sa = train(a, fg.params(a), seed_tx(a))
    pb, sb = train(b, per_tensor(b), seed_tx(b))
    assert fg.state_dict(sa).keys() == fg.state_dict(sb).keys()
    assert_trees_close(fg.state_dict(sa.inner_states[2]), fg.state_dict(sb.inner_states[2]))
    fg.save_checkpoint(tmp_path / "flat.ckpt", pa, sa)
    c = mlp()
    pc, sc, _ = fg.load_checkpoint(tmp_path / "flat.ckpt", per_tensor(c), seed_tx(c))
    assert not isinstance(sc.inner_states[2].mu, Flat)
    assert_trees_close(sc.inner_states[2], sb.inner_states[2])
    assert_trees_close(dict(pc), dict(pb))
