"""Step-time, update-time, compile-time and memory benchmarks, side by side in one run.

Every figure that matters is a ratio between variants measured in the same process,
interleaved round-robin and summarised by the median of repeats, because these
machines are shared and noisy. Absolute times are printed only for context.

Variants of a training step (MLP 256-512-512-512-10 batch 64, and a small CNN):
  (a) hook      the published tensor-hook answer + torch.optim.Adam
  (b) eager     a correct eager rule on .grad + torch.optim.Adam(foreach=True)
  (c) fg-eager  funcgrad make_step, eager, donated
  (d) fg-comp   funcgrad make_step, compiled + donated
  (e) fg-grads  funcgrad make_step(compile="gradients"), donated: the forward and
                backward compiled, the rule and Adam eager
  (f) fg-comp-dict  (d) on a params dict built by hand (one tensor per parameter,
                the per-tensor layout) instead of fg.params(model) (flat buffers)
  fwd+bwd       torch.compile of the gradient computation alone, one tensor per
                parameter (the floor: the model's own gradients)
  torch.compile+fused  torch.compile of the model, backward, Adam(fused=True), no rule
                (PyTorch's own fast step: how far above fwd+bwd an update costs)

Update-heavy (about 32M parameters in 8 layers, 30% zero gradients, loss sum(p * G)):
  fg-comp       funcgrad compiled + donated, with the rule and Adam
  fg-ingraph    the same with 0.1's in-graph donation (not transactional), for the
                cost of committing writes after the graph
  hand-comp     the floor: the same step written by hand (no funcgrad) as one
                torch.compile'd function on one tensor per layer, writing params and
                moments in place: two passes, the loss and each layer's rule
                statistic, then the rule and Adam
  fused         loss.backward() + torch.optim.Adam(fused=True), no rule at all
  foreach+rule  loss.backward() + the correct eager rule + torch.optim.Adam(foreach=True)

Tiny GPT (examples/char_gpt.py's model, 2 blocks, dim 128, 64 tokens x 16, dropout 0):
  fg-comp               funcgrad compiled + donated, per-block rule + AdamW
  fg-grads              the same with compile="gradients" (rule and AdamW eager)
  torch.compile+fused   torch.compile of the model, backward, AdamW(fused=True), no rule

Gradient accumulation on the same model (fg.accumulate around the rule and Adam):
  acc-mid       a non-final micro-step (tx does not run), against fg-comp
  acc-4         the mean cost per micro-step with every=4

Parts run alone with ``--part`` (each writes ``results/bench_step_<part>.json``):
  layout-eager     the eager donated step, flat layout (fg.params) against one tensor
                   per parameter, beside the hook answer and a plain torch step
                   (``--layers 0 200``: 0 is the MLP, L > 0 is L blocks of Linear(64, 64))
  layout-compiled  the compiled MLP step, flat against per tensor, with and without
                   the rule: time, ATen calls (CUDA kernels with ``--device cuda``)
  layout-update    the update-heavy step, compiled, flat against per tensor and fused Adam
  processes        one compiled SGD step timed in ``--processes N`` fresh processes:
                   how single processes scatter (compare within one process)

Run: python benchmarks/bench_step.py [--quick] [--out DIR] [--part PART]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import (
    RESULTS,
    RULE,
    cnn,
    cold_caches,
    eager_rule_on_grads,
    example,
    gpt_ce,
    gpt_problem,
    interleaved,
    mlp,
    per_name,
    problem,
    run_json,
    write_json,
)
from torch import nn

import funcgrad as fg
from funcgrad.core._fusion import realize

attach_hook_answer = example("hook_answer").attach_hook_answer


def step_variants(make_model: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor):
    """The step variants on identical copies of one model, and the time of the
    first call of (d) (in a process that may have compiled before: see
    ``first_step_child`` for cold compiles)."""
    torch.manual_seed(0)
    base = make_model()
    types = (nn.Linear, nn.Conv2d)

    def clone() -> nn.Module:
        m = make_model()
        m.load_state_dict(base.state_dict())
        return m

    def ce(m):
        return lambda p, x, y: nn.functional.cross_entropy(fg.call(m, p, x), y)

    fns: dict[str, Callable[[], object]] = {}

    m_hook = clone()
    attach_hook_answer(m_hook, types)
    opt_hook = torch.optim.Adam(m_hook.parameters())

    def hook_step():
        opt_hook.zero_grad()
        nn.functional.cross_entropy(m_hook(x), y).backward()
        opt_hook.step()

    fns["(a) hook"] = hook_step

    m_eager = clone()
    g_eager = fg.group_by_module(m_eager, types=types)
    opt_eager = torch.optim.Adam(m_eager.parameters(), foreach=True)

    def eager_step():
        opt_eager.zero_grad()
        nn.functional.cross_entropy(m_eager(x), y).backward()
        eager_rule_on_grads(m_eager, g_eager)
        opt_eager.step()

    fns["(b) eager"] = eager_step

    compile_s = 0.0
    modes: tuple[tuple[str, bool | str], ...] = (
        ("(c) fg-eager", False),
        ("(d) fg-comp", True),
        ("(e) fg-grads", "gradients"),
        ("(f) fg-comp-dict", True),
    )
    for name, compiled in modes:
        m = clone()
        groups = fg.group_by_module(m, types=types)
        tx = fg.chain(fg.per_group(RULE, groups), fg.adam())
        params = per_name(m) if name.endswith("dict") else fg.params(m)
        state = tx.init(params)
        step = fg.make_step(ce(m), tx, compile=compiled, donate=True)
        if name == "(d) fg-comp":
            t = time.perf_counter()
            step(params, state, x, y)
            compile_s = time.perf_counter() - t
        fns[name] = lambda step=step, params=params, state=state: step(params, state, x, y)

    m_g = clone()
    p_g = per_name(m_g)
    fwdbwd = torch.compile(torch.func.grad_and_value(ce(m_g)), fullgraph=True)
    fns["fwd+bwd"] = lambda: fwdbwd(p_g, x, y)

    # PyTorch's own fast path on the same model, without any rule: what target 5's
    # "overhead over fwd+bwd" is for a step that also updates the parameters.
    m_t = clone()
    fwd_t = torch.compile(m_t)
    opt_t = torch.optim.Adam(m_t.parameters(), fused=True)

    def torch_step() -> None:
        opt_t.zero_grad()
        nn.functional.cross_entropy(fwd_t(x), y).backward()
        opt_t.step()

    fns["torch.compile+fused"] = torch_step
    return fns, compile_s


def _in_graph_donation(loss_fn, tx, params, state):
    """funcgrad 0.1's donation: the compiled graph writes params and state in place.
    Faster, but not transactional (inductor may write a donated input before a later
    op fails, and Ctrl-C can land between its kernels); kept here to measure what
    committing after the graph costs."""
    import torch.utils._pytree as pytree

    def step(p, s):
        # The loss is returned, as every other variant computes it (without it the
        # forward is dead code and the graph skips a pass over the params).
        grads, loss = torch.func.grad_and_value(loss_fn)(p)
        updates, new_s = tx.update(grads, s, p)
        new_p = fg.apply_updates(p, updates)
        pytree.tree_map(lambda d, x: d.copy_(x), (p, s), (new_p, new_s))
        return loss

    compiled = torch.compile(step, fullgraph=True)
    return lambda: compiled(params, state)


def _hand_written(loss_fn, params: dict[str, torch.Tensor]):
    """``hand-comp``: the update-heavy step by hand, one compiled function: gradients,
    per layer the seed rule (all zero -> 1.0, else zeros -> 0.5) and torch.optim's
    Adam (lr 1e-3, betas 0.9 / 0.999, eps 1e-8) in place. Nothing transactional."""
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    mu = {k: torch.zeros_like(p) for k, p in params.items()}
    nu = {k: torch.zeros_like(p) for k, p in params.items()}
    count = torch.zeros((), dtype=torch.int64)

    def step(p, mu, nu, count):
        grads, loss = torch.func.grad_and_value(loss_fn)(p)
        count.add_(1)
        t = count.to(torch.float64)
        # The bias corrections computed once (not inlined into every vector of every
        # loop: the trap funcgrad's Adam avoids the same way, docs/compile-notes.md).
        step_size, inv_bc2 = realize(torch.stack([-lr / (1 - b1**t), 1 / (1 - b2**t).sqrt()]))
        for k, g in grads.items():
            fill = torch.where((g != 0).any(), 0.5, 1.0)
            g = torch.where(g == 0, fill, g)
            mu[k].lerp_(g, 1 - b1)
            nu[k].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (nu[k].sqrt() * inv_bc2.float()).add_(eps)
            p[k].addcdiv_(mu[k], denom, value=step_size.float())
        return loss

    compiled = torch.compile(step, fullgraph=True)
    return lambda: compiled(params, mu, nu, count)


def update_heavy_setup(variant: str, layers: int = 8, width: int = 2048):
    """A model whose loss is sum(p * G): the backward is trivial, the update is all.
    ``fg-comp-dict``: ``fg-comp`` on a params dict built by hand (one tensor per
    parameter) instead of ``fg.params(model)``."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    G = {}
    for name, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen)
        g[torch.rand(p.shape, generator=gen) < 0.3] = 0.0
        G[name] = g
    if variant == "hand-comp":
        return _hand_written(lambda p: sum((p[k] * G[k]).sum() for k in p), per_name(model))
    if variant.startswith(("fg-comp", "fg-ingraph", "acc-")):
        groups = fg.group_by_module(model)
        tx = fg.chain(fg.per_group(RULE, groups), fg.adam())
        if variant.startswith("acc-"):  # acc-mid: every call is a non-final micro-step
            every = 10**9 if variant == "acc-mid" else int(variant.split("-")[1])
            tx = fg.accumulate(tx, every=every)
        params = per_name(model) if variant == "fg-comp-dict" else fg.params(model)
        state = tx.init(params)

        def loss_fn(p):
            return sum((p[k] * G[k]).sum() for k in p)

        if variant == "fg-ingraph":
            return _in_graph_donation(loss_fn, tx, params, state)
        step = fg.make_step(loss_fn, tx, compile=True, donate=True)
        return lambda: step(params, state)
    fused = variant == "fused"
    opt = torch.optim.Adam(model.parameters(), fused=fused, foreach=not fused)
    groups = fg.group_by_module(model)
    named = dict(model.named_parameters())

    def torch_step():
        opt.zero_grad()
        sum((named[k] * G[k]).sum() for k in named).backward()
        if not fused:
            eager_rule_on_grads(model, groups)
        opt.step()

    return torch_step


