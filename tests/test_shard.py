"""fg.sharded (ZeRO-2) on 2 and 3 gloo ranks against one process on the full batch."""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from torch._dynamo.utils import counters
from workers import shard_workers as sw

import funcgrad as fg
from funcgrad import rules
from funcgrad.core._tree import tensor_paths
from funcgrad.distributed import _sharded as _shard
from funcgrad.distributed import _split


def single_process(steps=range(sw.STEPS), params=None, state=None):
    m = sw.model()
    tx = sw.make_tx(m)
    step = fg.make_step(sw.loss_fn(m), tx, donate=True)
    return sw.train(m, tx, step, 0, 1, steps, params, state)


@pytest.fixture(scope="module")
def reference():
    return single_process()


def load(path, mode, rank):
    return torch.load(path / f"{mode}-rank{rank}.pt", weights_only=False)


def test_setup_has_a_parameter_shard_that_is_all_zero_while_its_layer_is_not():
    m = sw.model()
    x, y = sw.batches()[0]
    g = torch.func.grad(sw.loss_fn(m))(fg.params(m), x, y)
    # 2 ranks: rank 1 holds rows 2-3 of fc1, whose gradient is exactly zero.
    assert (g["fc1.weight"][2:] == 0).all() and (g["fc1.bias"][2:] == 0).all()
    assert (g["fc1.weight"][:2] != 0).any()


# fg.params gives flat buffers: fg.sharded splits them in equal chunks (ZeRO); a
# "+rows" mode trains a plain dict of the same parameters, split by rows; "+capped"
# caps the CPU buffers so that one dtype has four.
@pytest.mark.parametrize(
    ("mode", "world"),
    [
        ("eager", 1),
        ("eager", 2),
        ("eager", 3),
        ("compiled", 2),
        ("compiled_inductor", 2),  # three inductor ranks on two cores took 38 s
        ("gradients", 2),
        ("eager+rows", 3),
        ("compiled+rows", 2),
        ("eager+capped", 3),
    ],
)
def test_n_ranks_equal_one_process_on_the_full_batch(mode, world, reference, tmp_path):
    sw.run(mode, tmp_path, world)
    params, state = reference
    unsharded = sw.state_bytes(state)
    for rank in range(world):
        got = load(tmp_path, mode, rank)
        assert got["split"] == ("Ranks" if mode.endswith(sw.ROWS) else "Chunks")
        if mode.endswith(sw.CAPPED):  # four buffers of one dtype, chunked each
            assert got["buffers"] == [
                ["temperature"],
                ["fc1.weight", "fc1.bias"],
                ["fc2.weight"],
                ["fc2.bias", "fc3.weight", "fc3.bias"],
            ]
        for k in params:
            torch.testing.assert_close(got["params"][k], params[k], rtol=1e-12, atol=1e-12)
        for name in ("before", "after"):  # monitor before and after the rules
            for g, stats in state[name].stats.items():
                for s, v in stats.items():
                    torch.testing.assert_close(got["monitor"][name][g][s], v)
        assert got["skipped"] == int(state["update"].skipped) == 1  # the NaN batch
        # State per rank: this rank's part of mu, nu (+ padding rows at most), the
        # counters and monitor statistics whole.
        split = sum(t.numel() * t.element_size() for p, t in tensor_paths(state) if t.dim())
        assert got["state_bytes"] <= unsharded - split + split / world + 64 * world
        if mode.startswith("compiled") or mode == "gradients":
            assert (got["graphs"], got["breaks"]) == (1, 0)


def test_real_architectures_gpt_with_tied_weights_and_batchnorm_resnet(tmp_path):
    """2 ranks, eager, float64, 3 steps. The small GPT (tied embedding and head, masked
    AdamW, per-block rule with atol, monitor) equals one process on the full batch, split
    by rows (its mask a predicate) and in flat chunks (the same mask as a dict); the
    ResNet (train-mode BatchNorm, buffers=True) equals replicated data parallelism,
    params and each rank's own running statistics."""
    sw.run("architectures", tmp_path, 2)
    want = sw.gpt_run(0, 1, sharded=False)
    assert "tok.weight" in want and "head.weight" not in want  # tied: listed once
    for rank in (0, 1):
        got = load(tmp_path, "architectures", rank)
        for split in ("gpt", "gpt_chunks"):  # by rows (a predicate mask), in flat chunks
            for k, v in want.items():
                torch.testing.assert_close(got[split][k], v, rtol=1e-12, atol=1e-12)
        res = got["resnet"]
        for part in ("params", "buffers"):
            for k, v in res["replicated"][part].items():
                torch.testing.assert_close(res["sharded"][part][k], v, rtol=1e-12, atol=1e-12)
    # The ranks saw different halves: their BatchNorm statistics differ (as in DDP).
    r0, r1 = (load(tmp_path, "architectures", r)["resnet"]["sharded"] for r in (0, 1))
    assert not torch.equal(
        r0["buffers"]["stem.1.running_mean"], r1["buffers"]["stem.1.running_mean"]
    )


