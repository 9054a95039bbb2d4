"""How funcgrad's costs grow with the number of parameter tensors (issue #13, target 4).

Model: ``L`` blocks of ``Linear(W, W) + ReLU`` (2L parameter tensors), batch 32, MSE
loss; funcgrad's step is the seed rule per layer + Adam, donated. For each ``L``:

* eager: the first call of ``make_step(compile=False)`` (its pre-checks, which run a
  shape-only dry run of ``tx.update``, plus one step) and the median step, against
  the published hook answer + ``torch.optim.Adam`` on the same model;
* compiled (for the ``--compile-layers`` sizes): the cold compile of the step in a
  fresh process with empty inductor caches, against the cold compile of the gradient
  computation alone (``torch.compile(torch.func.grad_and_value(loss))`` over one tensor
  per parameter), and the
  median compiled step against the compiled gradient computation; the same for
  ``make_step(compile="gradients")`` (forward and backward compiled, rule and Adam
  eager).

Ratios are of variants measured side by side (interleaved) in one run; cold compiles
run one after the other in child processes. Absolute times are for context only.

Run: python benchmarks/bench_scaling.py [--layers 10 100 1000] [--compile-layers 10 40]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import (
    RESULTS,
    cold_caches,
    deep,
    deep_batch,
    example,
    interleaved,
    per_name,
    run_json,
)
from torch import nn

import funcgrad as fg
import funcgrad.step._step as fg_internal_step

DEVICE = torch.device("cpu")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def loss_of(m: nn.Module) -> Callable[..., torch.Tensor]:
    def loss(p, x, y):
        return ((fg.call(m, p, x) - y) ** 2).mean()

    return loss


def fg_step(m: nn.Module, compile: bool | str):
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), fg.adam())
    params = fg.params(m)
    state = tx.init(params)
    step = fg.make_step(loss_of(m), tx, compile=compile, donate=True)
    return step, params, state


def eager(layers: int, width: int) -> dict[str, float]:
    x, y = deep_batch(width, DEVICE)
    m_hook = deep(layers, width, DEVICE)
    example("hook_answer").attach_hook_answer(m_hook, (nn.Linear,))
    opt = torch.optim.Adam(m_hook.parameters())

    def hook() -> None:
        opt.zero_grad()
        ((m_hook(x) - y) ** 2).mean().backward()
        opt.step()

    step, params, state = fg_step(deep(layers, width, DEVICE), compile=False)
    t = time.perf_counter()
    step(params, state, x, y)
    sync()
    first = time.perf_counter() - t
    # The same step with every call's gradients through torch.func (as before the
    # eager autograd path): what that path saves, side by side.
    autograd_path = fg_internal_step.autograd_gradients
    fg_internal_step.autograd_gradients = (  # type: ignore[assignment]
        lambda loss_fn, has_aux, buffers: fg_internal_step.gradient_function(
            loss_fn, has_aux, None, buffers
        )
    )
    try:
        func_step, func_params, func_state = fg_step(deep(layers, width, DEVICE), compile=False)
    finally:
        fg_internal_step.autograd_gradients = autograd_path
    func_step(func_params, func_state, x, y)  # as many steps as `step` has taken
    number = max(1, 200 // layers)
    t = interleaved(
        {
            "hook": hook,
            "fg": lambda: step(params, state, x, y),
            "fg_func": lambda: func_step(func_params, func_state, x, y),
        },
        7,
        number,
        warmup=1,
        sync=sync,
    )
    same = all(torch.equal(params[k], func_params[k]) for k in params)
    return {
        "first_call_s": first,
        "hook_s": t["hook"],
        "fg_s": t["fg"],
        "fg_torch_func_s": t["fg_func"],
        "bit_equal": same,
    }


def compile_child(layers: int, width: int, which: str) -> dict[str, float]:
    """In a fresh process with empty caches: the first call, then the median step."""
    x, y = deep_batch(width, DEVICE)
    m = deep(layers, width, DEVICE)
    if which == "grad":
        f = torch.compile(torch.func.grad_and_value(loss_of(m)), fullgraph=True)
        params = per_name(m)

        def call() -> object:
            return f(params, x, y)
    else:  # "step": compile=True; "gradients": compile="gradients"
        step, params, state = fg_step(m, compile=True if which == "step" else which)

        def call() -> object:
            return step(params, state, x, y)

    t = time.perf_counter()
    call()
    sync()
    first = time.perf_counter() - t
    return {
        "first_call_s": first,
        "step_s": interleaved({"f": call}, 7, 20, warmup=1, sync=sync)["f"],
    }


def run_child(layers: int, width: int, which: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache:
        argv = [__file__, "--child", str(layers), str(width), which, "--device", str(DEVICE)]
        return run_json(argv, cold_caches(cache))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--compile-layers", type=int, nargs="*", default=[10, 40])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (see benchmarks/gpu.sh)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.child:
        layers, width, which = int(args.child[0]), int(args.child[1]), args.child[2]
        print(json.dumps(compile_child(layers, width, which)))
        return
    results: dict[str, dict] = {"eager": {}, "compiled": {}}
    print(
        f"L blocks of Linear({args.width}, {args.width}) + ReLU, batch 32, rule + Adam, on {DEVICE}"
    )
    print("eager (compile=False, donated) against the hook answer + torch.optim.Adam")
    for layers in args.layers:
        r = eager(layers, args.width)
        results["eager"][layers] = r
        print(
            f"  L={layers:5d}  first call {r['first_call_s']:6.2f} s   step {r['fg_s'] * 1e3:8.2f}"
            f" ms  hook {r['hook_s'] * 1e3:8.2f} ms  ratio {r['fg_s'] / r['hook_s']:5.2f}x"
            f"  (all gradients by torch.func: {r['fg_torch_func_s'] / r['hook_s']:5.2f}x;"
            f" params {'equal' if r['bit_equal'] else 'DIFFER'} bit for bit)"
        )
    print("compiled, cold (fresh process, empty caches): against grad-only")
    for layers in args.compile_layers:
        g = run_child(layers, args.width, "grad")
        results["compiled"][layers] = {"grad": g}
        for which in ("step", "gradients"):
            s = run_child(layers, args.width, which)
            results["compiled"][layers][which] = s
            label = "compile=True       " if which == "step" else 'compile="gradients"'
            print(
                f"  L={layers:5d}  {label}  first call {s['first_call_s']:6.1f} s vs "
                f"{g['first_call_s']:6.1f} s ({s['first_call_s'] / g['first_call_s']:4.2f}x)"
                f"   step {s['step_s'] * 1e3:7.3f} ms vs {g['step_s'] * 1e3:7.3f} ms"
                f" ({s['step_s'] / g['step_s']:4.2f}x)"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    name = "bench_scaling.json" if DEVICE.type == "cpu" else f"bench_scaling_{DEVICE.type}.json"
    (args.out / name).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
