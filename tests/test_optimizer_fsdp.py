"""fg.Optimizer on FSDP2 (``fully_shard``, DTensor parameters) over gloo ranks: equal to
one process on the full batch, the rule and monitor on the global group."""

from __future__ import annotations

import pytest
import torch
from workers import fsdp_workers as fw
from workers.dist_workers import spawn

import funcgrad as fg


@pytest.fixture(scope="module")
def reference():
    m = fw.model()
    opt = fg.Optimizer(m, fw.make_tx(m))
    fw.train(m, opt, 0, 1, range(fw.STEPS))
    params = {k: p.detach().clone() for k, p in m.named_parameters()}
    return params, opt.tx_state


def _check(got, reference):
    params, state = reference
    for k in params:
        torch.testing.assert_close(got["params"][k], params[k], rtol=1e-10, atol=1e-12)
    for g, stats in state["monitor"].stats.items():
        for s, v in stats.items():  # float32 statistics: summed across shards
            torch.testing.assert_close(got["stats"][g][s], v, rtol=1e-6, atol=1e-7)
    assert got["count"] == fw.STEPS
    assert got["partial"] == []


def test_two_ranks_equal_one_process_and_the_rule_sees_the_whole_layer(tmp_path, reference):
    """Rank 1's shard of layer 0 is all-zero, the layer is not: the rule's decision and
    monitor's statistics are those of the whole layer (DTensor reductions are global)."""
    m = fw.model()
    x, _ = fw.batches()[0]
    with torch.no_grad():
        hidden = torch.relu(m[0](x))
    assert (hidden[:, 2:] == 0).all() and (hidden[:, :2] != 0).any()
    spawn(fw.worker, "train", tmp_path, 2, 240.0)
    for rank in range(2):
        _check(torch.load(tmp_path / f"train-2-rank{rank}.pt", weights_only=False), reference)
    _, state = reference
    assert not bool(state["monitor"].stats["0"]["all_zero"])


# DCP checkpoints of fg.Optimizer on FSDP2, resumed on 1, 2 and 3 ranks, and their
# faults: tests/test_distributed_checkpoint.py (fg.save_checkpoint / fg.load_checkpoint).
