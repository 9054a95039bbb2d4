"""compile="async" against compile=True and the eager step: time to the first step,
to the switch, and to the end of a run, each in a fresh process with a cold inductor
cache (its own temporary TORCHINDUCTOR_CACHE_DIR).

The MLP 256-512-512-512-10 of benchmarks/common.py at batch 64, the seed rule per layer and
Adam, donated. Run: python benchmarks/bench_async.py [--steps N] [--device cuda]
(benchmarks/gpu.sh runs it on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(mode: str, steps: int, device: str) -> None:
    t0 = time.perf_counter()
    import torch
    from common import mlp
    from torch import nn

    import funcgrad as fg

    torch.manual_seed(0)
    model = mlp().to(device)
    x, y = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)

    def sync() -> None:  # a GPU step has ended when its kernels have
        if device != "cpu":
            torch.cuda.synchronize()

    def loss(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)), fg.adam(1e-3))
    params = fg.params(model)
    state = tx.init(params)
    compile = {"False": False, "True": True}.get(mode, mode)
    step = fg.make_step(loss, tx, compile=compile, donate=True)
    start = time.perf_counter()
    first = switch = None
    for i in range(steps):
        step(params, state, x, y)
        if first is None:
            sync()
            first = time.perf_counter() - start
        if switch is None and step.is_compiled:
            sync()
            switch = (i, time.perf_counter() - start)
    sync()
    end = time.perf_counter() - start
    print(json.dumps({"mode": mode, "device": device, "import_s": start - t0, "first_step_s": first,
                      "switch": switch, "end_s": end}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.steps, args.device)
    here = os.path.dirname(os.path.abspath(__file__))
    for mode in ("False", "True", "async"):
        with tempfile.TemporaryDirectory() as cache:
            path = os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": path}
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--steps", str(args.steps),
                 "--device", args.device],
                env=env, capture_output=True, text=True,
            )  # fmt: skip
            if out.returncode:
                sys.exit(f"bench_async: the {mode} child failed:\n{out.stderr[-3000:]}")
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
