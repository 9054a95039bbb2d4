"""fg.ghost_clip on Hugging Face models built from tiny configs (random weights, nothing
downloaded): GPT-2, BERT and Llama call their position embeddings on ``arange(T)[None]``
(a ``(1, T, d)`` output shared by the samples), which failed inside transformers (#50).
Each equals the vmap path (``per_sample=fg.clip_by_global_norm``) in float64, T5 too:
its relative position bias, a shared ``(T, T, heads)`` output the model then permutes
(refused before), goes to the attention module that calls it, whose vmap fallback gives
its per-sample gradients. Run by ``make test-integrations``."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as tf

import funcgrad as fg
from funcgrad.step import _ghost, _ghost_layers, _ghost_tap
from funcgrad.step._ghost import ghost_gradients
from funcgrad.step._ghost_hf import ScaleNorm

C = 0.5
V = 50


def model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg: object = tf.GPT2Config(
            vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2, attn_pdrop=0.0,
            resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        m = tf.GPT2LMHeadModel(cfg)
    elif kind == "bert":
        cfg = tf.BertConfig(
            vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=3,
        )  # fmt: skip
        m = tf.BertForSequenceClassification(cfg)
    elif kind == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        m = tf.LlamaForCausalLM(cfg)
    elif kind == "gemma":  # its RMS norm scales by 1 + weight
        cfg = tf.GemmaConfig(
            vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8,
            max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        m = tf.GemmaForCausalLM(cfg)
    else:
        cfg = tf.T5Config(
            vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
            num_heads=2, dropout_rate=0.0,
        )  # fmt: skip
        m = tf.T5ForConditionalGeneration(cfg)
    return m.double().eval()


def loss_of(kind: str, m: torch.nn.Module):
    def loss(p, ids, y):
        if kind == "bert":
            return torch.nn.functional.cross_entropy(fg.call(m, p, input_ids=ids).logits, y)
        extra = {"decoder_input_ids": ids, "use_cache": False} if kind == "t5" else {}
        out = fg.call(m, p, input_ids=ids, **extra).logits
        return torch.nn.functional.cross_entropy(out.reshape(-1, V), ids.reshape(-1))

    return loss


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (4, 6), generator=g), torch.randint(0, 3, (4,), generator=g)


FALLBACKS = {"gpt2": set(), "bert": set(), "llama": set(), "t5": {"T5Attention"}, "gemma": set()}
NORMS = {"gpt2": 0, "bert": 0, "llama": 5, "gemma": 5, "t5": 7}  # RMS norms: ScaleNorm


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama", "gemma", "t5"])
def test_ghost_clip_equals_the_vmap_path(kind, monkeypatch):
    """Equal to the vmap path; every module on a native rule (GPT-2's Conv1D
    projections as transposed Linears, the models' own RMS norms by one batched vjp
    of their code) but T5's two attention modules that own a relative position bias
    (encoder's and decoder's first), which adopt it and take the vmap fallback."""
    taken = []
    real = _ghost.layer_of
    monkeypatch.setattr(
        _ghost, "layer_of", lambda call, n: taken.append(real(call, n)) or taken[-1]
    )
    m = model(kind)
    loss = loss_of(kind, m)
    params = {k: v.detach() for k, v in m.named_parameters()}
    ids, y = data()
    ghost, _, _, _ = ghost_gradients(loss, False, C, "mean")(params, ids, y)
    step = fg.make_step(loss, fg.sgd(lr=1.0), per_sample=fg.clip_by_global_norm(C))
    p = {k: v.clone() for k, v in params.items()}
    new, _, _ = step(p, fg.sgd(lr=1.0).init(p), ids, y)
    for k in params:  # sgd(lr=1): new = p - grads
        torch.testing.assert_close(p[k] - new[k], ghost[k], rtol=1e-10, atol=1e-12, msg=k)
    assert any(g.abs().max() > 0 for g in ghost.values())
    fallbacks = [
        type(layer.call.module).__name__
        for layer in taken
        if isinstance(layer, _ghost_layers.Vmapped)
    ]
    assert taken and set(fallbacks) == FALLBACKS[kind]
    assert sum(isinstance(layer, ScaleNorm) for layer in taken) == NORMS[kind]
    adopters = sorted(
        module for layer in taken for module in [_ghost_tap.module_path(layer.call.names)]
        if any("relative_attention_bias" in own for own in layer.call.names)
    )  # fmt: skip
    assert adopters == (
        [f"{s}.block.0.layer.0.SelfAttention" for s in ("decoder", "encoder")]
        if kind == "t5" else []
    )  # fmt: skip


def test_t5_with_its_cache_is_refused_naming_the_way_out():
    """A transformers cache the tap pass filled would be filled again by the rerun of an
    adopting attention module (use_cache defaults to True, in training too)."""
    m = model("t5")
    params = {k: v.detach() for k, v in m.named_parameters()}
    ids, y = data()

    def loss(p, ids, y):
        out = fg.call(m, p, input_ids=ids, decoder_input_ids=ids).logits
        return torch.nn.functional.cross_entropy(out.reshape(-1, V), ids.reshape(-1))

    with pytest.raises(
        ValueError,
        match=re.escape(
            "fg.ghost_clip: the module 'decoder.block.0.layer.0.SelfAttention' (T5Attention) "
            "has no per-sample rule and reruns for every sample, but it was called with a "
            "transformers cache"
        ),
    ):
        ghost_gradients(loss, False, C, "mean")(params, ids, y)


def test_compiled_ghost_step_on_gpt2_is_one_graph_equal_to_eager():
    """fg.make_step(per_sample=fg.ghost_clip, compile=True) on GPT-2 (inductor): one
    graph, no recompile on a second call, equal to the eager ghost step."""
    from torch._dynamo.utils import counters

    m = model("gpt2")
    loss = loss_of("gpt2", m)
    ids, y = data()
    tx = fg.sgd(lr=1.0)
    start = {k: v.detach().clone() for k, v in fg.params(m).items()}
    eager = fg.make_step(loss, tx, per_sample=fg.ghost_clip(C))
    compiled = fg.make_step(loss, tx, per_sample=fg.ghost_clip(C), compile=True)
    want, _, want_loss = eager(dict(start), tx.init(start), ids, y)
    torch._dynamo.reset()
    counters.clear()
    for _ in range(2):
        got, _, got_loss = compiled(dict(start), tx.init(start), ids, y)
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=1e-14)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)
