"""Distributed checkpoints with the single-file guarantees (#23 item 9), on 2 gloo ranks:
``fg.save_checkpoint(root, model, opt)`` of an FSDP2 model and its ``fg.Optimizer``, and
``fg.load_checkpoint(root, model, opt)``. One test per fault seen with plain DCP: flipped
bytes in a shard file, a broken invariant, a truncated shard (torch's own error), a rank
killed while saving over the previous checkpoint. Each load that fails raises a
funcgrad error (an ``Exception``) on every rank and changes nothing."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from workers import dckpt_workers as dw
from workers.dist_workers import free_port, spawn


def _results(out: Path, mode: str, world: int) -> list[dict]:
    return [
        torch.load(out / f"{mode}-{world}-rank{r}.pt", weights_only=False) for r in range(world)
    ]


def _assert_same(a: dict, b: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, equal_nan=True, msg=k)


def _published(root: Path) -> Path:
    return root / (root / "LATEST").read_text().strip()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """2 ranks: a checkpoint after step 1, one after step 2 (published), 2 more steps."""
    out = tmp_path_factory.mktemp("dckpt")
    spawn(dw.worker, "save", out, 2, 240.0)
    return out, torch.load(out / "save-2-rank0.pt", weights_only=False)


def _copy(saved, tmp_path: Path) -> Path:
    shutil.copytree(saved[0] / "ckpt", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _load_fails_and_changes_nothing(tmp_path: Path, fragment: str) -> None:
    spawn(dw.worker, "load_fault", tmp_path, 2, 240.0)
    for r in _results(tmp_path, "load_fault", 2):
        assert "error" in r, "the load should have failed"
        kind, text = r["error"]
        assert kind == "ValueError" and fragment in text, text
        _assert_same(r["after"], r["before"])


def test_a_save_publishes_its_directory_and_removes_the_older(saved):
    root = saved[0] / "ckpt"
    dirs = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert dirs == [_published(root).name] and dirs[0].startswith("ckpt-000002-")
    files = {p.name for p in _published(root).iterdir()}
    assert files == {"__0_0.distcp", "__1_0.distcp", ".metadata", "extra.pt",
                     "funcgrad-manifest.json"}  # fmt: skip


@pytest.mark.parametrize("world", [2, 1, 3])
def test_resumes_on_any_number_of_ranks_like_the_uninterrupted_run(saved, tmp_path, world):
    _copy(saved, tmp_path)
    spawn(dw.worker, "load", tmp_path, world, 240.0)
    at2, at4 = saved[1]["at2"], saved[1]["at4"]
    for r in _results(tmp_path, "load", world):
        assert "error" not in r, r.get("error")
        assert r["extra"] == {"step": 2}
        _assert_same(r["after"], at2)  # what was saved, bit for bit
        if world == 2:  # the same ranks: the uninterrupted run, bit for bit
            _assert_same(r["resumed"], at4)
        else:  # the mean gradient summed in another order; float32 statistics
            _assert_same(r["resumed"], at4, rtol=1e-6, atol=1e-7)


def test_flipped_bytes_in_a_shard_file(saved, tmp_path):
    shard = _published(_copy(saved, tmp_path)) / "__1_0.distcp"
    blob = bytearray(shard.read_bytes())
    for i in range(len(blob) // 2, len(blob) // 2 + 8):
        blob[i] ^= 0xFF
    shard.write_bytes(bytes(blob))
    _load_fails_and_changes_nothing(
        tmp_path, "__1_0.distcp' is damaged: its SHA-256 checksum does not match the manifest"
    )


def test_a_truncated_shard_file(saved, tmp_path):
    shard = _published(_copy(saved, tmp_path)) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _load_fails_and_changes_nothing(tmp_path, "__0_0.distcp' is damaged")


def test_a_shard_damaged_before_its_checksum_arrives_as_a_funcgrad_error(saved, tmp_path):
    """torch's CheckpointException (a BaseException) becomes a ValueError: the manifest
    is rewritten to match a truncated file, as if it had been damaged before saving."""
    sub = _published(_copy(saved, tmp_path))
    shard = sub / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    manifest = json.loads((sub / "funcgrad-manifest.json").read_text())
    manifest["files"]["__0_0.distcp"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (sub / "funcgrad-manifest.json").write_text(json.dumps(manifest))
    _load_fails_and_changes_nothing(tmp_path, "torch.distributed.checkpoint could not read")


def test_a_broken_invariant_is_reported_before_any_live_value_changes(tmp_path):
    spawn(dw.worker, "save_broken", tmp_path, 2, 240.0)
    _load_fails_and_changes_nothing(tmp_path, "never does")


def _run_kill(mode: str, tmp_path: Path) -> list:
    ctx = mp.start_processes(
        dw.worker, args=(2, free_port(), mode, str(tmp_path)), nprocs=2, join=False,
        start_method="spawn",
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        for p in ctx.processes:
            p.join(max(1.0, 120.0 - (time.monotonic() - t0)))
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return ctx.processes


def test_rank0_killed_after_publishing_tells_the_others_it_was_published(saved, tmp_path):
    """Before: rank 1 got gloo's bare 'Connection closed by peer'. Now its error says
    the save was published (LATEST names it) and it loads whole."""
    root = _copy(saved, tmp_path)
    before = _published(root).name
    processes = _run_kill("kill0", tmp_path)
    assert processes[0].exitcode == 18  # rank 0 died right after publishing
    latest = _published(root)
    assert latest.name != before
    kind, text = torch.load(tmp_path / "kill0-rank1.pt", weights_only=False)["error"]
    assert kind == "RuntimeError" and "a collective failed while saving" in text, text
    assert f"this save was published ({str(latest)!r}, whole: LATEST names it)" in text, text
    spawn(dw.worker, "load", tmp_path, 2, 240.0)
    for r in _results(tmp_path, "load", 2):
        assert "error" not in r, r.get("error")
        assert r["extra"] == {"step": dw.fw.STEPS}


def test_a_rank_killed_while_saving_over_the_previous_checkpoint_leaves_it_whole(saved, tmp_path):
    root = _copy(saved, tmp_path)
    before = _published(root).name
    ctx = mp.start_processes(
        dw.worker, args=(2, free_port(), "kill", str(tmp_path)), nprocs=2, join=False,
        start_method="spawn",
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        for p in ctx.processes:
            p.join(max(1.0, 120.0 - (time.monotonic() - t0)))
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert ctx.processes[1].exitcode == 17  # rank 1 died after writing its shard
    assert _published(root).name == before  # nothing new was published
    assert len([p for p in root.iterdir() if p.is_dir()]) == 2  # the unfinished save
    # rank 0 learnt of it as a funcgrad error naming the checkpoint that still holds
    kind, text = torch.load(tmp_path / "kill-rank0.pt", weights_only=False)["error"]
    assert kind == "ValueError" and f"{before}' is still the checkpoint" in text, text
    assert "fg.save_checkpoint: torch.distributed.checkpoint failed to write" in text
    # the previous checkpoint loads whole: step 2's values, bit for bit
    spawn(dw.worker, "load", tmp_path, 2, 240.0)
    for r in _results(tmp_path, "load", 2):
        assert "error" not in r, r.get("error")
        _assert_same(r["after"], saved[1]["at2"])
        assert r["extra"] == {"step": 2}