GPT_VARIANTS = ("fg-comp", "fg-grads", "torch.compile+fused")


def gpt_setup(variant: str, dim: int = 128, layers: int = 2) -> Callable[[], object]:
    """One step of the tiny GPT of examples/char_gpt.py (tied embeddings, causal SDPA,
    dropout off for a deterministic comparison): ``fg-comp`` is funcgrad's compiled,
    donated step (per-block zero rule + AdamW), ``fg-grads`` the same with
    ``compile="gradients"``, ``torch.compile+fused`` torch.compile of the model's
    forward + backward and torch.optim.AdamW(fused=True) (no rule)."""
    model, x, y = gpt_problem(dim, layers, batch=16)

    def ce(logits: torch.Tensor) -> torch.Tensor:
        return gpt_ce(logits, y)

    if variant == "torch.compile+fused":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        fwd = torch.compile(model)

        def torch_step() -> None:
            opt.zero_grad()
            ce(fwd(x)).backward()
            opt.step()

        return torch_step
    tx = fg.chain(fg.per_group(RULE, fg.group_by_module(model, depth=2)), fg.adamw(lr=1e-3))
    params = fg.params(model)
    state = tx.init(params)
    mode = True if variant == "fg-comp" else "gradients"
    step = fg.make_step(lambda p, x: ce(fg.call(model, p, x)), tx, compile=mode, donate=True)
    return lambda: step(params, state, x)


