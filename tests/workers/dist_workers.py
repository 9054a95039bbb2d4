"""Worker processes for the torch.distributed tests (spawned, gloo, loopback only)."""

from __future__ import annotations

import faulthandler
import gc
import os
import socket
import sys
import time
import warnings
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch._dynamo.utils import counters

import funcgrad as fg

STEPS = 10

# Set by destroy(check=False): torch itself keeps this rank's group (FSDP2, DTensor caches).
_TORCH_KEEPS_GROUP = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_and_data():
    """A seed-shaped model whose first layer is dead on negative inputs: with the
    negative half of the batch on rank 0, fc1 is all-zero there but not globally."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1, 2), nn.ReLU(), nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    m = m.double()
    with torch.no_grad():
        m[0].weight.copy_(torch.tensor([[1.0], [0.5]]))
        m[0].bias.zero_()
        m[2].bias.fill_(0.1)
    x = torch.tensor(
        [[-1.0], [-2.0], [-0.5], [-3.0], [1.0], [2.0], [0.5], [3.0]], dtype=torch.float64
    )
    y = torch.linspace(-1, 1, 8, dtype=torch.float64).unsqueeze(1)
    return m, x, y


def make(model, distributed: bool, compiled: bool | str, sharded: bool = False):
    groups = fg.group_by_module(model)
    head = [fg.all_reduce_mean()] if distributed and not sharded else []
    tx = fg.chain(*head, fg.per_group(fg.rules.zero_fix(), groups), fg.adam(lr=0.05))
    if sharded:  # ZeRO-2: reduce-scatter, the rule and Adam on this rank's chunk, gather
        tx = fg.sharded(tx)

    def loss(p, x, y):
        return ((fg.call(model, p, x) - y) ** 2).mean()

    if compiled == "async":  # with inductor
        compile: bool | str | dict = "async"
    else:
        compile = {"backend": "aot_eager"} if compiled else False
    step = fg.make_step(loss, tx, compile=compile, donate=True)
    return tx, step


def train(model, tx, step, x, y, wait_at=None, paths=None) -> dict[str, torch.Tensor]:
    params = fg.params(model)
    state = tx.init(params)
    for i in range(STEPS):
        if i == wait_at:  # this rank's build is done before this step
            step.wait_compiled(600)
        step(params, state, x, y)
        if paths is not None:
            paths.append(step.is_compiled)
    return {k: v.clone() for k, v in params.items()}


def worker(rank: int, world: int, port: int, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    timeout = timedelta(seconds=5 if mode in ("raise", "stall") else 60)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout
    )
    try:
        if mode == "raise" and rank == 1:
            raise RuntimeError("rank 1 failed on purpose")
        if mode == "stall" and rank == 1:
            time.sleep(3600)  # alive but never reaches the collective
        model, x, y = model_and_data()
        shard = slice(rank * 4, rank * 4 + 4)
        counters.clear()
        compiled = "async" if mode.startswith("async") else mode == "compiled"
        if mode.startswith("async") and rank == 1:
            import funcgrad._compat as compat

            build = compat.compile_without_running

            def late(*a, **k):  # rank 1's build ends late, for sure, or fails
                time.sleep(5)
                if mode == "async_one_fails":
                    raise RuntimeError("rank 1's build failed on purpose")
                return build(*a, **k)

            compat.compile_without_running = late
        tx, step = make(
            model, distributed=True, compiled=compiled, sharded=mode.endswith("sharded")
        )
        # async: the ranks' builds end at different steps (rank 0 waits for its own
        # at step 2, rank 1's, 5 s late, at step 6); they must switch together, after 6.
        paths: list[bool] = []
        wait_at = (2, 6)[rank] if mode in ("async", "async_sharded") else None
        if mode == "async_one_fails":
            wait_at = 2  # rank 1's wait returns False (its build failed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            params = train(model, tx, step, x[shard], y[shard], wait_at, paths)
        stats = {
            "warnings": [str(w.message) for w in caught if 'compile="async"' in str(w.message)],
            "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values()),
            "paths": paths,
        }
        torch.save({"params": params, "stats": stats}, Path(out) / f"rank{rank}.pt")
    finally:
        destroy(rank, out)


def destroy(rank: int, out: str, check: bool = True) -> None:
    """``destroy_process_group``, with the worker's tx, state and (compiled) step still
    alive, as at the end of a script; records whether it freed the group (else gloo's
    threads run on into interpreter exit, a rare SIGABRT there: funcgrad/_compat.py).
    :func:`spawn` checks the record. ``check=False`` where torch itself keeps the
    group (FSDP2's DTensors: docs/compile-notes.md, "Torch bugs")."""
    global _TORCH_KEEPS_GROUP
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    _TORCH_KEEPS_GROUP = not check
    if check:
        gc.collect()
        (Path(out) / f"rank{rank}.freed").write_text(str(world() is None))


def run_ranks(mode: str, out: Path, world: int = 2, deadline_s: float = 180.0) -> float:
    """Spawn ``world`` workers and wait with a hard deadline; never leave strays."""
    return spawn(worker, mode, out, world, deadline_s)


def _traced(rank: int, fn, *args) -> None:
    """``fn(rank, *args)`` with faulthandler on: a worker killed by a signal (SIGSEGV,
    SIGABRT from glibc's heap checks) prints every thread's Python stack to stderr,
    which pytest shows with the failure."""
    faulthandler.enable(all_threads=True)
    fn(rank, *args)
    if _TORCH_KEEPS_GROUP:
        # Everything this rank reports is on disk. Where torch keeps the group (FSDP2),
        # gloo's threads run on into interpreter finalization, which aborts the process
        # now and then after the work is done ("terminate called without an active
        # exception": CI on 2026-12-06, test_resumes_on_any_number_of_ranks_...[3],
        # rank 1). That is torch's, not what these tests test, so such a rank leaves
        # without finalizing. Ranks whose group funcgrad alone held finalize as usual,
        # and destroy() records that their group was freed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def spawn(fn, mode: str, out: Path, world: int, deadline_s: float) -> float:
    """``fn(rank, world, port, mode, out)`` on ``world`` spawned processes, waited for
    with a hard deadline; a straggler is killed. Returns the seconds it took. Every
    rank that recorded it (:func:`destroy`) must have freed its process group."""
    for old in Path(out).glob("rank*.freed"):
        old.unlink()
    ctx = mp.start_processes(
        _traced,
        args=(fn, world, free_port(), mode, str(out)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    t0 = time.monotonic()
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() - t0 > deadline_s:
                raise TimeoutError(f"distributed workers still running after {deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    kept = sorted(f.stem for f in Path(out).glob("rank*.freed") if f.read_text() != "True")
    assert not kept, f"destroy_process_group left the group alive on {kept} (mode {mode})"
    return time.monotonic() - t0
