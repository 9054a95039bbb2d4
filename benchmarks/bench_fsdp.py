"""fg.Optimizer against torch.optim.AdamW on the same FSDP2 model, 2 gloo ranks (CPU).

Each rank trains a model of ``--layers`` square ``--width`` Linear layers, every layer
``fully_shard``ed over 2 ranks, on its half of a random batch. Variants, timed
round-robin in one run (median of repeats; each step is forward, backward, step):

  torch-foreach   torch.optim.AdamW(foreach=True)
  fg-adamw        fg.Optimizer(model, fg.adamw(...)): the same update, funcgrad's
  fg-rule+adamw   fg.Optimizer with the seed rule and monitor per layer before AdamW
                  (their statistics are DTensor reductions: a collective each)

Printed by rank 0: ms per step and the ratio to torch-foreach.

Run: python benchmarks/bench_fsdp.py [--layers 4] [--width 512] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import funcgrad as fg

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(rank))

    def build(kind: str):
        torch.manual_seed(0)
        layers = [nn.Linear(args.width, args.width) for _ in range(args.layers)]
        m = nn.Sequential(*[mod for layer in layers for mod in (layer, nn.ReLU())])
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        if kind == "torch-foreach":
            opt: torch.optim.Optimizer = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
        elif kind == "fg-adamw":
            opt = fg.Optimizer(m, fg.adamw(lr=1e-3))
        else:
            groups = fg.group_by_module(m)
            opt = fg.Optimizer(
                m,
                fg.chain(
                    fg.monitor(groups), fg.per_group(fg.rules.zero_fix(), groups), fg.adamw(lr=1e-3)
                ),
            )

        def step() -> None:
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()

        return step

    kinds = ("torch-foreach", "fg-adamw", "fg-rule+adamw")
    steps = {k: build(k) for k in kinds}
    for f in steps.values():
        for _ in range(3):
            f()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for k, f in steps.items():
            dist.barrier()
            t = time.perf_counter()
            for _ in range(5):
                f()
            dist.barrier()
            times[k].append((time.perf_counter() - t) / 5)
    if rank == 0:
        base = statistics.median(times["torch-foreach"])
        shape = f"{args.layers} x Linear({args.width}, {args.width})"
        print(f"torch {torch.__version__}, {world} gloo ranks, {os.cpu_count()} cores; {shape}")
        for k in kinds:
            t = statistics.median(times[k])
            print(f"{k:15} {t * 1e3:8.2f} ms/step  {t / base:5.2f}x torch-foreach")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from common import free_port

    mp.spawn(worker, args=(2, free_port(), args), nprocs=2)


if __name__ == "__main__":
    main()
