"""A standalone reproducer (no funcgrad) of a torch bug found while chasing #39's heap
corruption: inductor's on-disk cache does not tell kernels built for one vector ISA
from another, so a cache written under ``ATEN_CPU_CAPABILITY=avx2`` and read by a
process on the CPU's own AVX-512 path runs kernels of the other width: wrong values
and glibc heap aborts ("free(): invalid pointer", "malloc(): unaligned tcache chunk
detected").

Run: python benchmarks/repro_inductor_isa_cache.py   (on an AVX-512 CPU; ~1 min)
It runs the same compiled function in three fresh processes sharing one new cache
directory: first with ATEN_CPU_CAPABILITY=avx2 (fills the cache), then twice
without it (reads it), and prints each one's exit status and result check.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

CHILD = r"""
import torch
torch.manual_seed(0)
def f(x, w, s):
    y = torch.tanh(x @ w)
    m = (y * y).mean(0, keepdim=True)
    return y / (m.sqrt() + 1e-8) * s.exp(), y.abs().amax()
x, w, s = torch.randn(37, 21), torch.randn(21, 19), torch.randn(())
want = f(x, w, s)
got = torch.compile(f, fullgraph=True)(x, w, s)
ok = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want))
print("capability", torch.backends.cpu.get_cpu_capability(), "equal to eager:", ok)
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        for label, extra in (
            ("writes the cache (avx2)", {"ATEN_CPU_CAPABILITY": "avx2"}),
            ("reads it (native)", {}),
            ("reads it (native)", {}),
        ):
            env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
            env.update(extra, TORCHINDUCTOR_CACHE_DIR=cache)
            p = subprocess.run(
                [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True
            )
            tail = (p.stdout.strip().splitlines() or [""])[-1]
            err = (p.stderr.strip().splitlines() or [""])[-1] if p.returncode else ""
            print(f"{label:26s} rc={p.returncode:4d} {tail} {err}")


if __name__ == "__main__":
    main()
