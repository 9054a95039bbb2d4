"""Data-parallel step time and optimizer state per rank: N gloo processes vs 1 (CPU).

All run the same compiled funcgrad step on the MLP 256-512-512-512-10 (or, with
``--layers N``, a stack of N ``Linear(64, 64)``) with a global batch of 128:
replicated state (all_reduce_mean -> zero rule -> Adam) or sharded state
(fg.sharded(zero rule -> Adam), ZeRO-2), split in flat chunks (``fg.params``, the
default) or by rows (a plain dict of the same parameters). N processes give each
rank 128/N samples and 1 thread; the 1-process run without a process group has both
threads. The figures are ratios of median step times, the first (compiling) step of
rank 0 in a fresh process with empty compile caches, and the bytes of optimizer
state each rank holds, measured in one run of this script.

Run: python benchmarks/bench_dist.py [--steps N] [--layers N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import RESULTS, cold_caches, mlp
from torch import nn

import funcgrad as fg


def deep(layers: int) -> nn.Module:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(64, 64), nn.ReLU())])


def run(
    rank: int, world: int, port: int, steps: int, out: str, bucket: bool, split: str, layers: int
) -> None:
    sharded = bool(split)
    grouped = world > 1 or sharded
    if world > 1:
        torch.set_num_threads(1)
    if grouped:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    torch.manual_seed(0)
    model = deep(layers) if layers else mlp()
    x = torch.randn(128, 64 if layers else 256)
    y = torch.randint(0, 64 if layers else 10, (128,))
    local = 128 // world
    x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
    rule = fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model))
    if sharded:
        tx = fg.sharded(fg.chain(rule, fg.adam()))
    else:
        tx = fg.chain(
            fg.all_reduce_mean(bucket=bucket, noop_if_not_initialized=True), rule, fg.adam()
        )

    def loss_fn(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    params = fg.params(model)
    params = dict(params) if split == "rows" else params
    state = tx.init(params)
    step = fg.make_step(loss_fn, tx, compile=True, donate=True)
    t = time.perf_counter()
    step(params, state, x, y)
    first = time.perf_counter() - t
    for _ in range(4):
        step(params, state, x, y)
    times = []
    for _ in range(steps):
        if grouped:
            dist.barrier()
        t = time.perf_counter()
        step(params, state, x, y)
        times.append(time.perf_counter() - t)
    nbytes = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(state))
    every = [nbytes]
    if grouped:
        every = [0] * world
        dist.all_gather_object(every, nbytes)
    if rank == 0:
        median = statistics.median(times)
        Path(out).write_text(json.dumps({"median_s": median, "first_s": first, "bytes": every}))
    if grouped:
        del params, state, step, tx
        dist.barrier()
        dist.destroy_process_group()


def measure(world: int, steps: int, out: Path, bucket: bool, split: str, layers: int) -> dict:
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as cache:
        before = dict(os.environ)
        os.environ.update(cold_caches(cache))  # the spawned ranks inherit it
        try:
            mp.start_processes(
                run,
                args=(world, port, steps, str(out), bucket, split, layers),
                nprocs=world,
                start_method="spawn",
            )
        finally:
            os.environ.clear()
            os.environ.update(before)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--layers", type=int, default=0, help="a stack of Linear(64, 64); 0: MLP")
    ap.add_argument("--only", nargs="*", help="run only the variants whose name contains these")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "_dist_tmp.json"
    variants = {
        f"1 process, {torch.get_num_threads()} threads, no process group": (1, True, ""),
        "2 processes, replicated, bucketed (1 collective)": (2, True, ""),
        "2 processes, replicated, 1 collective per tensor": (2, False, ""),
        "1 process, sharded (a group of 1)": (1, True, "chunks"),
        "2 processes, sharded, flat chunks": (2, True, "chunks"),
        "2 processes, sharded, rows": (2, True, "rows"),
        "3 processes, sharded, flat chunks": (3, True, "chunks"),
        "3 processes, sharded, rows": (3, True, "rows"),
    }
    if args.only:
        variants = {k: v for k, v in variants.items() if any(o in k for o in args.only)}
    results = {}
    for name, (world, bucket, split) in variants.items():
        results[name] = measure(world, args.steps, tmp, bucket, split, args.layers)
    os.remove(tmp)
    base = next(iter(results.values()))
    what = f"{args.layers} x Linear(64, 64)" if args.layers else "MLP (1.34M parameters)"
    print(f"global batch 128, {what}, median of {args.steps} steps, first step cold")
    print(f"  {'variant':50s} {'step':>9s} {'ratio':>6s} {'first':>7s}  optimizer state per rank")
    for name, res in results.items():
        mib = ", ".join(f"{b / 2**20:.2f}" for b in res["bytes"])
        ms, ratio = res["median_s"] * 1e3, res["median_s"] / base["median_s"]
        print(f"  {name:50s} {ms:6.2f} ms {ratio:5.2f}x {res['first_s']:6.1f}s  {mib} MiB")
    suffix = f"_{args.layers}layers" if args.layers else ""
    (args.out / f"bench_dist{suffix}.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
