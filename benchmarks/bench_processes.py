"""One compiled optimizer step timed in fresh processes: how single processes scatter.

Each child process builds ``fg.make_step(loss, fg.sgd(...) or fg.adagrad(...),
compile=True, donate=True)`` on 4 x (512 x 512) matrices (the update-heavy model of
``bench_optimizers.py``: loss ``sum(p * G)``), warms it up, and prints the median of 9
blocks of 100 steps. The parent prints every child's figure and their median. On the
2-core machine this was written on, some processes ran the step about 3x slower
than others for their whole life (benchmarks/README.md, #24).

Run: python benchmarks/bench_processes.py [--optimizer sgd] [--processes 8]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CHILD = """
import statistics, time, torch, funcgrad as fg
from torch import nn
torch.compile(lambda t: t * 2 + 1, fullgraph=True)(torch.ones(4))
gen = torch.Generator().manual_seed(0)
model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(4)])
G = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
tx = (fg.sgd(lr=0.01, momentum=0.9, weight_decay=1e-4) if "{opt}" == "sgd"
      else fg.adagrad(lr=0.01, weight_decay=1e-4))
params = fg.params(model)
state = tx.init(params)
step = fg.make_step(lambda p: sum((p[k] * G[k]).sum() for k in p), tx, compile=True, donate=True)
for _ in range(20):
    step(params, state)
blocks = []
for _ in range(9):
    t = time.perf_counter()
    for _ in range(100):
        step(params, state)
    blocks.append((time.perf_counter() - t) / 100)
print(statistics.median(blocks) * 1e3)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--optimizer", choices=("sgd", "adagrad"), default="sgd")
    ap.add_argument("--processes", type=int, default=8)
    args = ap.parse_args()
    code = CHILD.replace("{opt}", args.optimizer)
    ms = []
    for i in range(args.processes):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"process {i} failed:\n{out.stderr[-2000:]}")
        ms.append(float(out.stdout.split()[-1]))
        print(f"process {i}: {ms[-1]:.3f} ms/step", flush=True)
    print(f"{args.optimizer}: median over {len(ms)} processes {statistics.median(ms):.3f} ms "
          f"(range {min(ms):.3f}-{max(ms):.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