def test_accumulate_inside_and_outside_sharded(tmp_path):
    sw.run("accumulate", tmp_path, 2)
    m = sw.model()
    tx = fg.accumulate(sw.make_tx(m), 2)
    want, _ = sw.train(m, tx, fg.make_step(sw.loss_fn(m), tx, donate=True), 0, 1)
    for rank in (0, 1):
        got = load(tmp_path, "accumulate", rank)
        for where in ("inside", "outside"):
            for k, v in want.items():
                torch.testing.assert_close(got[where][k], v, rtol=1e-12, atol=1e-12)


# Each counterfactual undoes one piece of fg.sharded in the workers and shows that the
# equality test above would then fail: the norm that the "after" monitor records moves.
# Split by rows over 2 ranks, rank 1 holds rows 2-3 of fc1 (all zero); in flat chunks
# over 3 ranks (32 entries, 11 per rank), rank 1 holds fc1.bias[2:4] (zero) and no
# entry of fc1.weight: both make one rank's part of fc1 all-zero while fc1 is not.
COUNTERFACTUALS = {
    # Statistics left per rank: rank 1 sees its part of fc1 all-zero and fills it
    # with 1.0 instead of 0.5 (fc1's norm becomes the clip's 2.0 instead of ~1.34 by
    # rows; ~1.82 in chunks, where rank 1's part is two entries).
    ("per_shard", "rows"): ("fc1", 0.5),
    ("per_shard", "chunks"): ("fc1", 0.3),
    # nested_rule clips the seed rule's output. Combining all its statistics in one
    # collective (as funcgrad's own rules are) would clip by the norm of the first,
    # uncombined pass, where rank 1 filled its all-zero rows with 1.0. (Rows only: in
    # chunks rank 1's two entries do not lift fc1's norm over the clip; the batching
    # is the same code for both.)
    ("nested_batched", "rows"): ("fc1", 0.1),
    # custom_rule is no shard-safe Rule, so fg.per_group gathers fc2 before applying
    # it; applied to each rank's part instead, it computes another total.
    ("custom_on_shards", "rows"): ("fc2", 1e-3),
    ("custom_on_shards", "chunks"): ("fc2", 0.1),
}


@pytest.mark.parametrize(("mode", "split"), COUNTERFACTUALS)
def test_without_each_piece_of_sharding_the_result_would_differ(mode, split, reference, tmp_path):
    group, at_least = COUNTERFACTUALS[mode, split]
    world, mode = (2, mode + sw.ROWS) if split == "rows" else (3, mode)
    sw.run(mode, tmp_path, world)
    want = reference[1]["after"].stats[group]["norm"]
    for rank in range(world):
        got = load(tmp_path, mode, rank)
        assert got["split"] == ("Ranks" if split == "rows" else "Chunks")
        assert abs(float(got["monitor"]["after"][group]["norm"]) - float(want)) > at_least


@pytest.mark.parametrize(
    ("mode", "world", "message"),
    [
        # Rank 1 raises after init; rank 0's first collective sees it go (which of
        # the two errors arrives first is a race: either means nobody hung).
        ("raise", 2, r"rank 1 failed on purpose|Connection closed|Connection reset"),
        (
            "mismatch_model",
            2,
            r"rank 1 differs from rank 0 at parameter 'fc1\.weight': rank 0 has \(4, 2\) "
            r"torch\.float64, rank 1 has \(5, 2\)",
        ),
        ("mismatch_tx", 3, r"rank 2 differs from rank 0 at tx's state entry .*nu_max"),
        ("mismatch_values", 2, r"rank 1 differs from rank 0 at the values of parameter"),
    ],
)
def test_failing_or_mismatched_ranks_end_all_ranks_with_a_clear_error(
    mode, world, message, tmp_path
):
    t0 = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match=message):
        sw.run(mode, tmp_path, world, deadline_s=60)
    assert time.monotonic() - t0 < 60
    assert not mp.active_children()