def gpt_variants() -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    """The GPT_VARIANTS, each after its first call (timed: compiling, with whatever
    torch's on-disk caches hold; ``cold_first_calls`` times them in fresh processes)."""
    fns: dict[str, Callable[[], object]] = {}
    first: dict[str, float] = {}
    for variant in GPT_VARIANTS:
        fns[variant] = gpt_setup(variant)
        t = time.perf_counter()
        fns[variant]()
        first[variant] = time.perf_counter() - t
    return fns, first


UPDATE_VARIANTS = ("fg-comp", "fg-ingraph", "hand-comp", "fused", "foreach+rule")


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(variant: str, layers: int, width: int) -> None:
    """Peak RSS during the first three steps of one variant (own process).

    The peak (VmHWM) is reset after set-up by writing 5 to /proc/self/clear_refs
    (Linux), so set-up temporaries do not count; what stays resident (params, the
    fixed gradients G, funcgrad's Adam state made by init) does. torch.optim makes
    its state lazily in the first step, so it shows in its "extra".
    """
    fn = update_heavy_setup(variant, layers, width)
    before = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    for _ in range(3):
        fn()
    peak = _status_mib("VmHWM")
    print(json.dumps({"variant": variant, "peak_mib": peak, "extra_mib": peak - before}))


FIRST_MODES = ("step", "gradients", "grad-only")


