"""Workers for distributed checkpoints with the single-file guarantees (#23 item 9):
``fg.save_checkpoint`` / ``fg.load_checkpoint`` of FSDP2 models with their
``fg.Optimizer`` (fsdp_workers' model) on gloo ranks, and of ``fg.sharded`` state.

Each load-side mode records, per rank, the live parameters and funcgrad state (whole
tensors) before and after the attempt and the error it raised, if any."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import funcgrad as fg
from funcgrad.core._tree import leaves_with_paths
from workers import fsdp_workers as fw
from workers.dist_workers import destroy


def snapshot(m, opt) -> dict[str, torch.Tensor]:
    """Whole parameters and state (collective: DTensors are gathered)."""
    out = {f"param {k}": fw.whole(v) for k, v in m.named_parameters()}
    for path, leaf in leaves_with_paths(fg.state_dict(opt.tx_state)):
        if isinstance(leaf, torch.Tensor):
            out[f"state {path}"] = fw.whole(leaf)
    return out


def _die_after_writing() -> None:
    """This rank dies (SIGKILL-like, no cleanup) once its shard file is on disk."""
    original = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):  # type: ignore[no-untyped-def]
        fut = original(self, plan, planner)
        fut.wait()
        os._exit(17)

    dcp.FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]


def _die_after_publishing() -> None:
    """Rank 0 dies once LATEST names the new checkpoint, before telling the others."""
    from funcgrad.distributed import _checkpoint as _dcheckpoint

    original = _dcheckpoint._publish

    def publish_then_die(*args):  # type: ignore[no-untyped-def]
        original(*args)
        os._exit(18)

    _dcheckpoint._publish = publish_then_die


def worker(rank: int, world: int, port: int, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=30 if mode.startswith("kill") else 120),
    )  # fmt: skip
    root = os.path.join(out, "ckpt")
    result: dict = {}
    try:
        m = fw.sharded_model(world)
        opt = fg.Optimizer(m, fw.make_tx(m))
        if mode == "save":  # a checkpoint after step 1 and after step 2, then 2 more steps
            fw.train(m, opt, rank, world, range(1))
            fg.save_checkpoint(root, m, opt, step=1)
            fw.train(m, opt, rank, world, range(1, 2))
            fg.save_checkpoint(root, m, opt, step=2)
            result["at2"] = snapshot(m, opt)
            fw.train(m, opt, rank, world, range(2, fw.STEPS))
            result["at4"] = snapshot(m, opt)
        elif mode == "save_broken":  # rank 1's rows of a second moment made negative
            fw.train(m, opt, rank, world, range(2))
            if rank == 1:
                with torch.no_grad():
                    opt.tx_state["adamw"].nu["2.weight"].to_local().fill_(-1.0)
            fg.save_checkpoint(root, m, opt, step=2)
        elif mode in ("kill", "kill0"):  # one step, then a save over the published one
            fw.train(m, opt, rank, world, range(1))  # during which a rank dies
            if rank == 1 and mode == "kill":
                _die_after_writing()
            if rank == 0 and mode == "kill0":
                _die_after_publishing()
            try:
                fg.save_checkpoint(root, m, opt, step=fw.STEPS)
            except Exception as err:
                result["error"] = (type(err).__name__, str(err))
            torch.save(result, Path(out) / f"{mode}-rank{rank}.pt")
            return  # the group is broken: no barrier
        elif mode in ("load", "load_fault"):
            if mode == "load_fault":  # live values that differ from the checkpoint's
                fw.train(m, opt, rank, world, range(1))
            result["before"] = snapshot(m, opt)
            try:
                _, _, result["extra"] = fg.load_checkpoint(root, m, opt)
            except Exception as err:  # a funcgrad error: an Exception, not a BaseException
                result["error"] = (type(err).__name__, str(err))
            result["after"] = snapshot(m, opt)
            if mode == "load":  # resume the second half
                fw.train(m, opt, rank, world, range(2, fw.STEPS))
                result["resumed"] = snapshot(m, opt)
        torch.save(result, Path(out) / f"{mode}-{world}-rank{rank}.pt")
        dist.barrier()
    finally:
        if not mode.startswith("kill"):
            destroy(rank, out, check=False)  # FSDP2 (torch) keeps the group