def test_a_stalled_rank_ends_the_others_within_the_timeout(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match=r"[Tt]imed out|[Tt]imeout"):
        sw.run("stall", tmp_path, 2, deadline_s=90)
    assert time.monotonic() - t0 < 60
    assert not mp.active_children()


def test_checkpoint_from_2_ranks_loads_into_3_ranks_and_into_one_process(tmp_path):
    """Save at step 4 on 2 ranks (fg.save_checkpoint of a state in flat chunks), then
    continue: on the same 2 ranks (uninterrupted), on 3 ranks (in chunks, and split
    by rows), on 2 ranks again (resumed), and unsharded in this process."""
    sw.run("save", tmp_path, 2)
    sw.run("load", tmp_path, 3)
    sw.run("load" + sw.ROWS, tmp_path, 3)  # the same checkpoint, split by rows
    saved = load(tmp_path, "save", 0)
    assert saved["split"] == "Chunks"
    want = dict(tensor_paths(saved["saved_state"]))
    for mode in ("load", "load" + sw.ROWS):
        resumed = load(tmp_path, mode, 2)
        assert resumed["split"] == ("Ranks" if mode.endswith(sw.ROWS) else "Chunks")
        # The state that 3 ranks rebuilt is the state 2 ranks saved, bit for bit.
        have = dict(tensor_paths(resumed["loaded_state"]))
        assert want.keys() == have.keys()
        for k in want:
            torch.testing.assert_close(have[k], want[k], rtol=0, atol=0, equal_nan=True)
        for k, v in saved["params"].items():
            torch.testing.assert_close(resumed["params"][k], v, rtol=1e-12, atol=1e-12)
    # Back on 2 ranks, the resumed run is the uninterrupted one, bit for bit.
    sw.run("load", tmp_path, 2)
    for rank in (0, 1):
        again = load(tmp_path, "load", rank)
        for k, v in load(tmp_path, "save", rank)["params"].items():
            assert torch.equal(again["params"][k], v), k
    # One process, plain tx: DCP reads the whole tensors without a process group.
    m = sw.model()
    tx = sw.make_tx(m)
    params = fg.params(m)
    params, state, _ = fg.load_checkpoint(tmp_path / "ckpt", params, tx)
    params, _ = single_process(range(sw.NAN_STEP + 1, sw.STEPS), params, state)
    for k, v in saved["params"].items():
        torch.testing.assert_close(params[k], v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(), (1,), (2,), (3, 4), (4, 3), (5, 2, 2), (0, 3), (7,)])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_rows_are_torch_chunk_and_pad_round_trip(shape, world):
    t = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float64)
    t = t[: torch.Size(shape).numel()].reshape(shape)
    as_rows = t.reshape(-1) if t.dim() == 0 else t
    chunks = list(torch.chunk(as_rows, world)) if as_rows.shape[0] else []
    blocks = []
    for r in range(world):
        rows = _split.Rows(tuple(shape), r, world)
        want = chunks[r] if r < len(chunks) else as_rows[:0]
        assert torch.equal(rows.local(t), want)
        assert torch.equal(rows.unpad_local(rows.pad_local(rows.local(t))), want)
        blocks.append(rows.pad_local(rows.local(t)))
        assert torch.equal(rows.padded(t)[r], blocks[-1])
    assert torch.equal(_split.Rows(tuple(shape), 0, world).whole(torch.stack(blocks)), t)


def test_shard_safety_of_rules_and_conditions():
    from funcgrad.rules import _rule_base as rb

    assert rules.zero_fix().shard_safe and rules.clip_norm(1.0).shard_safe
    assert (rules.all_zero() | ~rules.any_nonfinite()).shard_safe
    assert rules.when(rules.norm_above(1.0), rules.scale(0.5)).shard_safe
    mine = rules.Condition(lambda g: g["w"].sum() > 0, "mine")
    assert not (rules.all_zero() & mine).shard_safe
    assert not rules.when(mine, rules.fill(0.0)).shard_safe
    mine_safe = rules.Rule(lambda g: dict(g), "r", shard_safe=True)
    assert mine_safe.shard_safe
    # One collective for all statistics only where each is of the rule's input group.
    assert rb.reads_input_only(rules.zero_fix()) and rb.reads_input_only(~rules.any_zero())
    assert not rb.reads_input_only(mine_safe)
    assert not rb.reads_input_only(rules.when(rules.all_zero(), mine_safe))


