"""The explained errors: the texts funcgrad adds to torch's and dynamo's own, and the
one way they are raised.

Three mistakes surface deep inside torch with messages that do not name the fix: a
model that writes one of its buffers under ``torch.func`` (train-mode BatchNorm),
per-sample gradients through batch statistics, and a step that reads a tensor's value
on the host while it is traced. :func:`explain_buffer_write` and
:func:`explain_compile_failure` recognise them (``None``: not one of ours), and
:func:`reraise` raises the explained error chained to the original, or the original
itself. ``docs/errors.md`` lists every message; ``tests/test_errors.py`` checks that
each is raised by a test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

PER_SAMPLE_BATCHNORM = (
    "Per-sample gradients on a model with BatchNorm in train mode: batch statistics "
    "mix the samples, so per-sample gradients are meaningless (and each sample alone "
    "is a batch of one). Call model.eval() before taking per-sample gradients, or use "
    "a per-sample normalization (GroupNorm/LayerNorm)."
)

BUFFER_WRITE = (
    "the model wrote to one of its buffers in place during a torch.func transform "
    "(grad/vmap) or a training step. That is what BatchNorm does in train mode to its "
    "running statistics, and torch.func cannot differentiate through a write to a tensor "
    "captured from outside. In a training step, build it with fg.make_step(..., buffers=True): the "
    "buffers then travel through the step as inputs and outputs "
    "(loss_fn(params, buffers, *batch) calls fg.call(model, params, x, buffers=buffers)). "
    "Outside make_step, pass buffers cloned inside the transformed function, or use "
    "model.eval()."
)

HOST_READ = (
    "reads a tensor's value on the host (a Python if/while, bool(), float() or .item() "
    "on a tensor), in a schedule or in a custom rule or transformation. Code that runs "
    "every step must be tensor ops, so that it compiles to one graph and never waits "
    "for the device: write torch.where(count < 100, a, b) instead of "
    "a if count < 100 else b, and torch.clamp / torch.minimum instead of min()."
)


def reraise(err: BaseException, better: BaseException | None) -> NoReturn:
    """Raise ``better`` chained to ``err`` (``raise better from err``), or ``err``
    itself when there is nothing better. Call it from the ``except`` block that
    caught ``err``."""
    if better is None or better is err:
        raise err
    raise better from err


def explain_buffer_write(err: BaseException, per_sample: bool = False) -> RuntimeError | None:
    """The clear error for a forward that writes a buffer under torch.func, or None.

    The one place that recognises it: eager torch raises "mutate a captured Tensor";
    torch.compile wraps that same text in its own exception; a train-mode
    BatchNorm1d over one sample says "Expected more than 1 value per channel".
    """
    msg = str(err)
    if per_sample and BUFFER_WRITE in msg:  # our own, whose buffers=True advice is refused
        return RuntimeError(PER_SAMPLE_BATCHNORM)  # with per_sample=: one message, what works
    if per_sample and (
        "mutate a captured Tensor" in msg or "Expected more than 1 value per channel" in msg
    ):
        return RuntimeError(f"{PER_SAMPLE_BATCHNORM}\nOriginal error: {msg}")
    if "mutate a captured Tensor" in msg and BUFFER_WRITE not in msg:
        return RuntimeError(f"fg.call: {BUFFER_WRITE}\nOriginal error: {msg}")
    return None


def explain_compile_failure(
    err: Exception, eager: Callable[[], Any], how: str = "compile=True"
) -> Exception | None:
    """A clearer error than dynamo's for a step that fails to compile, or None.

    ``how`` names the ``compile=`` option in the message (``compile="gradients"``
    compiles, and so re-runs, only the gradient computation).

    Most mistakes (a misspelled parameter name, a model that writes a buffer, an
    exception raised in loss_fn) surface under torch.compile as dynamo's own
    exception types. Running the same step once eagerly, without donation (nothing
    is written), raises the user's own exception with funcgrad's explanation.
    """
    msg = str(err)
    if "Attempted to wrap RNN, GRU, or LSTM" in msg:
        return TypeError(
            f"fg.make_step({how}): the model has an nn.RNN, nn.GRU or nn.LSTM, and "
            "torch.compile (dynamo) refuses to trace those modules. Use compile=False "
            "for this model (the eager step computes the same thing), or write the "
            "recurrence as a loop over nn.LSTMCell / nn.GRUCell, which compile.\n"
            f"Original error: {msg.splitlines()[0]}"
        )
    if "data-dependent" in msg or "Data-dependent" in msg:
        return TypeError(f"fg.make_step({how}): the step {HOST_READ}\nOriginal: {msg}")
    try:
        eager()
    except Exception as eager_err:
        better = explain_buffer_write(eager_err)
        return better if better is not None else eager_err
    return None
