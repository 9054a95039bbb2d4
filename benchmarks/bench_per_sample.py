"""Per-sample work: fg.ghost_clip vs the vmap path vs a plain step; per-sample rules.

``--part clip`` (the default): per-sample clipping.

Three models, eager steps (make_step, Adam, donated), timed side by side in one process,
interleaved, median of repeats: the MLP 512-1024x4-10 at batch 256 (the issue's), the
tiny GPT of examples/char_gpt.py (2 blocks, dim 128, 64 tokens, batch 16, tied head,
positional embedding) and a small CNN (two convolutions, GroupNorm, batch 64). Peak
memory of each step: the growth of the peak resident memory over a run of that step
alone, each in a fresh subprocess (CPU: no allocator statistics; Linux's VmHWM).

Targets (issue "ghost_clip"): ghost <= 0.5x vmap and <= 2x plain on the MLP; <= 2x plain
on the GPT and the CNN; peak memory <= 1.5x the plain step's.

Hugging Face GPT-2, Gemma, BERT and T5 (``--models hf-gpt2,hf-gemma,hf-bert,hf-t5``;
needs transformers): the same sizes as the tiny GPT (2 layers, dim 128, 64 tokens, batch 16;
T5: 2 layers each side, the tokens as encoder and decoder input), random weights;
``hf-gpt2@768x4x128x8192``: dim 768 (GPT-2 small's width, 12 heads), 4 layers, 128
tokens, a vocabulary of 8192.
``vit``: timm's VisionTransformer form (the root owns ``cls_token`` and ``pos_embed``:
ghost clipping's fallback for the root), 32x32 images in 4x4 patches, 2 blocks, dim
128, batch 16; ``vit-frozen``: the same with those two frozen (no fallback at all).

timm's ViT, DeiT (distilled) and ConvNeXt, torchvision's ViT, ResNet-18 and MobileNetV3
(``--models timm-vit,timm-deit,timm-convnext,tv-vit,tv-resnet18,tv-mobilenet``; needs
timm and torchvision, which load beside torch 2.14.1): 32x32 images, batch 8, eval mode.

``--part rule``: per-sample gradients and a per-sample rule (the zero rule per layer on
every sample's gradients, then the mean) on the MLP 256-512-512-512-10, batch 64: a
Python loop over samples, vmap eager, vmap compiled (target: vmap at least 10x faster
than the loop).

Run: python benchmarks/bench_per_sample.py [--quick] [--part clip|rule]
     [--models mlp,gpt,cnn,hf-gpt2,hf-gemma,hf-bert,hf-t5,vit,vit-frozen,timm-vit,...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import RESULTS, example, hf_model, interleaved, mlp, run_json, write_json
from torch import nn

import funcgrad as fg


class ViT(nn.Module):
    """timm's VisionTransformer form, written here: patch embedding (a Linear on
    flattened 4x4 patches), a class token and position embeddings owned by the root,
    pre-norm blocks (attention through ``scaled_dot_product_attention``, an MLP), a
    final norm and a head on the class token."""

    def __init__(self, dim: int = 128, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.patch = nn.Linear(3 * 16, dim)
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, 65, dim))
        self.pos_drop = nn.Dropout(0.0)
        self.blocks = nn.Sequential(*(_Block(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, img):
        b = img.shape[0]
        x = img.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5).reshape(b, 64, 48)
        x = torch.cat([self.cls_token.expand(b, -1, -1), self.patch(x)], 1) + self.pos_embed
        x = self.norm(self.blocks(self.pos_drop(x)))
        return self.head(x[:, 0])


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = (
            nn.LayerNorm(dim),
            nn.Linear(dim, 3 * dim),
            nn.Linear(dim, dim),
        )
        self.ln2, self.fc1, self.fc2 = (
            nn.LayerNorm(dim),
            nn.Linear(dim, 4 * dim),
            nn.Linear(4 * dim, dim),
        )

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


def vision_model(name: str) -> nn.Module:
    """timm's and torchvision's models at 32x32 (tests/test_vision_ghost.py builds the
    same), random weights, eval mode (dropout off, BatchNorm from running statistics).
    They load only beside the torch they were built for (2.14.1: ``make test-newest``'s
    venv)."""
    small = dict(pretrained=False, img_size=32, patch_size=4, num_classes=10, depth=2)
    if name.startswith("timm-"):
        import timm

        if name == "timm-convnext":
            return timm.create_model("convnext_atto", pretrained=False, num_classes=10).eval()
        arch = {"timm-vit": "vit_tiny_patch16_224", "timm-deit": "deit_tiny_distilled_patch16_224"}
        return timm.create_model(arch[name], **small).eval()
    import torchvision.models as tv

    if name == "tv-vit":
        return tv.VisionTransformer(
            image_size=32, patch_size=4, num_layers=2, num_heads=3, hidden_dim=96,
            mlp_dim=192, num_classes=10,
        ).eval()  # fmt: skip
    if name == "tv-resnet18":
        return tv.resnet18(num_classes=10).eval()
    return tv.mobilenet_v3_small(num_classes=10).eval()


VISION = ("timm-vit", "timm-deit", "timm-convnext", "tv-vit", "tv-resnet18", "tv-mobilenet")


def build(name: str):
    """(model, loss_fn, batch) for ``name``."""
    torch.manual_seed(0)
    if name in VISION:
        model = vision_model(name)
        batch = (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))

        def vision_loss(p, x, y):
            out = fg.call(model, p, x)
            return nn.functional.cross_entropy(out[0] if isinstance(out, tuple) else out, y)

        return model, vision_loss, batch
    if name == "mlp":
        layers: list[nn.Module] = [nn.Linear(512, 1024), nn.ReLU()]
        for _ in range(3):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(1024, 10))
        batch = (torch.randn(256, 512), torch.randint(0, 10, (256,)))

        def loss(p, x, y):
            return nn.functional.cross_entropy(fg.call(model, p, x), y)

        return model, loss, batch
    kind, _, size = name.partition("@")  # hf-gpt2@768x4x128x8192: dim, layers, tokens, vocab
    if kind in ("hf-gpt2", "hf-gemma", "hf-bert", "hf-t5"):  # Hugging Face's code, random weights
        dim, layers, tokens, vocab = [int(v) for v in size.split("x")] if size else [128, 2, 64, 65]
        model = hf_model(kind[3:], dim, layers, tokens, vocab).eval()
        idx = torch.randint(0, vocab, (16, tokens + 1))
        t5 = kind == "hf-t5"  # the tokens in, to the encoder and the decoder

        def hf_loss(p, x, y):
            extra = {"decoder_input_ids": x, "use_cache": False} if t5 else {}
            out = fg.call(model, p, input_ids=x, **extra).logits
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        if kind == "hf-bert":  # a label per sequence
            return model, hf_loss, (idx[:, :-1], torch.randint(0, 10, (16,)))
        return model, hf_loss, (idx[:, :-1], idx[:, 1:])
    if name in ("vit", "vit-frozen"):
        model = ViT()
        if name == "vit-frozen":
            model.cls_token.requires_grad_(False)
            model.pos_embed.requires_grad_(False)
        batch = (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)))

        def loss(p, x, y):
            return nn.functional.cross_entropy(fg.call(model, p, x), y)

        return model, loss, batch
    if name == "gpt":
        model = example("char_gpt").CharGPT(
            vocab=65, block=64, dim=128, layers=2, heads=4, dropout=0.0
        )
        idx = torch.randint(0, 65, (16, 65))

        def loss(p, x, y):
            logits = fg.call(model, p, x)
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        return model, loss, (idx[:, :-1], idx[:, 1:])
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )  # fmt: skip
    batch = (torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))

    def loss(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    return model, loss, batch


VARIANTS = {"plain": None, "vmap": "clip_by_global_norm", "ghost": "ghost_clip"}


def step_of(name: str, variant: str):
    model, loss, batch = build(name)
    how = VARIANTS[variant]
    per_sample = None if how is None else getattr(fg, how)(1.0)
    tx = fg.adam(lr=1e-3)
    params = fg.params(model)
    state = tx.init(params)
    step = fg.make_step(loss, tx, per_sample=per_sample, donate=True)
    return lambda: step(params, state, *batch)


def peak_child(name: str, variant: str, steps: int) -> None:
    """Print ``(growth, peak)`` (see :func:`peak_mb`) for one variant, in this process."""

    def kb(key: str) -> int:
        return int(Path("/proc/self/status").read_text().split(key + ":")[1].split()[0])

    f = step_of(name, variant)
    f()  # the first step's one-time allocations are not the step's
    Path("/proc/self/clear_refs").write_text("5")
    base = kb("VmRSS")
    for _ in range(steps):
        f()
    print(json.dumps([(kb("VmHWM") - base) / 1024, kb("VmHWM") / 1024]))


def peak_mb(name: str, variant: str, steps: int) -> tuple[float, float]:
    """``(growth, peak)``: how far the resident memory rose during ``steps`` steps of
    one variant above where it was after one step, and the process's peak then, in a
    fresh process (MiB): Linux's VmHWM, reset (``/proc/self/clear_refs``) after the
    first step. (``ru_maxrss`` would not do: a child starts with its parent's mark.)"""
    growth, peak = run_json([__file__, "--child", name, variant, str(steps)])
    return float(growth), float(peak)


def rule_part(batch: int, quick: bool) -> dict[str, float]:
    """Per-sample gradients + the per-sample zero rule: a loop, vmap, vmap compiled."""
    torch.manual_seed(0)
    model = mlp()
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
    params = fg.params(model)
    groups = fg.group_by_module(model)
    rule = fg.per_group(fg.rules.zero_fix(), groups)

    def loss_fn(p, x, y):
        return nn.functional.cross_entropy(fg.call(model, p, x), y)

    psg = fg.per_sample_grads(loss_fn)

    def vmapped(p, x, y):
        g = psg(p, x, y)
        fixed = torch.func.vmap(lambda gi: rule.update(gi, fg.EmptyState())[0])(g)
        return {k: v.mean(0) for k, v in fixed.items()}

    compiled = torch.compile(vmapped, fullgraph=True)
    grad_fn = torch.func.grad(loss_fn)

    def loop(p, x, y):
        acc = None
        for i in range(x.shape[0]):
            g = grad_fn(p, x[i : i + 1], y[i : i + 1])
            g = rule.update(g, fg.EmptyState())[0]
            acc = g if acc is None else {k: acc[k] + g[k] for k in g}
        return {k: v / x.shape[0] for k, v in acc.items()}

    # Same answer from all three before timing anything.
    ref = loop(params, x, y)
    for fn in (vmapped, compiled):
        out = fn(params, x, y)
        for k in ref:
            torch.testing.assert_close(out[k], ref[k], rtol=1e-4, atol=1e-6)

    repeats, number = (3, 2) if quick else (7, 5)
    t = interleaved(
        {
            "python loop": lambda: loop(params, x, y),
            "vmap eager": lambda: vmapped(params, x, y),
            "vmap compiled": lambda: compiled(params, x, y),
        },
        repeats,
        number,
    )
    print(f"per-sample grads + per-sample zero rule, MLP, batch {batch}")
    for k, v in t.items():
        print(f"  {k:14s} {v * 1e3:8.2f} ms   {t['python loop'] / v:6.1f}x faster than the loop")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--models",
        default="mlp,gpt,cnn",
        help="also hf-gpt2, hf-gemma, hf-bert, hf-t5, vit, vit-frozen",
    )
    ap.add_argument("--part", choices=("clip", "rule"), default="clip")
    ap.add_argument("--batch", type=int, default=64, help="--part rule")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return peak_child(args.child[0], args.child[1], int(args.child[2]))
    if args.part == "rule":
        write_json(args.out, "bench_per_sample", {"seconds": rule_part(args.batch, args.quick)})
        return
    repeats, number = (3, 2) if args.quick else (7, 3)
    results = {}
    for name in args.models.split(","):
        fns = {v: step_of(name, v) for v in VARIANTS}
        t = interleaved(fns, repeats=repeats, number=number)
        mem = {v: peak_mb(name, v, 3) for v in VARIANTS}
        r = {
            "ms": {k: round(v * 1e3, 2) for k, v in t.items()},
            "ghost/vmap": round(t["ghost"] / t["vmap"], 3),
            "ghost/plain": round(t["ghost"] / t["plain"], 3),
            "vmap/plain": round(t["vmap"] / t["plain"], 3),
            "MiB over the step's start": {k: round(v[0], 1) for k, v in mem.items()},
            "process peak MiB": {k: round(v[1], 1) for k, v in mem.items()},
            "ghost/plain peak": round(mem["ghost"][1] / mem["plain"][1], 3),
        }
        results[name] = r
        print(name, json.dumps(r), flush=True)
    write_json(args.out, "bench_per_sample_clip", results)


if __name__ == "__main__":
    main()
