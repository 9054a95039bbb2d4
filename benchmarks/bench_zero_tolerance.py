"""Which zero tolerance makes the rule's decisions the same in float32 and float64?

Models nobody here wrote (Hugging Face GPT-2, BERT, Llama, T5 from tiny configs with
random weights, when ``transformers`` is installed; torch's TransformerEncoderLayer;
torch's Conv2d + train-mode BatchNorm2d), one batch, the loss scaled by 1e-4, 1 and
1e4. For each tolerance, per model: the entries whose zero decision differs between the
float32 and the float64 gradients (``fg.rules.zero_fix``'s test, group by module), and
how many entries count as zero in float64 (a tolerance that calls real gradients zero
is no answer either). Not a timing: it prints counts.

Run: python benchmarks/bench_zero_tolerance.py
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import funcgrad as fg

V = 50
SETTINGS = [
    ("atol=0", dict()),
    ("atol=1e-12", dict(atol=1e-12)),
    ("atol=1e-9", dict(atol=1e-9)),
    ("atol=1e-7", dict(atol=1e-7)),
    ("rtol=1e-6", dict(rtol=1e-6)),
    ("rtol=1e-5", dict(rtol=1e-5)),
    ("rtol=1e-4", dict(rtol=1e-4)),
]


def hf_models() -> dict[str, nn.Module]:
    try:
        import transformers as tf
    except ImportError:
        return {}
    torch.manual_seed(0)
    common = dict(vocab_size=V, bos_token_id=0, eos_token_id=0)
    return {
        "gpt2": tf.GPT2LMHeadModel(
            tf.GPT2Config(n_positions=16, n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.0,
                          resid_pdrop=0.0, embd_pdrop=0.0, **common)
        ),
        "bert": tf.BertForSequenceClassification(
            tf.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, num_labels=3)
        ),
        "llama": tf.LlamaForCausalLM(
            tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=16, **common)
        ),
        "t5": tf.T5ForConditionalGeneration(
            tf.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                        num_decoder_layers=2, num_heads=4, dropout_rate=0.0)
        ),
    }  # fmt: skip


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.emb(ids)))


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def loss_for(kind: str, m: nn.Module, scale: float):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (4, 12), generator=gen)
    y = torch.randint(0, 3, (4,), generator=gen)
    dtype = next(m.parameters()).dtype
    ce = nn.functional.cross_entropy
    if kind == "convbn":
        x = torch.randn(4, 3, 8, 8, generator=gen).to(dtype)
        b = fg.buffers(m)

        def conv_loss(p: dict) -> torch.Tensor:  # train-mode BatchNorm: buffers cloned
            return ce(fg.call(m, p, x, buffers={k: v.clone() for k, v in b.items()}), y) * scale

        return conv_loss
    if kind == "bert":
        return lambda p: ce(fg.call(m, p, input_ids=ids).logits, y) * scale
    if kind == "encoder":
        return lambda p: ce(fg.call(m, p, ids).reshape(-1, V), ids.reshape(-1)) * scale
    extra = {"decoder_input_ids": ids} if kind == "t5" else {}
    return lambda p: (
        ce(fg.call(m, p, input_ids=ids, **extra).logits.reshape(-1, V), ids.reshape(-1)) * scale
    )


def gradients(kind: str, m: nn.Module, dtype: torch.dtype, scale: float) -> dict:
    mm = copy.deepcopy(m).to(dtype)
    p = {k: v.detach() for k, v in fg.params(mm).items()}
    return torch.func.grad(loss_for(kind, mm, scale))(p)


def main() -> None:
    models = hf_models()
    models = {k: v.eval() for k, v in models.items()}
    torch.manual_seed(0)
    models["encoder"] = Encoder().eval()
    models["convbn"] = ConvBN()
    for scale in (1e-4, 1.0, 1e4):
        print(f"\nloss x {scale:g}: entries deciding differently in float32 / zeros in float64")
        print(f"{'model':<9}" + "".join(f"{name:>13}" for name, _ in SETTINGS))
        for kind, m in models.items():
            groups = fg.group_by_module(m)
            g64 = gradients(kind, m, torch.float64, scale)
            g32 = gradients(kind, m, torch.float32, scale)
            row = f"{kind:<9}"
            for _, kw in SETTINGS:
                rule = fg.rules.zero_fix(**kw)
                differ = zeros = 0
                for names in groups.values():
                    a = rule({k: g64[k] for k in names})
                    b = rule({k: g32[k] for k in names})
                    for k in names:
                        za, zb = a[k] != g64[k], b[k] != g32[k]  # replaced: counted zero
                        za |= g64[k] == 0
                        zb |= g32[k] == 0
                        differ += int((za != zb).sum())
                        zeros += int(za.sum())
                row += f"{f'{differ}/{zeros}':>13}"
            print(row)


if __name__ == "__main__":
    main()
