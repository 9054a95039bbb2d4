"""Data-parallel steps on 2 gloo ranks (spawned, loopback) against one process."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp
from workers.dist_workers import make, model_and_data, run_ranks, train

import funcgrad as fg


def single_process(x, y):
    model, _, _ = model_and_data()
    tx, step = make(model, distributed=False, compiled=False)
    return train(model, tx, step, x, y)


def test_setup_has_a_layer_all_zero_on_one_rank_only():
    model, x, y = model_and_data()

    def loss(p, x, y):
        return ((fg.call(model, p, x) - y) ** 2).mean()

    g_rank0 = torch.func.grad(loss)(fg.params(model), x[:4], y[:4])
    g_full = torch.func.grad(loss)(fg.params(model), x, y)
    assert (g_rank0["0.weight"] == 0).all() and (g_rank0["0.bias"] == 0).all()
    assert (g_full["0.weight"] != 0).any()


@pytest.mark.parametrize("mode", ["eager", "compiled", "async", "async_sharded"])
def test_two_ranks_equal_one_process_on_the_full_batch(mode, tmp_path):
    """async: compile="async" with inductor, each rank's build done at another step
    (2 and 6); both switch at the same step, and the result is the one process's.
    async_sharded: the same with fg.sharded (reduce-scatter, all-gather) in place of
    fg.all_reduce_mean."""
    run_ranks(mode, tmp_path)
    _, x, y = model_and_data()
    want = single_process(x, y)
    # Applying the rule per rank (rank 0's shard alone) gives another answer.
    per_rank = single_process(x[:4], y[:4])
    assert not torch.allclose(per_rank["0.weight"], want["0.weight"])
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for k in want:
            torch.testing.assert_close(got["params"][k], want[k], rtol=1e-12, atol=1e-12)
        if mode == "compiled":
            assert {k: got["stats"][k] for k in ("graphs", "breaks")} == {"graphs": 1, "breaks": 0}
        paths = got["stats"]["paths"]
        if mode.startswith("async"):
            switch = paths.index(True)
            assert switch >= 6 and all(paths[switch:]) and not any(paths[:switch])
        else:
            assert paths == [mode == "compiled"] * len(paths)
    stats = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True)["stats"] for r in (0, 1)]
    # destroy_process_group freed the group while tx and the step were alive
    assert [(tmp_path / f"rank{r}.freed").read_text() for r in (0, 1)] == ["True", "True"]
    if mode.startswith("async"):  # the same step on both ranks
        assert stats[0]["paths"] == stats[1]["paths"]
    assert stats[0]["warnings"] == stats[1]["warnings"] == []


def test_async_build_failing_on_one_rank_keeps_every_rank_eager(tmp_path):
    """compile="async" where rank 1's build raises: both ranks learn it at the same
    step, warn once (rank 1 with its error, rank 0 pointing to the other rank) and
    train eagerly to the one process's result."""
    run_ranks("async_one_fails", tmp_path)
    _, x, y = model_and_data()
    want = single_process(x, y)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for k in want:
            torch.testing.assert_close(got["params"][k], want[k], rtol=1e-12, atol=1e-12)
        assert not any(got["stats"]["paths"])
        (message,) = got["stats"]["warnings"]
        assert "the step goes on eagerly" in message
        expected = ("failed on another rank", "rank 1's build failed on purpose")[rank]
        assert expected in message


def test_a_failing_rank_does_not_hang(tmp_path):
    # Either rank 1's own error, or rank 0's collective failing because rank 1 went
    # away, is reported first (a race): both mean nobody hung.
    with pytest.raises(
        mp.ProcessRaisedException, match=r"rank 1 failed on purpose|Connection closed"
    ):
        run_ranks("raise", tmp_path, deadline_s=60)
    assert not mp.active_children()  # rank 0 was stopped, not left waiting


def test_a_stalled_rank_ends_the_others_within_the_timeout(tmp_path):
    """Rank 1 stays alive but never reaches the collective. With the process group's
    timeout (5 s here), rank 0's all-reduce fails with gloo's timeout message
    instead of waiting forever (the default timeout is 30 minutes)."""
    t0 = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match=r"[Tt]imed out|[Tt]imeout"):
        run_ranks("stall", tmp_path, deadline_s=90)
    assert time.monotonic() - t0 < 60
    assert not mp.active_children()


def test_all_reduce_mean_outside_a_process_group():
    tx = fg.all_reduce_mean(noop_if_not_initialized=True)
    g = {"w": torch.ones(2)}
    assert tx.update(g, tx.init(g))[0] is g


def test_a_transformation_of_a_destroyed_group_says_so(one_rank):
    """fg.all_reduce_mean, and a sharded state's layout (its class lives in a module),
    hold a group passed to them weakly: they do not keep a destroyed group alive, and
    used after it is gone they say what happened instead of a torch error."""
    import gc
    import weakref

    import torch.distributed as dist

    sub = dist.new_group([0])
    alive = weakref.ref(sub)
    mean = fg.all_reduce_mean(sub)
    g = {"w": torch.ones(2)}
    state = fg.sharded(fg.adam(lr=0.1), group=sub).init(g)  # its tx dropped
    assert torch.equal(mean.update(g, mean.init(g))[0]["w"], g["w"])
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    assert alive() is None
    for use in (lambda: mean.update(g, mean.init(g)), lambda: fg.state_dict(state)):
        with pytest.raises(RuntimeError, match="was built for no longer exists"):
            use()
