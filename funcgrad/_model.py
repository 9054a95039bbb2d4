"""Moving between an ``nn.Module`` and flat dicts of tensors.

funcgrad never reads ``.grad`` or mutates a module during a step: a module is only a
function ``(params, buffers, inputs) -> outputs`` through ``functional_call``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ._base import Params, check_floating


def params(model: nn.Module) -> Params:
    """Trainable parameters of ``model`` as a flat dict, detached, sharing storage.

    Keys are exactly those of ``model.named_parameters()``; parameters with
    ``requires_grad=False`` are left out (they stay frozen), and a parameter shared by
    two modules (tied weights) appears once, under its first name.

    Example:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> p = fg.params(model)
        >>> sorted(p), p["weight"].data_ptr() == model.weight.data_ptr()
        (['bias', 'weight'], True)
    """
    out = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    check_floating(out, "fg.params")
    return out


def buffers(model: nn.Module) -> dict[str, Tensor]:
    """Buffers of ``model`` (e.g. BatchNorm running statistics) as a flat dict.

    The tensors are the module's own, so in-place updates made during a
    train-mode forward pass through :func:`call` are seen by the module.

    Example:
        >>> import torch, funcgrad as fg
        >>> sorted(fg.buffers(torch.nn.BatchNorm1d(3)))
        ['num_batches_tracked', 'running_mean', 'running_var']
    """
    return dict(model.named_buffers())


def _all_param_names(model: nn.Module) -> tuple[set[str], set[str]]:
    """(every parameter name, tied aliases included; the trainable canonical names)."""
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return every, trainable


def _close(name: str, known: set[str]) -> str:
    import difflib

    near = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean '{near[0]}'?)" if near else ""


def check_names(model: nn.Module, given: Mapping[str, Any], what: str) -> None:
    """Unknown names and missing trainable names are errors, never silently ignored."""
    every, trainable = _all_param_names(model)
    unknown = [n for n in given if n not in every]
    if unknown:
        n = unknown[0]
        raise KeyError(
            f"{what}: '{n}' is not a parameter of {type(model).__name__}{_close(n, every)}. "
            f"Unknown names: {sorted(unknown)}. Use the keys of fg.params(model)."
        )
    missing = sorted(trainable - given.keys())
    if missing:
        raise KeyError(
            f"{what}: trainable parameters {missing} are missing. Pass every entry of "
            "fg.params(model); to freeze a parameter, call p.requires_grad_(False) on it "
            "before taking fg.params(model)."
        )


def load_params(model: nn.Module, params: Mapping[str, Tensor]) -> None:
    """Copy ``params`` into ``model``'s parameters, in place.

    Names must match ``fg.params(model)`` exactly, and each tensor must have the
    parameter's shape and dtype (it may live on another device).

    Example:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> fg.load_params(model, {"weight": torch.ones(1, 2), "bias": torch.zeros(1)})
        >>> model.weight
        Parameter containing:
        tensor([[1., 1.]], requires_grad=True)
    """
    check_names(model, params, "fg.load_params")
    targets = dict(model.named_parameters(remove_duplicate=False))
    for name, value in params.items():
        target = targets[name]
        if not isinstance(value, Tensor):
            raise TypeError(f"fg.load_params: '{name}' is a {type(value).__name__}, not a Tensor.")
        if value.shape != target.shape:
            raise ValueError(
                f"fg.load_params: shape mismatch for '{name}': the model has "
                f"{tuple(target.shape)}, the given tensor has {tuple(value.shape)}. "
                "Were these params saved from a different architecture?"
            )
        if value.dtype != target.dtype:
            raise TypeError(
                f"fg.load_params: dtype mismatch for '{name}': the model has "
                f"{target.dtype}, the given tensor has {value.dtype}. Convert one side "
                f"first, e.g. model.to({value.dtype}) or "
                f"{{k: v.to({target.dtype}) for k, v in params.items()}}."
            )
    with torch.no_grad():
        for name, value in params.items():
            target = targets[name]
            if value.data_ptr() != target.data_ptr():
                target.copy_(value)


PER_SAMPLE_BATCHNORM = (
    "Per-sample gradients on a model with BatchNorm in train mode: batch statistics "
    "mix the samples, so per-sample gradients are meaningless (and each sample alone "
    "is a batch of one). Call model.eval() before taking per-sample gradients, or use "
    "a per-sample normalization (GroupNorm/LayerNorm)."
)

BUFFER_WRITE = (
    "the model wrote to one of its buffers in place during a torch.func transform "
    "(grad/vmap). That is what BatchNorm does in train mode to its running statistics, "
    "and torch.func cannot differentiate through a write to a tensor captured from "
    "outside. In a training step, build it with fg.make_step(..., buffers=True): the "
    "buffers then travel through the step as inputs and outputs "
    "(loss_fn(params, buffers, *batch) calls fg.call(model, params, x, buffers=buffers)). "
    "Outside make_step, pass buffers cloned inside the transformed function, or use "
    "model.eval()."
)


def explain_buffer_write(err: BaseException, per_sample: bool = False) -> RuntimeError | None:
    """The clear error for a forward that writes a buffer under torch.func, or None.

    The one place that recognises it: eager torch raises "mutate a captured Tensor";
    torch.compile wraps that same text in its own exception; a train-mode
    BatchNorm1d over one sample says "Expected more than 1 value per channel".
    """
    msg = str(err)
    if per_sample and (
        "mutate a captured Tensor" in msg or "Expected more than 1 value per channel" in msg
    ):
        return RuntimeError(f"{PER_SAMPLE_BATCHNORM}\nOriginal error: {msg}")
    if "mutate a captured Tensor" in msg and BUFFER_WRITE not in msg:
        return RuntimeError(f"fg.call: {BUFFER_WRITE}\nOriginal error: {msg}")
    return None


def call(
    model: nn.Module,
    params: Mapping[str, Tensor],
    *args: Any,
    buffers: Mapping[str, Tensor] | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``model(*args, **kwargs)`` with ``params`` (and ``buffers``) substituted.

    A thin, checked wrapper of ``torch.func.functional_call``: gradients taken with
    ``torch.func.grad`` over ``params`` equal those of ``loss.backward()``. Buffers
    default to the module's own. Tied parameters follow the one name given.

    Example:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> p = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
        >>> fg.call(model, p, torch.tensor([[1.0, 2.0]]))
        tensor([[3.]])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fg.call: expected an nn.Module as first argument, got {type(model).__name__}. "
            "Call it as fg.call(model, params, *inputs)."
        )
    if not torch.compiler.is_compiling():
        # Name checks are plain Python; under torch.compile they would only be traced
        # once anyway, and the eager path catches mistakes first.
        check_names(model, params, "fg.call")
    tensors = dict(params)
    if buffers is not None:
        tensors.update(buffers)
    try:
        return functional_call(model, tensors, args, kwargs, strict=False, tie_weights=True)
    except RuntimeError as err:
        better = explain_buffer_write(err)
        if better is None:
            raise
        raise better from err