def first_step_child(mode: str) -> None:
    """The first call of one step in a fresh process (compile included), with whatever
    torch's on-disk caches hold (the parent sets the dir). The MLP's donated step:
    ``step`` is ``compile=True``, ``gradients`` is ``compile="gradients"``,
    ``grad-only`` is ``torch.compile`` of ``torch.func.grad_and_value`` of the same
    loss (target 1's reference); ``gpt:<variant>`` is one of GPT_VARIANTS."""
    if mode.startswith("gpt:"):
        call = gpt_setup(mode[4:])
    else:
        torch.manual_seed(0)
        model = mlp()
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

        def loss_fn(p, x, y):
            return nn.functional.cross_entropy(fg.call(model, p, x), y)

        if mode == "grad-only":
            grad_fn = torch.compile(torch.func.grad_and_value(loss_fn), fullgraph=True)
            plain = per_name(model)
            call = lambda: grad_fn(plain, x, y)  # noqa: E731
        else:
            tx = fg.chain(fg.per_group(RULE, fg.group_by_module(model)), fg.adam())
            params = fg.params(model)
            state = tx.init(params)
            step = fg.make_step(loss_fn, tx, compile=True if mode == "step" else mode, donate=True)
            call = lambda: step(params, state, x, y)  # noqa: E731
    t = time.perf_counter()
    call()
    print(json.dumps({"first_step_s": time.perf_counter() - t}))


def cold_first_calls(modes: tuple[str, ...]) -> dict[str, float]:
    """Each mode's first call in its own fresh process with an empty cache dir and the
    FX graph / AOTAutograd caches off, alternating, twice: the smaller of each pair
    (single cold compiles scatter by a few seconds here)."""
    import tempfile

    out: dict[str, float] = {}
    for _ in range(2):
        for mode in modes:
            with tempfile.TemporaryDirectory() as cache:
                env = cold_caches(cache)
                s = run_child("--child", "first", "--variant", mode, env=env)["first_step_s"]
            out[mode] = min(s, out.get(mode, s))
    return out


def run_child(*args: str, env: dict[str, str] | None = None) -> dict:
    return run_json([__file__, *args], env)


# --- --part layout-eager / layout-compiled / layout-update / processes ----------------


