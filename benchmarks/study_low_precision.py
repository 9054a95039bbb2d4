"""How far inductor's compiled update is from the eager one in float16/bfloat16, with
and without ``emulate_precision_casts`` (docs/compile-notes.md, "Low precision").

One update of each funcgrad optimizer from the same state on two 16x8 matrices, eager
and under ``torch.compile`` (inductor), as a fraction of the largest update. funcgrad's
compiled steps pass ``emulate_precision_casts=True`` (``funcgrad.step._checks.eager_rounding``).

Run: python benchmarks/study_low_precision.py  (about a minute on 2 cores)
"""

from __future__ import annotations

import torch

import funcgrad as fg


def optimizers() -> dict[str, fg.GradientTransformation]:
    return {
        "muon": fg.muon(lr=2e-2),
        "adamw": fg.adamw(lr=1e-2, weight_decay=0.1),
        "adafactor": fg.adafactor(lr=1e-2),
        "adam": fg.adam(lr=1e-2),
        "adagrad": fg.adagrad(lr=1e-2),
        "rmsprop": fg.rmsprop(lr=1e-2, momentum=0.5, centered=True),
        "sgd": fg.sgd(lr=1e-2, momentum=0.9, nesterov=True),
        "lion": fg.lion(lr=1e-3, weight_decay=0.1),
    }


def gaps(dtype: torch.dtype, emulate: bool) -> dict[str, float]:
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(16, 8, generator=g).to(dtype) for k in ("w", "v")}
    grads = {k: torch.randn(16, 8, generator=g).to(dtype) for k in params}
    txs = optimizers()
    states = {n: tx.init(params) for n, tx in txs.items()}

    def new_params(params, states, grads):
        return {
            n: fg.apply_updates(params, tx.update(grads, states[n], params)[0])
            for n, tx in txs.items()
        }

    eager = new_params(params, states, grads)
    options = {"emulate_precision_casts": emulate}
    compiled = torch.compile(new_params, fullgraph=True, options=options)(params, states, grads)
    out = {}
    for n in txs:
        step = max(float((eager[n][k].float() - params[k].float()).abs().max()) for k in params)
        gap = max(float((eager[n][k].float() - compiled[n][k].float()).abs().max()) for k in params)
        out[n] = gap / step
    return out


def main() -> None:
    print(torch.__version__, "| compiled - eager, as a fraction of the largest update")
    table = {
        (dt, em): gaps(dt, em) for dt in (torch.bfloat16, torch.float16) for em in (False, True)
    }
    print(f"{'optimizer':10s} {'bf16':>8s} {'bf16+emu':>9s} {'fp16':>8s} {'fp16+emu':>9s}")
    for n in optimizers():
        row = [table[(dt, em)][n] for dt in (torch.bfloat16, torch.float16) for em in (False, True)]
        print(
            f"{n:10s} "
            + " ".join(f"{v:8.3g}" if i % 2 == 0 else f"{v:9.3g}" for i, v in enumerate(row))
        )


if __name__ == "__main__":
    main()
