"""Study (#41 part 3): ``torch.compiler.nested_compile_region`` on char_gpt's repeated
blocks, inside the gradient computation that funcgrad's one-graph step traces.

A model of N equal blocks makes dynamo trace, and inductor lower, the block N times;
``nested_compile_region`` (on ``Block.forward``) asks for one trace reused N times.
funcgrad's compiled step computes gradients inside the graph, so the region must work
under one of the two routes a step can take there:

- ``func``: ``torch.func.grad_and_value`` over ``fg.call`` (what ``compile=True`` traces);
- ``autograd``: ``torch.autograd.grad`` inside the compiled function, which dynamo
  traces only with ``torch._dynamo.config.trace_autograd_ops = True`` (experimental).

Each (route, region or not) runs in a fresh process with empty caches (the method of
``bench_compile_cpu.py``): the first call's CPU seconds and the gradients' largest
difference from the eager ones, or the error, first line. Re-run it on a new torch to
see whether the region composes yet; adopt it in the step where it does and the CPU
seconds drop.

Run: python benchmarks/study_nested_region.py [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))


def child(layers: int, route: str, region: bool) -> dict[str, object]:
    import char_gpt
    import torch
    from bench_compile_cpu import cpu_seconds
    from bench_step import gpt_ce, gpt_problem, per_name

    import funcgrad as fg

    if region:
        char_gpt.Block.forward = torch.compiler.nested_compile_region(char_gpt.Block.forward)
    m, x, y = gpt_problem(64, layers, batch=8)

    def loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return gpt_ce(fg.call(m, p, x), y)

    def by_autograd(p: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, torch.Tensor]:
        with torch.enable_grad():
            leaves = {k: t.detach().requires_grad_() for k, t in p.items()}
            value = loss(leaves, x, y)
            g = torch.autograd.grad(value, tuple(leaves.values()))
        return dict(zip(leaves, g, strict=True)), value.detach()

    gradients = torch.func.grad_and_value(loss) if route == "func" else by_autograd
    if route == "autograd":
        torch._dynamo.config.trace_autograd_ops = True
    params = per_name(m)
    compiled = torch.compile(gradients, fullgraph=True)
    c, t = cpu_seconds(), time.perf_counter()
    try:
        got, _ = compiled(params, x, y)
    except Exception as e:  # the finding is which error, if any
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {"error": f"{type(e).__name__}: {first}"[:200]}
    cpu, wall = cpu_seconds() - c, time.perf_counter() - t
    want, _ = torch.func.grad_and_value(loss)(params, x, y)
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    return {"cpu_s": cpu, "wall_s": wall, "max_abs_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        layers, route, region = int(args.child[0]), args.child[1], args.child[2] == "1"
        print(json.dumps(child(layers, route, region)))
        return
    import torch
    from bench_step import cold_caches

    print(f"torch {torch.__version__}; char_gpt.py's model, {args.layers} blocks, dim 64")
    for route in ("func", "autograd"):
        for region in (False, True):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, **cold_caches(cache), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
                cmd = [sys.executable, __file__, "--child", str(args.layers), route,
                       "1" if region else "0"]  # fmt: skip
                out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = out.stdout.strip().splitlines()
            r = json.loads(lines[-1]) if lines else {"error": out.stderr.strip()[-200:]}
            what = "nested_compile_region" if region else "plain blocks"
            if "error" in r:
                print(f"  {route:8s} {what:22s} fails: {r['error']}", flush=True)
            else:
                print(f"  {route:8s} {what:22s} first call {r['cpu_s']:6.1f} CPU s "
                      f"({r['wall_s']:.1f} s wall), gradients within "
                      f"{r['max_abs_diff']:.1e} of eager", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
