"""funcgrad against JAX + optax on the same step, side by side in one run.

The step: MLP 256-512-512-512-10, batch 64, cross-entropy, the seed's rule per layer
(all-zero layer -> 1.0, zero entries -> 0.5), Adam(1e-3). In JAX the rule is written
with ``jnp.where`` and the step is ``jax.jit`` with donated params and state; in
funcgrad it is ``fg.make_step(compile=True, donate=True)``. Before timing, both run
three steps from the same weights and data and must agree (float64, 1e-9); the
timing runs in float32.

Reported: step time (interleaved medians, ratio funcgrad / JAX), and each one's first
call (JAX's jit compile; funcgrad's compile, measured in a fresh process with
torch's caches disabled, and with them warm).

Opacus, per-sample clipping (DP-SGD without noise, so the updates can be compared):
the same MLP and batch, each sample's whole gradient clipped to norm 1.0, the mean,
Adam(1e-3). funcgrad: ``make_step(fg.adam(), per_sample=fg.clip_by_global_norm(1.0),
compile=True, donate=True)`` (``vmap`` of ``grad``). Opacus 1.6: ``GradSampleModule``
in its hooks and functorch modes with ``DPOptimizer``, and ghost clipping
(``GradSampleModuleFastGradientClipping`` + ``DPOptimizerFastGradientClipping`` +
``DPLossFastGradientClipping``). Each must agree with funcgrad after three float64
steps (1e-9) before the float32 timing (interleaved medians).

Hugging Face models (``--hf``; needs transformers and opacus): tiny GPT-2
(LM head, tied embeddings) and BERT (sequence classification), random weights, batch
16 x 32 tokens, float64. fg.ghost_clip's clipped mean gradient against each Opacus mode
(ghost, fast gradient clipping without ghost, hooks), noise 0, where Opacus runs; where
it raises, the error and where in Opacus it came from.

Needs the optional extra: ``pip install -e ".[bench]"`` (jax, optax, opacus). Without a
peer the script says so, skips that part and exits 0.

Run: python benchmarks/bench_peers.py [--hf]
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from functools import partial
from typing import Any

import torch
from common import RESULTS, interleaved
from torch import nn

import funcgrad as fg

SIZES = (256, 512, 512, 512, 10)


def torch_mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
        layers.append(nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(dtype)


def data(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 256, generator=g, dtype=torch.float64).to(dtype)
    return x, torch.randint(0, 10, (64,), generator=g)


def funcgrad_step(model: nn.Module):
    tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)), fg.adam(1e-3))
    params = fg.params(model)
    state = tx.init(params)

    def loss_fn(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    step = fg.make_step(loss_fn, tx, compile=True, donate=True)
    return step, params, state


def jax_step(model: nn.Module):
    import jax
    import jax.numpy as jnp
    import optax

    linears = [m for m in model if isinstance(m, nn.Linear)]
    params = [
        (jnp.asarray(m.weight.detach().numpy().T), jnp.asarray(m.bias.detach().numpy()))
        for m in linears
    ]

    def loss_fn(params, x, y):
        h = x
        for i, (w, b) in enumerate(params):
            h = h @ w + b
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    def rule(layer):  # the seed's rule on one layer's (weight, bias)
        dead = jnp.all(jnp.stack([jnp.all(g == 0) for g in layer]))
        value = jnp.where(dead, 1.0, 0.5)
        return tuple(jnp.where(g == 0, value.astype(g.dtype), g) for g in layer)

    opt = optax.adam(1e-3)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = [rule(layer) for layer in grads]
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), params, opt.init(params)


def check_same_update() -> float:
    """Three steps each from the same weights and data, in float64 (in float32 the two
    libraries' different summation orders flip the sign of near-zero gradients, which
    Adam turns into full steps): largest relative difference."""
    import jax
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    model = torch_mlp(torch.float64)
    fstep, fparams, fstate = funcgrad_step(model)
    jstep, jparams, jstate = jax_step(torch_mlp(torch.float64))
    for i in range(3):
        x, y = data(i, torch.float64)
        fparams, fstate, _ = fstep(fparams, fstate, x, y)
        jparams, jstate, _ = jstep(jparams, jstate, x.numpy(), y.numpy())
    worst = 0.0
    linears = [k for k in fparams if k.endswith(".weight")]
    for k, (jw, jb) in zip(linears, jparams, strict=True):
        for ours, theirs in (
            (fparams[k].numpy().T, np.asarray(jw)),
            (fparams[k.replace("weight", "bias")].numpy(), np.asarray(jb)),
        ):
            worst = max(worst, float(np.abs(ours - theirs).max() / np.abs(theirs).max()))
    jax.config.update("jax_enable_x64", False)
    return worst


def first_call_child() -> None:
    step, params, state = funcgrad_step(torch_mlp())
    x, y = data()
    t = time.perf_counter()
    step(params, state, x, y)
    print(json.dumps({"first_call_s": time.perf_counter() - t}))


def funcgrad_first_call(env: dict[str, str]) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child"],
        capture_output=True, text=True, check=True, env={**os.environ, **env},
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])["first_call_s"]


CLIP, LR = 1.0, 1e-3


def funcgrad_dp_step(model: nn.Module, compile: bool, ghost: bool = False):
    def loss_fn(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    tx = fg.adam(LR)
    params = fg.params(model)
    state = tx.init(params)
    clip = fg.ghost_clip(CLIP) if ghost else fg.clip_by_global_norm(CLIP)
    step = fg.make_step(loss_fn, tx, per_sample=clip, compile=compile, donate=True)
    return lambda x, y: step(params, state, x, y), params


def opacus_dp_step(model: nn.Module, mode: str):
    """One DP step (noise 0) of Opacus in ``mode``; returns (step, live parameters)."""
    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    batch = 64
    if mode == "ghost":
        gsm = GradSampleModuleFastGradientClipping(
            model, max_grad_norm=CLIP, use_ghost_clipping=True, loss_reduction="mean"
        )
        opt = DPOptimizerFastGradientClipping(
            torch.optim.Adam(gsm.parameters(), lr=LR),
            noise_multiplier=0.0,
            max_grad_norm=CLIP,
            expected_batch_size=batch,
            loss_reduction="mean",
        )
        criterion = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss(), "mean")

        def ghost_step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            criterion(gsm(x), y).backward()
            opt.step()

        return ghost_step, dict(model.named_parameters())
    gsm = GradSampleModule(model, force_functorch=(mode == "functorch"))
    dp = DPOptimizer(
        torch.optim.Adam(gsm.parameters(), lr=LR),
        noise_multiplier=0.0,
        max_grad_norm=CLIP,
        expected_batch_size=batch,
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        dp.zero_grad()
        nn.functional.cross_entropy(gsm(x), y).backward()
        dp.step()

    return step, dict(model.named_parameters())


OPACUS_MODES = ("hooks", "functorch", "ghost")


def funcgrad_clipped_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """The mean of the clipped per-sample gradients fg.ghost_clip hands to ``tx``."""
    seen = {}

    def capture(grads, params):
        seen.update({k: v.clone() for k, v in grads.items()})
        return grads

    def loss_fn(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    tx = fg.chain(fg.stateless(capture), fg.sgd(LR))
    params = {k: v.clone() for k, v in fg.params(model).views().items()}
    fg.make_step(loss_fn, tx, per_sample=fg.ghost_clip(CLIP))(params, tx.init(params), x, y)
    return seen


def opacus_clipped_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """The gradient Opacus's ghost clipping hands to its optimizer (noise 0)."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(
        model, max_grad_norm=CLIP, use_ghost_clipping=True, loss_reduction="mean"
    )
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(gsm.parameters(), lr=LR), noise_multiplier=0.0, max_grad_norm=CLIP,
        expected_batch_size=x.shape[0], loss_reduction="mean",
    )  # fmt: skip
    criterion = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss(), "mean")
    opt.zero_grad()
    criterion(gsm(x), y).backward()
    opt.pre_step()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def opacus_main() -> dict[str, object]:
    import opacus

    worst = {}
    for mode in OPACUS_MODES:
        ours, fparams = funcgrad_dp_step(torch_mlp(torch.float64), compile=False)
        theirs, oparams = opacus_dp_step(torch_mlp(torch.float64), mode)
        for i in range(3):
            x, y = data(i, torch.float64)
            ours(x, y)
            theirs(x, y)
        worst[mode] = max(
            float((fparams[k] - oparams[k].detach()).abs().max() / oparams[k].detach().abs().max())
            for k in fparams
        )
    print(
        "same update (3 DP steps, float64, largest relative difference): "
        + ", ".join(f"{m} {d:.1e}" for m, d in worst.items())
    )
    # fg.ghost_clip against Opacus's ghost clipping, on the clipped mean gradient itself
    # (float64 and float32): after Adam steps float32 rounding of near-zero gradient
    # entries shows (Adam moves an entry by about lr whatever its size), after SGD
    # steps the rounding of the parameters does.
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 1e-6)):
        x, y = data(0, dtype)
        ours = funcgrad_clipped_grads(torch_mlp(dtype), x, y)
        theirs = opacus_clipped_grads(torch_mlp(dtype), x, y)
        name = f"fg.ghost_clip vs opacus ghost, clipped gradient ({str(dtype)[6:]})"
        worst[name] = max(
            float((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()) for k in ours
        )
        print(f"{name}: largest relative difference {worst[name]:.1e} (within {tol:g})")
        if not worst[name] < tol:
            raise SystemExit("fg.ghost_clip and Opacus's ghost clipping disagree")
    if not all(d < 1e-9 for m, d in worst.items() if m in OPACUS_MODES):
        raise SystemExit("funcgrad and Opacus disagree: not timing different things")
    x, y = data()
    steps = {"funcgrad": funcgrad_dp_step(torch_mlp(), compile=True)[0]}
    steps["funcgrad ghost"] = funcgrad_dp_step(torch_mlp(), compile=False, ghost=True)[0]
    steps["funcgrad ghost compiled"] = funcgrad_dp_step(torch_mlp(), compile=True, ghost=True)[0]
    steps |= {f"opacus {m}": opacus_dp_step(torch_mlp(), m)[0] for m in OPACUS_MODES}
    med = interleaved({k: partial(f, x, y) for k, f in steps.items()}, 7, 10)
    print(f"per-sample clipping, opacus {opacus.__version__}, median of 7x10 steps:")
    for k, v in med.items():
        print(
            f"  {k:24s} {v * 1e3:8.3f} ms   funcgrad / this {med['funcgrad'] / v:5.2f}   "
            f"funcgrad ghost / this {med['funcgrad ghost'] / v:5.2f}"
        )
    return {"opacus_step_s": med, "opacus_same_update_rel_diff": worst}


def hf_model(name: str) -> nn.Module:
    """common's tiny GPT-2 / BERT (random weights, nothing downloaded), taking ids
    and returning logits, in float64."""
    from common import hf_model as tiny

    inner = tiny(name)

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = inner

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=ids).logits

    return Logits().double()