def test_statistics_outside_sharded_are_local():
    g = {"w": torch.tensor([0.0, 3.0]), "b": torch.tensor([4.0])}
    from funcgrad.rules import _rule_base as rb

    assert rb.shards() is None
    assert rb.group_size(g) == 3 and int(rb.zero_count(g)) == 1
    assert float(rb.group_norm(g)) == 5.0


def test_the_ranks_in_force_are_per_thread():
    """fg.sharded's ranks are in force only in the thread running its update."""
    import threading

    from funcgrad.rules import _rule_base as rb

    seen = []
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(5)
        seen.append(rb.shards())
        done.set()

    t = threading.Thread(target=other)
    t.start()
    marker = object()
    with rb.active(marker):  # type: ignore[arg-type]
        inside.set()
        done.wait(5)
        assert rb.shards() is marker
    t.join(5)
    assert seen == [None] and rb.shards() is None


def test_a_state_keeps_its_layout_when_the_transformation_is_initialized_again(one_rank):
    """The rows layout lives in each state's type, one class per distinct layout: a
    second init for other parameters makes a state of its own and leaves the first
    one's layout alone (it used to re-point a class attribute shared by both, and the
    first state's next update was refused); an equal layout gives the same class, so
    a compiled step does not recompile after fg.load_state_dict."""
    D = torch.float64
    tx = fg.sharded(fg.adam(lr=0.1))
    small = {"w": torch.tensor([1.0, -2.0], dtype=D)}
    large = {"w": torch.arange(6, dtype=D).reshape(3, 2), "b": torch.ones(3, dtype=D)}
    s_small = tx.init(small)
    s_large = tx.init(large)
    assert type(s_small) is not type(s_large)
    assert type(tx.init(small)) is type(s_small)
    g = {"w": torch.tensor([0.5, 0.0], dtype=D)}
    got, _ = tx.update(g, s_small, small)
    want, _ = fg.adam(lr=0.1).update(g, fg.adam(lr=0.1).init(small), small)
    torch.testing.assert_close(got["w"], want["w"], rtol=0, atol=0)
    gl = {k: torch.full_like(v, 0.25) for k, v in large.items()}
    got, _ = tx.update(gl, s_large, large)
    want, _ = fg.adam(lr=0.1).update(gl, fg.adam(lr=0.1).init(large), large)
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    def loss(p, x):
        return (p["w"] * x).sum() ** 2

    step = fg.make_step(loss, tx, compile={"backend": "aot_eager"}, donate=True)
    params = {"w": torch.tensor([1.0, -2.0], dtype=D)}
    state = tx.init(params)
    torch._dynamo.reset()
    counters.clear()
    x = torch.tensor([0.5, 1.5], dtype=D)
    params, state, _ = step(params, state, x)
    state = fg.load_state_dict(tx, params, fg.state_dict(state))  # a second init inside
    tx.init(large)  # another layout made meanwhile changes nothing for this state
    params, state, _ = step(params, state, x)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("capped", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_flat_chunks_are_equal_runs_that_cover_each_buffer(world, capped, monkeypatch):
    """ZeRO's split: each buffer in ceil(n / N) entries per rank (the last ones shorter
    or empty); each parameter's pieces, rank after rank, are its entries in order.
    ``capped``: CPU buffers of at most 64 bytes, so one dtype has several buffers."""
    if capped:
        monkeypatch.setattr(fg.core._layout, "CPU_BUCKET_BYTES", 64)
    D = torch.float64
    named = {
        "t": torch.tensor(2.0, dtype=D),  # 0-d
        "w": torch.arange(12, dtype=D).reshape(3, 4),
        "h": torch.arange(5, dtype=torch.float32),  # a second buffer (other dtype)
        "e": torch.zeros(0, 3, dtype=D),  # empty
        "b": torch.arange(7, dtype=D),
    }
    flat = fg.core._flat.pack(named, fg.core._flat.Layout.for_tensors(named))
    want = [["t", "w", "e", "b"], ["h"]] if not capped else [["t"], ["w"], ["h"], ["e", "b"]]
    assert [list(m) for m in flat.layout.members] == want
    monkeypatch.setattr(_shard.dist, "get_world_size", lambda group=None: world)
    parts = []
    for rank in range(world):
        monkeypatch.setattr(_shard.dist, "get_rank", lambda group=None, r=rank: r)
        parts.append(_split.Chunks(SimpleNamespace(group_name="stand-in"), flat.layout))
    for b, n in enumerate(flat.layout.sizes):
        c = -(-n // world)
        spans = [ch.span(ch.rank, b) for ch in parts]
        assert [hi - lo for lo, hi in spans] == [max(0, min(c, n - r * c)) for r in range(world)]
        assert [ch.mine.sizes[b] for ch in parts] == [hi - lo for lo, hi in spans]
    for k, t in named.items():
        runs = [ch.piece(ch.rank, k) for ch in parts]
        assert runs[0][0] == 0 and runs[-1][1] == t.numel()
        assert all(a == e0 for (_, e0), (a, _) in itertools.pairwise(runs))
        pieces = [ch.local(flat)[k] for ch in parts]
        assert torch.equal(torch.cat(pieces), t.reshape(-1))
        assert all(p.dim() == 1 for p in pieces)
        # the same pieces from per-name tensors (a plain dict of the whole tensors)
        assert all(torch.equal(ch.local(named)[k], p) for ch, p in zip(parts, pieces, strict=True))


def test_which_split_fg_sharded_takes(one_rank):
    """Flat chunks for fg.params and transformations that never read a shape; rows
    for a plain dict, Adafactor (factored moments), Muon (matrices), and masks or
    labels given as functions (which may decide from shapes)."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    groups = fg.group_by_module(m)
    flat, plain = fg.params(m), {k: v.clone() for k, v in fg.params(m).items()}

    def split(tx, params=flat):
        return type(type(fg.sharded(tx).init(params)).layout.ranks).__name__

    rule_chain = fg.chain(
        fg.monitor(groups),
        fg.per_group(fg.rules.zero_fix(), groups),
        fg.clip_by_global_norm(1.0),
        fg.skip_if_nonfinite(fg.adamw(mask={k: k.endswith("weight") for k in flat})),
    )
    for tx in (rule_chain, fg.accumulate(fg.sgd(lr=0.1), 2), fg.lion(), fg.rmsprop()):
        assert split(tx) == "Chunks"
    assert split(rule_chain, plain) == "Ranks"
    shapes_read = (
        fg.adamw(mask=lambda name, p: p.ndim > 1),
        fg.adafactor(),
        fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adafactor()),
        fg.partition({"a": fg.adam(), "s": fg.sgd(lr=0.1)}, lambda p: dict.fromkeys(p, "a")),
    )
    for tx in shapes_read:
        assert split(tx) == "Ranks"


def test_half_precision_buffers_in_chunks_equal_one_process(tmp_path):
    """bfloat16, float16 and float32 parameters (one flat buffer each, odd lengths,
    2-byte entries) in flat chunks on 2 ranks: every gradient is exact in its dtype
    (tests/workers/shard_workers.py's half_run), so the ranks' parameters and state
    equal one process on the full batch bit for bit."""
    sw.run("half", tmp_path, 2)
    want = sw.half_run(0, 1, sharded=False)
    assert want["buffers"] == [torch.bfloat16, torch.float32, torch.float16]
    for rank in (0, 1):
        got = load(tmp_path, "half", rank)
        assert got["split"] == "Chunks" and got["buffers"] == want["buffers"]
        assert want["params"].keys() == got["params"].keys()
        for k, v in want["params"].items():
            assert got["params"][k].dtype == v.dtype, k
            torch.testing.assert_close(got["params"][k], v, rtol=0, atol=0)
        assert want["state"].keys() == got["state"].keys()
        for k, v in want["state"].items():
            torch.testing.assert_close(got["state"][k], v, rtol=0, atol=0)
    # The rule did its work: c's gradient, all zero, was set to 1.0 (Adam moved c).
    torch.manual_seed(0)
    assert not torch.equal(want["params"]["c.weight"], sw.HalfNet().c.weight)
