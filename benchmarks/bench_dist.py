"""Data-parallel step time: 2 gloo processes vs 1 process, same global batch (CPU).

Both run the same compiled funcgrad step (all_reduce_mean -> zero rule -> Adam) on
the MLP 256-512-512-512-10 with a global batch of 128; the 2-process run gives each
rank 64 samples and 1 thread, the 1-process run has both threads. The figure is the
ratio of median step times, measured in one run of this script.

Run: python benchmarks/bench_dist.py [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import funcgrad as fg

sys.path.insert(0, str(Path(__file__).parent))
from bench_step import mlp


def run(rank: int, world: int, port: int, steps: int, out: str, bucket: bool) -> None:
    if world > 1:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    torch.manual_seed(0)
    model = mlp()
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
    local = 128 // world
    x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
    tx = fg.chain(
        fg.all_reduce_mean(bucket=bucket, noop_if_not_initialized=True),
        fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)),
        fg.adam(),
    )

    def loss_fn(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    params = fg.params(model)
    state = tx.init(params)
    step = fg.make_step(loss_fn, tx, compile=True, donate=True)
    for _ in range(5):
        step(params, state, x, y)
    times = []
    for _ in range(steps):
        if world > 1:
            dist.barrier()
        t = time.perf_counter()
        step(params, state, x, y)
        times.append(time.perf_counter() - t)
    if rank == 0:
        Path(out).write_text(json.dumps({"median_s": statistics.median(times)}))
    if world > 1:
        dist.destroy_process_group()


def measure(world: int, steps: int, out: Path, bucket: bool = True) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        run, args=(world, port, steps, str(out), bucket), nprocs=world, start_method="spawn"
    )
    return json.loads(out.read_text())["median_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "_dist_tmp.json"
    one = measure(1, args.steps, tmp)
    two = measure(2, args.steps, tmp)
    two_unbucketed = measure(2, args.steps, tmp, bucket=False)
    os.remove(tmp)
    print(f"global batch 128, MLP, median of {args.steps} steps")
    print(f"  1 process, {torch.get_num_threads()} threads:           {one * 1e3:7.2f} ms")
    print(f"  2 processes, bucketed (1 collective):  {two * 1e3:7.2f} ms   {two / one:.2f}x")
    print(
        f"  2 processes, 1 collective per tensor:  {two_unbucketed * 1e3:7.2f} ms   "
        f"{two_unbucketed / one:.2f}x"
    )
    (args.out / "bench_dist.json").write_text(
        json.dumps(
            {
                "one_process_s": one,
                "two_process_s": two,
                "two_process_unbucketed_s": two_unbucketed,
                "ratio": two / one,
                "ratio_unbucketed": two_unbucketed / one,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
