"""Memory over a long run: 2,000 compiled steps, resident memory sampled as it goes.

A small MLP on random data with monitor -> zero rule -> Adam, compiled and donated
(and, for comparison, compiled without donation). Prints VmRSS every 250 steps and
the growth from step 250 to the end; a leak would show as steady growth.

Run: python tools/longrun.py [--steps N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

import funcgrad as fg


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def run(steps: int, donate: bool) -> list[tuple[int, float]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )
    groups = fg.group_by_module(model)
    tx = fg.chain(fg.monitor(groups), fg.per_group(fg.rules.zero_fix(), groups), fg.adam(1e-3))

    def loss_fn(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    step = fg.make_step(loss_fn, tx, compile=True, donate=donate)
    params = fg.params(model)
    state = tx.init(params)
    x, y = torch.randn(32, 32), torch.randint(0, 4, (32,))
    samples = []
    every = max(1, steps // 8)  # 250 for the default 2,000 steps
    for i in range(1, steps + 1):
        params, state, loss = step(params, state, x, y)
        if i % every == 0:
            loss.item()
            samples.append((i, rss_mib()))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000, help="at least 2 (default 2000)")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    )
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps: at least 2 (resident memory is sampled 8 times over the run)")
    result = {}
    for donate in (True, False):
        samples = run(args.steps, donate)
        name = "donated" if donate else "not donated"
        growth = samples[-1][1] - samples[0][1]
        result[name] = {"samples": samples, "growth_mib": growth}
        print(f"{name}: " + ", ".join(f"{i}:{m:.1f}" for i, m in samples))
        print(f"  RSS growth from step {samples[0][0]} to {samples[-1][0]}: {growth:+.1f} MiB")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_longrun.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
