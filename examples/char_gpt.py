"""A tiny character-level GPT trained on Python's own source, with funcgrad.

A decoder-only transformer (token and position embeddings; blocks of LayerNorm,
causal ``F.scaled_dot_product_attention``, LayerNorm, GELU MLP; dropout; the output
head tied to the token embedding) learns to write Python from the source of the
standard library's ``textwrap`` module, which ships with every Python.

The loop uses:
  fg.accumulate    gradient accumulation (optax MultiSteps): every update sees the
                   mean gradient of --accumulate micro-batches
  fg.monitor       per-block gradient statistics (zero fraction, norm), kept in the
                   state and printed at the end
  fg.adamw         with a decay mask (no decay on biases, LayerNorm, embeddings)
  fg.warmup_cosine_decay

It prints a table of the per-block statistics and a sample of generated text, and
writes a PNG of the loss curve.

The whole step (forward, backward, accumulation, monitor, AdamW) is compiled as one
graph by default (``make_step(compile=True)``): the first step takes tens of seconds
(compiling), the others are the fastest. ``--compile gradients`` compiles only the
forward and backward (the update runs eagerly); ``--compile async`` trains eagerly
while the whole step compiles in the background, then switches (it prints where);
``--compile none`` runs eagerly.
After training it times ``--eager-steps`` micro-steps of the same step run eagerly on
copies of the parameters and state, and prints the first step's seconds and the
steps per second of both (benchmarks/README.md has more measurements).

Run: ``python examples/char_gpt.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import textwrap
import time
from pathlib import Path

from _cli import ShowDefaults


def parser() -> argparse.ArgumentParser:
    """The options (built before torch imports, so --help answers at once)."""
    ap = argparse.ArgumentParser(
        formatter_class=ShowDefaults,
        description="tiny char-level GPT on Python source, funcgrad",
    )
    ap.add_argument("--steps", type=int, default=1000, help="optimizer updates")
    ap.add_argument("--accumulate", type=int, default=2, help="micro-batches per update")
    ap.add_argument("--batch", type=int, default=32, help="sequences per micro-batch")
    ap.add_argument("--block", type=int, default=64, help="context length")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=5e-3, help="peak learning rate")
    ap.add_argument("--sample", type=int, default=300, help="characters to generate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--compile",
        nargs="?",
        const="step",
        default="step",
        choices=["none", "step", "gradients", "async"],
        help="compile the whole step (step), only its forward and backward "
        "(gradients), the whole step in the background while eager steps train "
        "(async), or nothing (none)",
    )
    ap.add_argument(
        "--eager-steps",
        type=int,
        default=20,
        help="micro-steps timed eagerly afterwards, for the speed table (0: none)",
    )
    ap.add_argument("--out", type=Path, default=Path("out"), help="output directory")
    return ap


if __name__ == "__main__":  # --help answers before torch is imported
    parser().parse_known_args()


import torch
from _cli import check_out_dir, summary
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

import funcgrad as fg


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, block: int, dim: int, layers: int, heads: int, dropout: float):
        super().__init__()
        self.block = block
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(dim, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: fg.params lists it once, as tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        return self.head(self.ln(self.blocks(x)))


def decays(name: str, p: torch.Tensor) -> bool:
    """Decay matrices of Linear layers only (not biases, LayerNorm or embeddings)."""
    return p.ndim == 2 and not name.startswith(("tok.", "pos."))


def corpus() -> str:
    return Path(textwrap.__file__).read_text(encoding="utf-8")


@torch.no_grad()
def sample(model: CharGPT, start: str, stoi, itos, n: int, seed: int) -> str:
    model.eval()
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([[stoi[c] for c in start]])
    for _ in range(n):
        logits = model(idx[:, -model.block :])[0, -1] / 0.8
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        idx = torch.cat([idx, nxt.view(1, 1)], 1)
    model.train()
    return "".join(itos[i] for i in idx[0].tolist())


MODES = {
    "step": "compiled (whole step)",
    "async": "async (eager, then compiled)",
    "gradients": "compiled (gradients only)",
    "none": "eager",
}


def _speed(first: float, rest: float, steps: int) -> tuple[float, float]:
    """The first step's seconds and the micro-steps per second after it."""
    return first, (steps / rest if steps > 0 and rest > 0 else float("nan"))


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    if min(args.steps, args.accumulate, args.batch, args.layers, args.heads) < 1:
        ap.error("--steps, --accumulate, --batch, --layers and --heads must be >= 1")
    if args.eager_steps < 0:
        ap.error(f"--eager-steps must be >= 0, got {args.eager_steps}")
    if args.block < 2 or args.dim % args.heads:
        ap.error("--block must be >= 2 and --dim a multiple of --heads")
    if not 0.0 <= args.dropout < 1.0:
        ap.error(f"--dropout must be in [0, 1), got {args.dropout}")
    check_out_dir(ap, args.out)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    torch.manual_seed(args.seed)
    text = corpus()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text])
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    model = CharGPT(len(chars), args.block, args.dim, args.layers, args.heads, args.dropout)

    groups = fg.group_by_module(model, depth=2)  # tok, pos, blocks.0, blocks.1, ln
    schedule = fg.warmup_cosine_decay(0.0, args.lr, max(1, args.steps // 10), args.steps + 1)
    inner = fg.named_chain(
        ("monitor", fg.monitor(groups)),
        ("adamw", fg.adamw(lr=schedule, weight_decay=0.1, mask=decays)),
    )
    tx = fg.accumulate(inner, every=args.accumulate)

    def loss_fn(p, x, y):
        logits = fg.call(model, p, x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    compile = {"none": False, "step": True, "gradients": "gradients", "async": "async"}[
        args.compile
    ]
    step = fg.make_step(loss_fn, tx, compile=compile, donate=True)
    params = fg.params(model)
    state = tx.init(params)
    gen = torch.Generator().manual_seed(args.seed)

    def batch(src: torch.Tensor, g: torch.Generator = gen) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.randint(len(src) - args.block - 1, (args.batch,), generator=g)
        x = torch.stack([src[s : s + args.block] for s in start.tolist()])
        y = torch.stack([src[s + 1 : s + args.block + 1] for s in start.tolist()])
        return x, y

    losses: list[float] = []
    t0 = time.perf_counter()
    micro_steps = args.steps * args.accumulate
    speeds = {}
    switch: tuple[int, float] | None = None  # async: the first compiled micro-step, when
    for i in tqdm(range(micro_steps), desc="char-gpt", mininterval=0.5):
        params, state, loss = step(params, state, *batch(train_data))
        losses.append(loss.item())
        if i == 0:
            first = time.perf_counter() - t0
        if switch is None and args.compile == "async" and step.is_compiled:
            switch = (i, time.perf_counter() - t0)
    elapsed = time.perf_counter() - t0
    speeds[MODES[args.compile]] = _speed(first, elapsed - first, micro_steps - 1)
    if args.eager_steps > 0 and args.compile != "none":
        # The same step run eagerly, on copies: the trained parameters do not move.
        eager = fg.make_step(loss_fn, tx, compile=False, donate=True)
        p2, s2 = copy.deepcopy(params), copy.deepcopy(state)
        g2 = torch.Generator().manual_seed(args.seed + 1)  # `gen` still draws the val batch
        t1 = time.perf_counter()
        for i in range(args.eager_steps):
            p2, s2, _ = eager(p2, s2, *batch(train_data, g2))
            if i == 0:
                first_eager = time.perf_counter() - t1
        rest = time.perf_counter() - t1 - first_eager
        speeds[MODES["none"]] = _speed(first_eager, rest, args.eager_steps - 1)

    model.eval()
    with torch.no_grad():
        xv, yv = batch(val_data)
        val = float(loss_fn(params, xv, yv))
    model.train()
    stats = state.inner["monitor"].stats
    print(f"\n{args.steps} updates x {args.accumulate} micro-batches in {elapsed:.0f} s")
    if args.compile == "async":
        print(
            f"async: first micro-step after {first:.2f} s; "
            + (
                f"compiled from micro-step {switch[0]} ({switch[1]:.1f} s)"
                if switch is not None
                else "the build did not finish before the end: every step ran eagerly"
            )
        )
    print()
    print(f"{'step':28s} {'first step':>10s} {'micro-steps/s':>13s}   (after the first)")
    for mode, (first_s, per_s) in speeds.items():
        print(f"{mode:28s} {first_s:9.2f}s {per_s:13.1f}")
    print(f"train loss (last 20 micro-batches) {sum(losses[-20:]) / 20:.3f}, val loss {val:.3f}")
    print(f"(uniform guess: {math.log(len(chars)):.3f} for {len(chars)} characters)\n")
    print(f"{'group':10s} {'zero frac':>9s} {'grad norm':>10s}   (fg.monitor, last update)")
    for g, s in stats.items():
        print(f"{g:10s} {float(s['zero_fraction']):9.4f} {float(s['norm']):10.4f}")
    text_out = sample(model, "def ", stoi, chars, args.sample, args.seed)
    print("\nsample:\n" + text_out)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(losses, lw=0.8)
    ax.set(title="char GPT: training loss per micro-batch", xlabel="micro-batch", ylabel="loss")
    fig.tight_layout()
    png = args.out / "char_gpt.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    result = {
        "updates": int(state.inner["adamw"].count),
        "train_loss": sum(losses[-20:]) / min(20, len(losses)),
        "val_loss": val,
        "uniform_loss": math.log(len(chars)),
        "seconds": elapsed,
        "sample": text_out,
        "speeds": {m: {"first_step_s": f, "steps_per_s": r} for m, (f, r) in speeds.items()},
        "switch": None if switch is None else {"micro_step": switch[0], "seconds": switch[1]},
    }
    (args.out / "char_gpt.json").write_text(json.dumps(result, indent=2))
    print(f"\nfigure: {png.resolve()}")
    summary(
        "char_gpt",
        updates=result["updates"],
        train_loss=result["train_loss"],
        val_loss=val,
        uniform_loss=result["uniform_loss"],
        first_step_s=first,
        steps_per_s=speeds[MODES[args.compile]][1],
        eager_steps_per_s=speeds.get(MODES["none"], (0.0, float("nan")))[1],
    )
    return {**result, "png": str(png)}


if __name__ == "__main__":
    main()