def layout_eager(layers_list: list[int]) -> dict:
    """The eager donated step on ``fg.params(model)`` (flat) against a params dict
    built by hand (one tensor per parameter), beside the hook answer + Adam and a plain
    step without a rule (``loss.backward()`` + ``Adam(foreach=True)``), for each model
    of :func:`common.problem` (0 is the MLP, L > 0 is L blocks of Linear(64, 64))."""
    results = {}
    for layers in layers_list:
        calls: dict[str, Callable[[], object]] = {}
        for name in ("flat", "per-tensor"):
            m, loss, x, y = problem(layers)
            tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), fg.adam())
            params = per_name(m) if name == "per-tensor" else fg.params(m)
            state = tx.init(params)
            step = fg.make_step(loss, tx, donate=True)
            calls[name] = lambda s=step, p=params, st=state, x=x, y=y: s(p, st, x, y)
        for name in ("hook answer", "plain torch"):
            m, loss, x, y = problem(layers)
            if name == "hook answer":
                attach_hook_answer(m)
            opt = torch.optim.Adam(m.parameters(), foreach=True)

            def torch_step(m=m, opt=opt, x=x, y=y, mse=layers > 0) -> None:
                opt.zero_grad()
                out = m(x)
                loss = ((out - y) ** 2).mean() if mse else nn.functional.cross_entropy(out, y)
                loss.backward()
                opt.step()

            calls[name] = torch_step
        ms = {k: v * 1e3 for k, v in interleaved(calls, 7, 20, warmup=1).items()}
        tensors = sum(1 for _ in m.parameters())
        print(f"eager step, {layers or 'MLP'} layers ({tensors} tensors):")
        for name, t in ms.items():
            ratios = ", ".join(f"{t / ms[o]:.2f}x {o}" for o in ms if o != name)
            print(f"  {name:12s} {t:7.2f} ms   ({ratios})")
        results[str(layers)] = ms
    return results


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _compiled_mlp(flat: bool, rule: bool, device: str) -> tuple[Callable[[], object], float]:
    """The compiled donated MLP step (Adam, the seed rule in front with ``rule``) on
    the flat or the per-tensor layout, and its first call's seconds."""
    torch.manual_seed(0)
    m = mlp().to(device)
    x, y = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)

    def loss(p, x, y):
        return nn.functional.cross_entropy(fg.call(m, p, x), y)

    adam = fg.adam()
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(m)), adam) if rule else adam
    params = fg.params(m) if flat else per_name(m)
    state = tx.init(params)
    step = fg.make_step(loss, tx, compile=True, donate=True)
    t = time.perf_counter()
    step(params, state, x, y)
    _sync(device)
    return (lambda: step(params, state, x, y)), time.perf_counter() - t


def _launches(f: Callable[[], object], device: str, calls: int = 20) -> float:
    """Kernels launched per call: CUDA kernel events on the GPU; on the CPU, the ATen
    calls the profiler records (extern kernels; inductor's C++ code is one call)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            f()
        _sync(device)
    if device == "cuda":
        n = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    else:
        n = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return n / calls


def layout_compiled(device: str, repeats: int) -> dict:
    """The compiled MLP step on the flat layout against the per-tensor one, with and
    without the seed rule: time, kernels (or ATen calls) per step, first call."""
    results = {}
    for rule in (False, True):
        name = "seed rule + adam" if rule else "adam"
        fns, firsts = {}, {}
        for layout in ("flat", "dict"):
            fns[layout], firsts[layout] = _compiled_mlp(layout == "flat", rule, device)
        steps = interleaved(fns, repeats, 30, sync=lambda: _sync(device))
        ms = {k: v * 1e3 for k, v in steps.items()}
        count = {k: _launches(f, device) for k, f in fns.items()}
        what = "kernel launches" if device == "cuda" else "ATen calls"
        print(
            f"{name:17s} step  flat {ms['flat']:6.2f} ms  dict {ms['dict']:6.2f} ms"
            f"  ratio {steps['flat'] / steps['dict']:.2f}\n"
            f"{'':17s} {what} per step  flat {count['flat']:.0f}  dict {count['dict']:.0f}\n"
            f"{'':17s} first call flat {firsts['flat']:.1f} s  dict {firsts['dict']:.1f} s"
        )
        results[name] = {"ms": ms, "calls": count, "first_s": firsts}
    return results


def layout_update(layers: int, width: int) -> dict:
    """The update-heavy step, compiled, on the flat layout against the per-tensor one
    and ``Adam(fused=True)`` without a rule. (glibc serves each allocation of 32 MiB or
    more with a fresh ``mmap`` whose pages fault on first write;
    ``MALLOC_MMAP_THRESHOLD_=4294967296`` turns that off.)"""
    fns = {
        "flat": update_heavy_setup("fg-comp", layers, width),
        "per-tensor": update_heavy_setup("fg-comp-dict", layers, width),
        "fused": update_heavy_setup("fused", layers, width),
    }
    t = interleaved(fns, 5, 3)
    print(f"update-heavy step, {layers * width * width / 1e6:.1f}M parameters")
    for k, v in t.items():
        print(f"  {k:12s} {v * 1e3:8.2f} ms   {v / t['fused']:5.2f}x fused Adam (no rule)")
    return t


PROCESS_CHILD = """
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


