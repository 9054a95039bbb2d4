"""Data-parallel training with the rule on the *global* gradient (torch.distributed).

Launch on one machine with two CPU processes (gloo):

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py

Each rank takes its shard of every batch of scikit-learn's digits, computes its
gradients in a compiled funcgrad step, and ``fg.all_reduce_mean()`` averages them
across ranks *before* the per-layer zero rule runs, so every rank applies the rule to
the same global gradient and the parameters stay identical on all ranks (checked at
the end). Started without torchrun, it runs as a single process.

With ``--sharded`` the chain is wrapped in ``fg.sharded`` instead (ZeRO-2): each rank
keeps Adam's moments for its equal chunk of the flat parameters only, the rule decides on
the global gradient, and the script prints the optimizer state each rank holds:

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --sharded
"""

from __future__ import annotations

import argparse
import gc
import os
from datetime import timedelta

from _cli import ShowDefaults, summary


def parser() -> argparse.ArgumentParser:
    """The options (built before torch imports, so --help answers at once)."""
    ap = argparse.ArgumentParser(
        formatter_class=ShowDefaults,
        description="data-parallel funcgrad training",
    )
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128, help="global batch size")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument(
        "--sharded",
        action="store_true",
        help="keep only this rank's share of the optimizer state (fg.sharded, ZeRO-2)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds a rank waits for the others in a collective before it fails "
        "(torch's default is 30 minutes: a stalled rank would hang the rest that long)",
    )
    return ap


if __name__ == "__main__":  # --help answers before torch is imported
    parser().parse_known_args()


import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn

import funcgrad as fg


def main(argv: list[str] | None = None) -> float:
    ap = parser()
    args = ap.parse_args(argv)
    if args.timeout <= 0:
        ap.error(f"--timeout must be > 0 seconds, got {args.timeout}")

    distributed = "RANK" in os.environ  # set by torchrun
    if distributed:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        torch.set_num_threads(1)
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} ranks")

    torch.manual_seed(0)  # same init on every rank
    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X / 16.0, dtype=torch.float32), torch.tensor(y)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def loss_fn(p, x, t):
        return nn.functional.cross_entropy(fg.call(model, p, x), t)

    groups = fg.group_by_module(model)
    if args.sharded and distributed:
        # fg.sharded averages the gradients itself; rules see the global gradient.
        tx = fg.sharded(fg.chain(fg.per_group(fg.rules.zero_fix(), groups), fg.adam(lr=1e-3)))
    else:
        tx = fg.chain(
            fg.all_reduce_mean(noop_if_not_initialized=True),  # first: rules see global grads
            fg.per_group(fg.rules.zero_fix(), groups),
            fg.adam(lr=1e-3),
        )
    params = fg.params(model)
    state = tx.init(params)
    state_bytes = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(state))
    if distributed:
        every = [0] * world
        dist.all_gather_object(every, state_bytes)
        if rank == 0:
            kind = "sharded" if args.sharded else "replicated"
            per_rank = ", ".join(f"rank {r}: {b / 1024:.1f} KiB" for r, b in enumerate(every))
            print(f"optimizer state ({kind}): {per_rank}")
    step = fg.make_step(loss_fn, tx, compile=not args.no_compile, donate=True)

    local = args.batch // world
    n = (len(X) // args.batch) * args.batch
    gen = torch.Generator().manual_seed(1)  # same order on every rank
    for epoch in range(args.epochs):
        order = torch.randperm(len(X), generator=gen)[:n].view(-1, args.batch)
        for idx in order:
            mine = idx[rank * local : (rank + 1) * local]
            params, state, loss = step(params, state, X[mine], y[mine])
        if rank == 0:
            print(f"epoch {epoch + 1}: rank-0 shard loss {loss.item():.4f}")

    with torch.no_grad():
        acc = (model(X).argmax(1) == y).float().mean().item()
    if distributed:
        # Every rank must hold the same parameters: compare with rank 0's.
        for name, p in params.items():
            ref = p.clone()
            dist.broadcast(ref, src=0)
            if not torch.equal(ref, p):
                raise RuntimeError(f"rank {rank}: {name} differs from rank 0")
        # A process group alive at interpreter exit can abort the process ("terminate
        # called without an active exception"): destroy it at the end. funcgrad keeps
        # no reference to it (docs/distributed.md, "At exit"); releasing the step's
        # tensors first (some came out of gloo collectives) costs nothing.
        del params, state, step, tx
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        print(f"{world} rank(s); parameters identical on all ranks; train accuracy {acc:.3f}")
        summary("ddp_train", ranks=world, sharded=str(args.sharded), train_acc=acc)
    return acc


if __name__ == "__main__":
    main()
