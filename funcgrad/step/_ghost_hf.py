"""Ghost clipping's rules for Hugging Face's own layers, known by their classes
(``transformers`` is never imported for them) and checked by their shapes: GPT-2's
``Conv1D`` (a Linear with the weight stored ``[in, out]``, ``_ghost_layers._Matmul``),
the RMS norms (``T5LayerNorm``, ``LlamaRMSNorm``, ...) and the scaled word embeddings
(``GemmaTextScaledWordEmbedding``, ``BartScaledWordEmbedding``, ...)."""

from __future__ import annotations

import contextlib

from torch import Tensor, nn
from torch.func import functional_call, vjp

from .._compat import compiling
from ._ghost_layers import Layer
from ._ghost_tap import Call, rerunning


class ScaleNorm(Layer):
    """Hugging Face's RMS norms (``T5LayerNorm``, ``LlamaRMSNorm``, Gemma's ``1 + weight``
    ...): the weight only scales the last dimension, so one batched ``vjp`` of the
    module's own code with the weight given a batch dimension (``[B, 1.., d]``,
    broadcast against the input) is every sample's weight gradient."""

    def __init__(self, call: Call, n: int, x: Tensor, b: Tensor) -> None:
        super().__init__(call, n)
        self.x, self.b = x, b

    def per_sample(self) -> dict[str, Tensor]:
        call, x = self.call, self.x
        w = call.state["weight"]
        wide = w.expand(self.n, *([1] * (x.dim() - 2)), -1)  # [B, 1.., d]

        def f(v: Tensor) -> Tensor:
            return functional_call(call.module, {"weight": v}, (x,))  # type: ignore[no-any-return]

        with contextlib.nullcontext() if compiling() else rerunning(call.root, []):
            (g,) = vjp(f, wide)[1](self.b)
        return {call.names["weight"]: g.reshape(self.n, -1)}


def hf_scale_norm(m: nn.Module, x: Tensor, b: Tensor) -> bool:
    """One of Hugging Face's RMS norms (known by its class: ``T5LayerNorm``, a name that
    ends in ``RMSNorm``, in a ``transformers`` module), a weight of the last dimension's
    size its only parameter, no children, the output of the input's shape."""
    cls = type(m)
    w = m._parameters.get("weight")
    return (
        (cls.__name__ == "T5LayerNorm" or cls.__name__.endswith("RMSNorm"))
        and cls.__module__.startswith("transformers.")
        and set(m._parameters) == {"weight"}
        and next(m.children(), None) is None
        and w is not None
        and w.dim() == 1
        and x.dim() >= 2
        and w.shape[0] == x.shape[-1]
        and b.shape == x.shape
    )


def hf_embed_scale(call: Call, x: Tensor, b: Tensor) -> Tensor | float | None:
    """The scale of one of Hugging Face's scaled word embeddings (known by its class: a
    name that ends in ``ScaledWordEmbedding``, in a ``transformers`` module; Gemma's,
    Bart's, ...): ``call``'s module, an ``nn.Embedding`` subclass (without
    ``max_norm``, ``scale_grad_by_freq``, ``sparse``: ``layer_of`` checked) whose forward
    multiplies its output by ``embed_scale`` (a number, or a 0-d buffer cast to the
    weight's dtype), the weight its only parameter, no children; ``None`` for any other
    module. The gradient of the embedding's own output is then ``b`` times that scale
    (what autograd computes)."""
    m = call.module
    assert isinstance(m, nn.Embedding)
    cls = type(m)
    if not (
        cls.__name__.endswith("ScaledWordEmbedding")
        and cls.__module__.startswith("transformers.")
        and set(m._parameters) == {"weight"}
        and next(m.children(), None) is None
        and not x.is_floating_point()
        and b.shape == (*x.shape, m.embedding_dim)
    ):
        return None
    scale = call.state.get("embed_scale", getattr(m, "embed_scale", None))
    if isinstance(scale, Tensor) and scale.dim() == 0:
        return scale.to(m.weight.dtype)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return scale
    return None


def hf_conv1d(m: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2's projections): ``addmm(bias, x, weight)`` with the
    weight stored ``[in, out]``, a Linear with the weight transposed. Known by its class
    (transformers is not imported for it) and checked by its shapes."""
    cls = type(m)
    w, bias = m._parameters.get("weight"), m._parameters.get("bias")
    return (
        cls.__name__ == "Conv1D"
        and cls.__module__ == "transformers.pytorch_utils"
        and w is not None
        and bias is not None
        and w.dim() == 2
        and tuple(w.shape) == (getattr(m, "nx", None), getattr(m, "nf", None))
        and tuple(bias.shape) == (w.shape[1],)
    )
