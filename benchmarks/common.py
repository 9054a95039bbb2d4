"""The one module the benchmarks share: timing, the models they measure, results.

Every benchmark is a script run from the repository root (``python
benchmarks/bench_step.py``); Python puts the script's folder first on ``sys.path``, so
``import common`` finds this file and nothing edits ``sys.path``. The examples the
benchmarks measure against (the published hook answer, the tiny GPT) are loaded by
:func:`example` from ``examples/`` by file name.

- :func:`interleaved`: median seconds per call of several variants, timed round-robin
  so the machine's drift hits all alike (the only kind of figure the README quotes).
- models: :func:`mlp`, :func:`cnn`, :func:`deep` (``layers`` blocks of Linear+ReLU),
  :func:`problem` (one of them with its loss and batch), :func:`gpt_problem`,
  :func:`hf_model` (tiny Hugging Face GPT-2 / BERT from configs; needs transformers).
- :func:`cold_caches` (a cold compile's environment), :func:`cpu_seconds`,
  :func:`run_json` (a fresh process whose last line is JSON), :func:`write_json`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

import funcgrad as fg

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RULE = fg.rules.zero_fix()

Loss = Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor]


def example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (loaded once, by file name); what the examples
    import beside them (``examples/_cli.py``) is loaded the same way first."""
    if name in sys.modules:
        return sys.modules[name]
    if name != "_cli":
        example("_cli")
    spec = importlib.util.spec_from_file_location(name, HERE.parent / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def interleaved(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    number: int,
    warmup: int = 3,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Median seconds per call of each fn, timed round-robin so drift hits all alike.

    ``warmup`` calls of each first (and compile); ``sync`` waits for the device
    before and after each timed batch (e.g. ``torch.cuda.synchronize``)."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            sync()
            t = time.perf_counter()
            for _ in range(number):
                f()
            sync()
            times[name].append((time.perf_counter() - t) / number)
    return {k: statistics.median(v) for k, v in times.items()}


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10),
    )  # fmt: skip


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
    )  # fmt: skip


def deep(layers: int, width: int, device: torch.device | str = "cpu") -> nn.Module:
    """``layers`` blocks of ``Linear(width, width)`` + ReLU (seeded)."""
    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*blocks).to(device)


def deep_batch(width: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A regression batch of 32 for :func:`deep`."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, width, generator=g), torch.randn(32, width, generator=g)
    return x.to(device), y.to(device)


def problem(layers: int) -> tuple[nn.Module, Loss, torch.Tensor, torch.Tensor]:
    """``(model, loss(params, x, y), x, y)``: :func:`mlp` with cross-entropy on a batch
    of 64 for ``layers == 0``, else :func:`deep` of width 64 with a squared error."""
    if layers == 0:
        torch.manual_seed(0)
        m = mlp()
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
        return m, lambda p, x, y: nn.functional.cross_entropy(fg.call(m, p, x), y), x, y
    m = deep(layers, 64)
    x, y = deep_batch(64)
    return m, lambda p, x, y: ((fg.call(m, p, x) - y) ** 2).mean(), x, y


def per_name(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters as one tensor each (detached): a params dict built by
    hand. The floor of the gradients: ``fg.params(model)`` is flat, and the gradient
    with respect to a flat buffer (the views' slices in the backward) is no floor."""
    return {k: p.detach() for k, p in model.named_parameters()}


def eager_rule_on_grads(model: nn.Module, groups: fg.Groups) -> None:
    """The correct rule for torch.optim users: after backward, per group, on .grad."""
    named = dict(model.named_parameters())
    for names in groups.values():
        fixed = RULE({n: named[n].grad for n in names})
        for n in names:
            named[n].grad = fixed[n]


def gpt_problem(dim: int, layers: int, batch: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """examples/char_gpt.py's model (vocab 64, 64 tokens, 4 heads, tied embeddings,
    dropout off) and one batch ``(x, y)``; :func:`gpt_ce` is its loss."""
    vocab, block = 64, 64
    torch.manual_seed(0)
    model = example("char_gpt").CharGPT(vocab, block, dim, layers, 4, dropout=0.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch, block), generator=g)
    y = torch.randint(0, vocab, (batch, block), generator=g)
    return model, x, y


def gpt_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of :func:`gpt_problem`'s logits against targets ``y``."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def hf_model(
    name: str, dim: int = 128, layers: int = 2, positions: int = 64, vocab: int = 65
) -> nn.Module:
    """Tiny Hugging Face ``"gpt2"`` (LM head, tied embeddings), ``"gemma"`` (the same,
    Gemma's scaled embedding, RMS norms and one key-value head), ``"bert"`` (sequence
    classification, 10 labels) or ``"t5"`` (encoder-decoder, LM head) from configs: by
    default 2 layers (each side), dim 128, 64 positions; heads of 32 (at most 64 wide:
    dim 768 has 12), feed-forward 4 x dim, vocabulary 65, no dropout, random weights
    (nothing downloaded)."""
    import transformers as tf

    torch.manual_seed(0)
    heads = max(4, dim // 64)
    if name == "t5":
        return tf.T5ForConditionalGeneration(
            tf.T5Config(vocab_size=vocab, d_model=dim, d_kv=dim // heads, d_ff=4 * dim,
                        num_layers=layers, num_decoder_layers=layers, num_heads=heads,
                        dropout_rate=0.0)
        )  # fmt: skip
    if name == "gemma":
        return tf.GemmaForCausalLM(
            tf.GemmaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=4 * dim,
                           num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=1, head_dim=dim // heads,
                           max_position_embeddings=positions, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0)
        )  # fmt: skip
    if name == "gpt2":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=dim, n_layer=layers,
                          n_head=heads, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                          bos_token_id=0, eos_token_id=0)
        )  # fmt: skip
    return tf.BertForSequenceClassification(
        tf.BertConfig(vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=4 * dim,
                      max_position_embeddings=positions, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, num_labels=10)
    )  # fmt: skip


def cold_caches(cache: str) -> dict[str, str]:
    """Environment for a cold compile: inductor's cache dir at ``cache`` (empty), the FX
    graph and AOTAutograd caches off."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": cache,
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
    }


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (compiles fork workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_json(argv: list[str], env: dict[str, str] | None = None) -> Any:
    """Run ``python *argv`` in a fresh process; its last line of output, as JSON."""
    out = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{argv} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_json(out: Path | str, name: str, data: object) -> Path:
    """``data`` as ``<out>/<name>.json`` (the folder made if missing); returns the path."""
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")
    return path


def free_port() -> int:
    """A TCP port free on this machine now (for a multi-process rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
