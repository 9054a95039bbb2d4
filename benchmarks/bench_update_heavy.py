"""The update-heavy step in the flat layout against the per-tensor layout (#21).

bench_step.py's update-heavy model (8 x Linear(2048, 2048, bias=False), 33.6M
parameters, 30% zero gradients, loss ``sum(p * G)``: the backward is trivial, the
update is all): funcgrad's compiled, donated step (seed rule per layer + Adam) on
``fg.params(model)`` (flat) and on a params dict built by hand (one tensor per
parameter), against ``loss.backward()`` + ``torch.optim.Adam(fused=True)`` without a
rule. Timed side by side in one process (``interleaved``: alternating rounds, median).

Run: python benchmarks/bench_update_heavy.py
(glibc serves each allocation of 32 MiB or more with a fresh ``mmap`` whose pages
fault on first write; ``MALLOC_MMAP_THRESHOLD_=4294967296`` in the environment turns
that off, which shows how much of each step is page faults.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import interleaved, update_heavy_setup


def main() -> None:
    fns = {
        "flat": update_heavy_setup("fg-comp"),
        "per-tensor": update_heavy_setup("fg-comp-dict"),
        "fused": update_heavy_setup("fused"),
    }
    t = interleaved(fns, 5, 3)
    print(f"update-heavy step, 33.6M parameters, torch {torch.__version__}")
    for k, v in t.items():
        print(f"  {k:12s} {v * 1e3:8.2f} ms   {v / t['fused']:5.2f}x fused Adam (no rule)")


if __name__ == "__main__":
    main()
