"""Does ``destroy_process_group`` free the process group? One fresh process per case.

A group that outlives ``destroy_process_group`` keeps gloo's threads (and rank 0's
TCPStore) running into interpreter exit, where a gloo thread that takes the GIL during
finalization aborts the process: "terminate called without an active exception",
SIGABRT, after all the work is done (seen once in CI, rank 0 of a 2-rank
``compile="async"`` ``fg.sharded`` run on torch 2.14.1). Each case below runs in a
group of one gloo rank, destroys it, and says whether the group object is gone.

    python benchmarks/repro_pinned_group.py

The torch cases show what pins a group (no funcgrad in them); the funcgrad cases show
its own paths after the fix (group names in traced code, ``torch.distributed.nn``
imported with funcgrad, fg.state_dict's DTensors copied and gathered on their local
tensors). A DTensor holds its mesh, and the mesh its group: a state dict from
fg.state_dict(sharded state) kept alive keeps the group too.
"""

from __future__ import annotations

import subprocess
import sys

PRELUDE = """
import gc, sys, weakref, torch, torch.distributed as dist
{before}
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
world = weakref.ref(dist.group.WORLD)
"""
CHECK = """
dist.destroy_process_group(); gc.collect()
print("freed" if world() is None else "PINNED")
"""

CASES: dict[str, tuple[str, str]] = {
    "torch: import torch._dynamo after init_process_group": ("", "import torch._dynamo"),
    "torch: the same, torch.distributed.nn.functional imported first": (
        "import torch.distributed.nn.functional",
        "import torch._dynamo",
    ),
    "torch: compiled function reading dist.group.WORLD": (
        "import torch._dynamo\nimport torch.distributed._functional_collectives as fc",
        "f = torch.compile(lambda x: fc.all_reduce(x, 'sum', dist.group.WORLD) * 2,"
        " backend='aot_eager', fullgraph=True)\nf(torch.ones(3))\n"
        "del f\ntorch._dynamo.reset()",
    ),
    "torch: the same with the group's name": (
        "import torch._dynamo\nimport torch.distributed._functional_collectives as fc",
        "name = dist.group.WORLD.group_name\n"
        "f = torch.compile(lambda x: fc.all_reduce(x, 'sum', name) * 2,"
        " backend='aot_eager', fullgraph=True)\nf(torch.ones(3))",
    ),
    "torch: FSDP2 and torch.optim, model deleted": (
        "import torch.distributed.nn.functional\nfrom torch.distributed.fsdp import fully_shard",
        "m = torch.nn.Linear(4, 2); fully_shard(m); o = torch.optim.Adam(m.parameters())\n"
        "m(torch.ones(3, 4)).sum().backward(); o.step(); del m, o",
    ),
    "funcgrad: compiled step (inductor), fg.all_reduce_mean, tx and step alive": (
        "import funcgrad as fg",
        "m = torch.nn.Linear(4, 2)\n"
        "tx = fg.chain(fg.all_reduce_mean(), fg.adam(lr=0.1))\n"
        "loss = lambda p, x: fg.call(m, p, x).square().mean()\n"
        "step = fg.make_step(loss, tx, compile=True)\n"
        "p = fg.params(m); s = tx.init(p); p, s, _ = step(p, s, torch.ones(3, 4))",
    ),
    "funcgrad: compiled fg.sharded step, fg.state_dict loaded back, then dropped": (
        "import funcgrad as fg",
        "m = torch.nn.Linear(4, 2)\n"
        "tx = fg.sharded(fg.adam(lr=0.1))\n"
        "loss = lambda p, x: fg.call(m, p, x).square().mean()\n"
        "step = fg.make_step(loss, tx, compile=True)\n"
        "p = fg.params(m); s = tx.init(p); p, s, _ = step(p, s, torch.ones(3, 4))\n"
        "sd = fg.state_dict(s); s2 = fg.load_state_dict(tx, p, sd); del sd",
    ),
}


def main() -> None:
    for what, (before, body) in CASES.items():
        code = PRELUDE.format(before=before) + body + CHECK
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        said = run.stdout.strip().splitlines()[-1:] or [f"rc={run.returncode}"]
        if run.returncode != 0:
            said = [f"rc={run.returncode} {run.stderr.strip().splitlines()[-1:]}"]
        print(f"{said[0]:<8} {what}", flush=True)


if __name__ == "__main__":
    main()
