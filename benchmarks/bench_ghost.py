"""Per-sample clipping: fg.ghost_clip vs the vmap path vs a step without per-sample work.

Three models, eager steps (make_step, Adam, donated), timed side by side in one process,
interleaved, median of repeats: the MLP 512-1024x4-10 at batch 256 (the issue's), the
tiny GPT of examples/char_gpt.py (2 blocks, dim 128, 64 tokens, batch 16, tied head,
positional embedding) and a small CNN (two convolutions, GroupNorm, batch 64). Peak
memory of each step: the growth of the peak resident memory over a run of that step
alone, each in a fresh subprocess (CPU: no allocator statistics; Linux's VmHWM).

Targets (issue "ghost_clip"): ghost <= 0.5x vmap and <= 2x plain on the MLP; <= 2x plain
on the GPT and the CNN; peak memory <= 1.5x the plain step's.

Hugging Face GPT-2 and BERT (``--models hf-gpt2,hf-bert``; needs transformers): the
same sizes as the tiny GPT (2 layers, dim 128, 64 tokens, batch 16), random weights.
``vit``: timm's VisionTransformer form (the root owns ``cls_token`` and ``pos_embed``:
ghost clipping's fallback for the root), 32x32 images in 4x4 patches, 2 blocks, dim
128, batch 16; ``vit-frozen``: the same with those two frozen (no fallback at all).

timm's ViT, DeiT (distilled) and ConvNeXt, torchvision's ViT, ResNet-18 and MobileNetV3
(``--models timm-vit,timm-deit,timm-convnext,tv-vit,tv-resnet18,tv-mobilenet``; needs
timm and torchvision, which load beside torch 2.14.1): 32x32 images, batch 8, eval mode.

Run: python benchmarks/bench_ghost.py [--quick]
     [--models mlp,gpt,cnn,hf-gpt2,hf-bert,vit,vit-frozen,timm-vit,...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from bench_step import interleaved
from torch import nn

import funcgrad as fg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


def hf_model(name: str) -> nn.Module:
    """Tiny Hugging Face ``"gpt2"`` (LM head, tied embeddings) or ``"bert"`` (sequence
    classification, 10 labels) from configs: 2 layers, dim 128, 64 positions, vocabulary
    65, no dropout, random weights (nothing downloaded)."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(vocab_size=65, n_positions=64, n_embd=128, n_layer=2, n_head=4,
                          attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                          bos_token_id=0, eos_token_id=0)
        )  # fmt: skip
    return tf.BertForSequenceClassification(
        tf.BertConfig(vocab_size=65, hidden_size=128, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=512,
                      max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, num_labels=10)
    )  # fmt: skip


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
    if name in ("hf-gpt2", "hf-bert"):  # Hugging Face's own code, random weights
        model = hf_model(name[3:]).eval()
        idx = torch.randint(0, 65, (16, 65))

        def hf_loss(p, x, y):
            out = fg.call(model, p, input_ids=x).logits
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        if name == "hf-bert":  # a label per sequence
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
        from char_gpt import CharGPT

        model = CharGPT(vocab=65, block=64, dim=128, layers=2, heads=4, dropout=0.0)
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


def peak_mb(name: str, variant: str, steps: int) -> tuple[float, float]:
    """``(growth, peak)``: how far the resident memory rose during ``steps`` steps of
    one variant above where it was after one step, and the process's peak then, in a
    fresh process (MiB): Linux's VmHWM, reset (``/proc/self/clear_refs``) after the
    first step. (``ru_maxrss`` would not do: a child starts with its parent's mark.)"""
    code = (
        "import sys; sys.path.insert(0, 'benchmarks');"
        "import bench_ghost as b;"
        f"f = b.step_of({name!r}, {variant!r});"
        "kb = lambda k: int(open('/proc/self/status').read().split(k + ':')[1].split()[0]);"
        "f();"  # the first step's one-time allocations are not the step's
        "open('/proc/self/clear_refs', 'w').write('5');"
        "base = kb('VmRSS');"
        f"[f() for _ in range({steps})];"
        "print((kb('VmHWM') - base) / 1024, kb('VmHWM') / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    growth, peak = out.stdout.strip().splitlines()[-1].split()
    return float(growth), float(peak)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--models", default="mlp,gpt,cnn", help="also hf-gpt2, hf-bert, vit, vit-frozen"
    )
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