def hf_main() -> dict[str, object]:
    """fg.ghost_clip against Opacus's three modes on tiny GPT-2 and BERT."""
    import traceback

    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 65, (16, 33), generator=g)
    labels = {"gpt2": ids[:, 1:], "bert": torch.randint(0, 10, (16,), generator=g)}
    x, out = ids[:, :-1], {}

    def ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def frozen(w: nn.Module) -> nn.Module:  # the embeddings out of training
        for n, p in w.named_parameters():
            p.requires_grad_("embeddings" not in n)
        return w

    for name in ("gpt2", "bert", "bert-frozen-embeddings"):
        y = labels[name.split("-")[0]]
        made = frozen if name.endswith("embeddings") else (lambda w: w)
        model = made(hf_model(name.split("-")[0]).eval())
        ours = funcgrad_clipped_grads_of(
            model, lambda p, x, y, m=model: ce(fg.call(m, p, x), y), x, y
        )

        def opacus(mode: str, name: str, made: Any, y: torch.Tensor) -> dict[str, torch.Tensor]:
            # Opacus records activations in train mode only (no dropout: configs' 0.0)
            w = made(hf_model(name.split("-")[0]).train())
            sgd = torch.optim.SGD([p for p in w.parameters() if p.requires_grad], lr=LR)
            if mode == "hooks":
                gsm = GradSampleModule(w)
                dp = DPOptimizer(sgd, noise_multiplier=0.0, max_grad_norm=CLIP,
                                 expected_batch_size=16)  # fmt: skip
                dp.zero_grad()
                ce(gsm(x), y).backward()
                dp.pre_step()
            else:
                gsm = GradSampleModuleFastGradientClipping(
                    w, max_grad_norm=CLIP, use_ghost_clipping=mode == "ghost",
                    loss_reduction="mean",
                )  # fmt: skip
                fgc = DPOptimizerFastGradientClipping(
                    sgd, noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=16,
                    loss_reduction="mean",
                )  # fmt: skip
                crit = DPLossFastGradientClipping(gsm, fgc, nn.CrossEntropyLoss(), "mean")
                fgc.zero_grad()
                logits = gsm(x)
                flat = logits.reshape(-1, logits.shape[-1])
                crit(flat, y.reshape(-1), shape=logits.shape).backward()
                fgc.pre_step()
            return {k: p.grad.detach() for k, p in w.named_parameters() if p.requires_grad}

        for mode in OPACUS_MODES_HF:
            key = f"{name} opacus {mode}"
            try:
                theirs = opacus(mode, name, made, y)
            except Exception as err:  # Opacus's own error, reported as found
                where = traceback.extract_tb(err.__traceback__)[-1]
                at = f"{where.filename.split('site-packages/')[-1]}:{where.lineno}"
                out[key] = f"{type(err).__name__}: {str(err)[:120]} ({at})"
                print(f"{key}: raised {out[key]}")
                continue
            worst = max(
                float((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()) for k in ours
            )
            out[key] = worst
            print(f"{key}: ran; largest relative difference from fg.ghost_clip {worst:.1e}")
    # Time per step where Opacus's hooks mode runs and agrees (BERT, embeddings frozen):
    # a DP-SGD step (noise 0) each, float64, interleaved medians.
    w = frozen(hf_model("bert").eval())
    y = labels["bert"]
    params = {k: v.clone() for k, v in fg.params(w).views().items()}
    tx = fg.sgd(LR)
    state = tx.init(params)
    ghost = fg.make_step(lambda p, x, y: ce(fg.call(w, p, x), y), tx,
                         per_sample=fg.ghost_clip(CLIP))  # fmt: skip
    vmapped = fg.make_step(lambda p, x, y: ce(fg.call(w, p, x), y), tx,
                           per_sample=fg.clip_by_global_norm(CLIP))  # fmt: skip
    o = frozen(hf_model("bert").train())
    gsm = GradSampleModule(o)
    dp = DPOptimizer(torch.optim.SGD([p for p in o.parameters() if p.requires_grad], lr=LR),
                     noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=16)  # fmt: skip

    def opacus_step() -> None:
        dp.zero_grad()
        ce(gsm(x), y).backward()
        dp.step()

    med = interleaved(
        {
            "fg.ghost_clip": lambda: ghost(params, state, x, y),
            "fg.clip_by_global_norm (vmap)": lambda: vmapped(params, state, x, y),
            "opacus hooks": opacus_step,
        },
        5,
        3,
    )
    print("BERT, embeddings frozen, one DP step (float64), median of 5x3:")
    for k, v in med.items():
        print(f"  {k:30s} {v * 1e3:8.1f} ms   / fg.ghost_clip {v / med['fg.ghost_clip']:5.2f}")
    return {"opacus_hf": out, "bert_frozen_step_s": med}


OPACUS_MODES_HF = ("ghost", "fast-gradient-clipping", "hooks")


def funcgrad_clipped_grads_of(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor):
    """The clipped mean gradient fg.ghost_clip hands to ``tx`` for ``loss_fn``."""
    seen: dict[str, torch.Tensor] = {}

    def capture(grads, params):
        seen.update({k: v.clone() for k, v in grads.items()})
        return grads

    tx = fg.chain(fg.stateless(capture), fg.sgd(LR))
    params = {k: v.clone() for k, v in fg.params(model).views().items()}
    fg.make_step(loss_fn, tx, per_sample=fg.ghost_clip(CLIP))(params, tx.init(params), x, y)
    return seen


def main() -> None:
    if "--child" in sys.argv:
        return first_call_child()
    result: dict[str, object] = {}
    if "--hf" in sys.argv:
        result |= hf_main()
        out = RESULTS
        out.mkdir(exist_ok=True)
        (out / "bench_peers_hf.json").write_text(json.dumps(result, indent=2))
        return
    try:
        import jax  # noqa: F401
        import optax  # noqa: F401
    except ImportError:
        print('bench_peers: jax and optax are not installed; pip install -e ".[bench]". Skipped.')
    else:
        result |= jax_main()
    try:
        import opacus  # noqa: F401
    except ImportError:
        print('bench_peers: opacus is not installed; pip install -e ".[bench]". Skipped.')
    else:
        result |= opacus_main()
    if result:
        out = RESULTS
        out.mkdir(exist_ok=True)
        (out / "bench_peers.json").write_text(json.dumps(result, indent=2))


def jax_main() -> dict[str, object]:
    import tempfile

    import jax

    diff = check_same_update()
    print(f"same update: largest relative difference after 3 steps {diff:.1e} (must be < 1e-9)")
    if not diff < 1e-9:
        raise SystemExit("funcgrad and JAX + optax disagree: not timing different things")

    fstep, fparams, fstate = funcgrad_step(torch_mlp())
    jstep, jparams, jstate = jax_step(torch_mlp())
    x, y = data()
    xj, yj = x.numpy(), y.numpy()
    t = time.perf_counter()
    jparams, jstate, loss = jstep(jparams, jstate, xj, yj)
    loss.block_until_ready()
    jax_first = time.perf_counter() - t
    fstep(fparams, fstate, x, y)

    state = {"j": (jparams, jstate)}

    def run_jax() -> None:
        p, s, loss = jstep(*state["j"], xj, yj)
        loss.block_until_ready()
        state["j"] = (p, s)

    fns = {"funcgrad": lambda: fstep(fparams, fstate, x, y), "jax+optax": run_jax}
    med = interleaved(fns, 9, 20, warmup=5)
    with tempfile.TemporaryDirectory() as cache:
        cold = funcgrad_first_call({"TORCHINDUCTOR_CACHE_DIR": cache})
        warm = funcgrad_first_call({"TORCHINDUCTOR_CACHE_DIR": cache})
    lines = [
        f"torch {torch.__version__}, jax {jax.__version__}, {torch.get_num_threads()} threads",
        f"step (median of 9x20): funcgrad {med['funcgrad'] * 1e3:.3f} ms, "
        f"jax+optax {med['jax+optax'] * 1e3:.3f} ms, "
        f"ratio funcgrad / jax {med['funcgrad'] / med['jax+optax']:.2f}",
        f"first call: jax jit {jax_first:.1f} s; funcgrad cold {cold:.1f} s "
        f"({cold / jax_first:.1f}x jax), warm caches {warm:.1f} s ({warm / jax_first:.1f}x jax)",
    ]
    print("\n".join(lines))
    result: dict[str, object] = {"step_s": med, "jax_first_s": jax_first}
    result |= {"fg_first_cold_s": cold, "fg_first_warm_s": warm, "same_update_rel_diff": diff}
    return result


if __name__ == "__main__":
    main()