def processes(optimizer: str, count: int) -> list[float]:
    """One compiled SGD (or Adagrad) step on 4 x (512 x 512) matrices timed in
    ``count`` fresh processes (median of 9 blocks of 100 steps each): how single
    processes scatter (on the 2-core machine this was written on, some ran the step
    about 3x slower than others for their whole life)."""
    ms = []
    for i in range(count):
        code = PROCESS_CHILD.replace("{opt}", optimizer)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"process {i} failed:\n{out.stderr[-2000:]}")
        ms.append(float(out.stdout.split()[-1]))
        print(f"process {i}: {ms[-1]:.3f} ms/step", flush=True)
    print(f"{optimizer}: median over {len(ms)} processes {statistics.median(ms):.3f} ms "
          f"(range {min(ms):.3f}-{max(ms):.3f})")  # fmt: skip
    return ms


PARTS = ("all", "layout-eager", "layout-compiled", "layout-update", "processes")


def main() -> None:
    ap = argparse.ArgumentParser(description="funcgrad step benchmarks")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and a smaller update model")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--part", choices=PARTS, default="all",
        help="all: the step tables; layout-*: the flat layout against one tensor per "
        "parameter (eager, compiled, update-heavy); processes: one step's spread "
        "across fresh processes",
    )  # fmt: skip
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 200], help="layout-eager")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="layout-compiled")
    ap.add_argument("--optimizer", choices=("sgd", "adagrad"), default="sgd", help="processes")
    ap.add_argument("--processes", type=int, default=8, help="processes")
    ap.add_argument("--child", choices=["memory", "first"], help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    layers, width = (8, 1024) if args.quick else (8, 2048)
    if args.child == "memory":
        return memory_child(args.variant, layers, width)
    if args.child == "first":
        return first_step_child(args.variant or "step")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}")
    if args.part != "all":
        part: object
        if args.part == "layout-eager":
            part = layout_eager(args.layers)
        elif args.part == "layout-compiled":
            part = layout_compiled(args.device, 5 if args.quick else 9)
        elif args.part == "layout-update":
            part = layout_update(layers, width)
        else:
            part = processes(args.optimizer, args.processes)
        suffix = "" if args.device == "cpu" else f"_{args.device}"
        write_json(args.out, f"bench_step_{args.part}{suffix}", part)
        return

    repeats, number = (5, 10) if args.quick else (9, 20)
    results: dict = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    lines: list[str] = []

    for name, make, x, y in (
        ("mlp", mlp, torch.randn(64, 256), torch.randint(0, 10, (64,))),
        ("cnn", cnn, torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))),
    ):
        fns, compile_s = step_variants(make, x, y)
        t = interleaved(fns, repeats, number)
        results[name] = {"seconds": t, "compile_s_warm_cache": compile_s}
        lines.append(f"\n{name} step (median of {repeats}x{number}; ratio vs (a) hook)")
        for k, v in t.items():
            lines.append(f"  {k:14s} {v * 1e3:8.3f} ms   {v / t['(a) hook']:5.2f}x")
        over = t["(d) fg-comp"] / t["fwd+bwd"]
        floor = t["torch.compile+fused"] / t["fwd+bwd"]
        per_tensor = t["(f) fg-comp-dict"] / t["fwd+bwd"]
        results[name]["overhead_vs_fwd_bwd"] = over
        results[name]["per_tensor_vs_fwd_bwd"] = per_tensor
        results[name]["torch_fused_vs_fwd_bwd"] = floor
        lines.append(
            f"  overhead: (d) / compiled fwd+bwd = {over:.2f}x (target <= 1.15); "
            f"per tensor, (f) / it = {per_tensor:.2f}x"
        )
        lines.append(
            f"  torch.compile(model) + Adam(fused=True), no rule / compiled fwd+bwd = "
            f"{floor:.2f}x; (d) / it = {t['(d) fg-comp'] / t['torch.compile+fused']:.2f}x"
        )
        lines.append(f"  (d) / (a) = {t['(d) fg-comp'] / t['(a) hook']:.2f}x (target <= 0.6)")
        e_d = t["(e) fg-grads"] / t["(d) fg-comp"]
        lines.append(f"  (e) / (d) = {e_d:.2f}x (compile='gradients' against the whole graph)")

    fns, first = gpt_variants()
    t = interleaved(fns, repeats, max(2, number // 4))
    results["gpt"] = {"seconds": t, "first_call_s": first}
    lines.append("\ntiny GPT (2 blocks, dim 128, 64 tokens x 16; examples/char_gpt.py's model)")
    for k, v in t.items():
        ratio = v / t["torch.compile+fused"]
        lines.append(f"  {k:20s} {v * 1e3:8.2f} ms   {ratio:5.2f}x   first call {first[k]:6.1f} s")

    fns = {v: update_heavy_setup(v, layers, width) for v in UPDATE_VARIANTS}
    t = interleaved(fns, max(3, repeats // 2), 3)
    nparams = layers * width * width
    results["update_heavy"] = {"params": nparams, "seconds": t}
    lines.append(f"\nupdate-heavy step, {nparams / 1e6:.1f}M params, 30% zero grads")
    for k, v in t.items():
        lines.append(
            f"  {k:14s} {v * 1e3:8.2f} ms   {v / t['fused']:5.2f}x vs fused (no rule)   "
            f"{v / t['hand-comp']:5.2f}x hand-comp (the floor)"
        )

    fns = {v: update_heavy_setup(v, layers, width) for v in ("fg-comp", "acc-mid", "acc-4")}
    t = interleaved(fns, max(3, repeats // 2), 4)
    results["accumulate"] = {"seconds": t}
    lines.append("\ngradient accumulation, update-heavy model (ratio vs fg-comp, a plain step)")
    for k, v in t.items():
        lines.append(f"  {k:14s} {v * 1e3:8.2f} ms   {v / t['fg-comp']:5.2f}x")

    lines.append("\npeak RSS during the first 3 update-heavy steps (own process each)")
    mem = {}
    for v in UPDATE_VARIANTS:
        mem[v] = run_child(
            "--child", "memory", "--variant", v, *(["--quick"] if args.quick else [])
        )
    results["memory_mib"] = mem
    for v, r in mem.items():
        lines.append(
            f"  {v:14s} {r['peak_mib']:8.1f} MiB  {r['peak_mib'] / mem['fused']['peak_mib']:5.2f}x"
            f" vs fused   (+{r['extra_mib']:.1f} MiB above set-up)"
        )

    cold_first = cold_first_calls(FIRST_MODES)
    results["mlp_first_call_cold_s"] = cold_first
    ref = cold_first["grad-only"]
    lines.append("\nMLP first call, fresh process, empty caches (smaller of two alternating runs)")
    for mode, v in cold_first.items():
        lines.append(f"  {mode:10s} {v:6.1f} s   {v / ref:5.2f}x grad-only (target 1: step <= 1.1)")
    cold_gpt = cold_first_calls(tuple(f"gpt:{v}" for v in GPT_VARIANTS))
    results["gpt_first_call_cold_s"] = cold_gpt
    ref = cold_gpt["gpt:torch.compile+fused"]
    lines.append("tiny GPT first call, the same way")
    for mode, v in cold_gpt.items():
        lines.append(f"  {mode[4:]:20s} {v:6.1f} s   {v / ref:5.2f}x torch.compile+fused")

    import tempfile

    with tempfile.TemporaryDirectory() as cache:  # empty: the first process compiles
        env = {"TORCHINDUCTOR_CACHE_DIR": cache}
        cold_first = run_child("--child", "first", env=env)["first_step_s"]
        warm_first = run_child("--child", "first", env=env)["first_step_s"]
    results["mlp_first_step_s"] = {"cold": cold_first, "warm": warm_first}
    lines.append(
        f"MLP first step in a fresh process: {cold_first:.1f} s with empty caches, "
        f"{warm_first:.1f} s in a second process with torch's on-disk caches "
        f"(target <= 5 s)"
    )

    print("\n".join(lines))
    write_json(args.out, "bench_step", results)


if __name__ == "__main__":
    main()
