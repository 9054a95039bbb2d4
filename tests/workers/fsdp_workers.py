"""Workers for fg.Optimizer on FSDP2 (``fully_shard``) over gloo ranks (CPU).

The model (float64) has a layer whose rows 2-3 never fire: on 2 ranks, rank 1's shard
of ``0.weight``/``0.bias`` has all-zero gradients while the layer as a whole does not,
so a rule that decided on its shard alone would take the all-zero branch there.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import funcgrad as fg
from workers.dist_workers import destroy

D = torch.float64
STEPS = 4
BATCH = 12


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    m = m.to(D)
    with torch.no_grad():
        m[0].bias[2:].fill_(-100.0)  # units 2, 3 never fire
    return m


def make_tx(m: nn.Module) -> fg.GradientTransformation:
    groups = fg.group_by_module(m)
    return fg.named_chain(
        ("monitor", fg.monitor(groups)),
        ("rule", fg.per_group(fg.rules.zero_fix(), groups)),
        ("adamw", fg.adamw(lr=0.05, weight_decay=0.1)),
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 2, generator=g, dtype=D), torch.randn(BATCH, 1, generator=g, dtype=D))
        for _ in range(STEPS)
    ]


def train(m, opt, rank: int, world: int, steps) -> None:
    n = BATCH // world
    data = batches()
    for i in steps:
        x, y = data[i]
        opt.zero_grad()
        ((m(x[rank * n : (rank + 1) * n]) - y[rank * n : (rank + 1) * n]) ** 2).mean().backward()
        opt.step()


def whole(t):
    """A DTensor's full value (collective: every rank calls it), else the tensor."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def sharded_model(world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    m = model()
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def worker(rank: int, world: int, port: int, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    try:
        m = sharded_model(world)
        opt = fg.Optimizer(m, make_tx(m))
        if mode == "train":
            train(m, opt, rank, world, range(STEPS))
        result = {
            "params": {k: whole(v) for k, v in m.named_parameters()},
            "stats": {
                g: {k: whole(v) for k, v in s.items()}
                for g, s in opt.tx_state["monitor"].stats.items()
            },
            "count": int(whole(opt.tx_state["adamw"].count)),
            # statistics summed over shards are kept reduced (torch 2.14's DCP refuses
            # a Partial placement)
            "partial": [
                f"{g}/{k}"
                for g, s in opt.tx_state["monitor"].stats.items()
                for k, v in s.items()
                if any(p.is_partial() for p in getattr(v, "placements", ()))
            ],
        }
        torch.save(result, Path(out) / f"{mode}-{world}-rank{rank}.pt")
        dist.barrier()
    finally:
        destroy(rank, out, check=False)  # FSDP2 (torch) keeps the group
