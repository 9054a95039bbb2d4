"""Why a compiled step that is all update runs slower flat: a toy of it (#21).

Eight gradients of 4M entries each (``G[i] * 1.0``, as the update-heavy model's
backward gives), the seed rule's "all zero" test per layer and an SGD-like update,
compiled with inductor three ways:

  fresh       the gradients ``cat`` into one flat buffer (as ``fg.params``' step does),
              ruled as rows of a ``(8, 4M)`` view, then the update of the flat params
  kept        the same, the ``cat`` written into a buffer kept between calls
              (``buf.copy_(cat)``, a mutated graph input) instead of a fresh one
  per_tensor  each gradient ruled and applied on its own (no flat buffer)

Timed side by side (alternating rounds, median). Run it twice: as is, and with
``MALLOC_MMAP_THRESHOLD_=4294967296`` in the environment (glibc then serves large
allocations from its heap instead of a fresh, page-faulting ``mmap`` each time).

Run: python benchmarks/study_flat_grad_alloc.py
"""

from __future__ import annotations

import statistics
import time

import torch

N, K = 4 * 2**20, 8


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    G = [torch.randn(N, generator=gen) for _ in range(K)]

    def rule_and_update(p: torch.Tensor, g: torch.Tensor) -> None:
        rows = g.view(K, N)
        dead = ~(rows != 0).any(-1, keepdim=True)
        p.sub_(0.001 * torch.where(dead, 1.0, rows).view(-1))

    def fresh(p: torch.Tensor) -> None:
        rule_and_update(p, torch.cat([g * 1.0 for g in G]))

    def kept(p: torch.Tensor, buf: torch.Tensor) -> None:
        buf.copy_(torch.cat([g * 1.0 for g in G]))
        rule_and_update(p, buf)

    def per_tensor(ps: list[torch.Tensor]) -> None:
        for p, g in zip(ps, G, strict=True):
            g = g * 1.0
            p.sub_(0.001 * torch.where(~(g != 0).any(), 1.0, g))

    p, buf = torch.zeros(K * N), torch.empty(K * N)
    ps = list(torch.zeros(K * N).split(N))
    c_fresh, c_kept, c_per_tensor = (
        torch.compile(f, fullgraph=True) for f in (fresh, kept, per_tensor)
    )
    calls = {
        "fresh": lambda: c_fresh(p),
        "kept": lambda: c_kept(p, buf),
        "per_tensor": lambda: c_per_tensor(ps),
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    for f in calls.values():
        for _ in range(3):
            f()
    for _ in range(7):
        for name, f in calls.items():
            start = time.perf_counter()
            for _ in range(5):
                f()
            times[name].append((time.perf_counter() - start) / 5)
    for name, ts in times.items():
        print(f"{name:10s} {statistics.median(ts) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
