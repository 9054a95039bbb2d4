"""Reproducible Gaussian noise without a hidden global RNG.

``torch.Generator`` arguments break ``torch.compile`` graphs, and inductor's own RNG
draws other numbers than eager mode. So :func:`add_noise` uses a counter-based
generator written in integer tensor ops: every draw is a pure function of
``(seed, step, parameter index, element index)``: the integer part is exact on any
backend, eager equals compiled up to float rounding in the final transform, and a
run resumes from the state alone.

Each draw hashes a Weyl sequence (``key + n * 0x2545F491 mod 2**32``, SplitMix
style) with a 32-bit xor-shift-multiply mixer (constant 0x45d9f3b), on int64
tensors kept below 2**63 so nothing overflows, then Box-Muller in float64. It
passes the statistical checks in the tests, but it is not a cryptographic
generator: for a formal differential-privacy guarantee use a secure source.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, overload

import torch
from torch import Tensor

from ..core._base import (
    GradientTransformation,
    Params,
    check_state,
    is_int,
    is_number,
    params_device,
)
from ..core._fusion import realize
from ..core._invariants import invariants

_M32 = 0xFFFFFFFF
_C = 0x45D9F3B
_WEYL = 0x2545F491  # odd, < 2**30: n * _WEYL < 2**63 for n < 2**32


@overload
def mix32(x: int) -> int: ...
@overload
def mix32(x: Tensor) -> Tensor: ...
def mix32(x: Any) -> Any:
    """A 32-bit avalanche mixer; works on Python ints and int64 tensors alike."""
    x = (((x >> 16) ^ x) * _C) & _M32
    x = (((x >> 16) ^ x) * _C) & _M32
    return (x >> 16) ^ x


def normal_noise(key: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    """``numel`` standard normal draws from a 0-d int64 ``key`` in [0, 2**32)."""
    if numel >= 2**31:
        raise ValueError(
            f"fg.add_noise: a tensor of {numel} elements is too large for the 32-bit "
            "counter (at most 2**31 - 1 elements per parameter)."
        )
    # Nested mixers would be inlined by inductor into one expression tree that
    # doubles with every xor-shift (docs/compile-notes.md); a Weyl sequence keeps
    # the per-element tree small, and the 0-d key is computed once (realize).
    n = torch.arange(numel, dtype=torch.int64, device=key.device) * 2
    a = mix32((key + n * _WEYL) & _M32)
    b = mix32((key + (n + 1) * _WEYL) & _M32)
    u1 = (a.to(torch.float64) + 0.5) / 2.0**32  # in (0, 1): log is finite
    u2 = (b.to(torch.float64) + 0.5) / 2.0**32
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return z.to(dtype)


class AddNoiseState(NamedTuple):
    """``count``: int64 0-d tensor, the number of steps taken (the noise counter)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax


invariants(AddNoiseState, count="nonnegative")


def add_noise(std: float, seed: int) -> GradientTransformation:
    """Add independent ``N(0, std**2)`` noise to every gradient entry.

    The noise of step ``t``, parameter ``i`` (in dict order) and entry ``j`` depends
    only on ``(seed, t, i, j)``: runs are reproducible, eager equals compiled, and a
    resumed state continues the same sequence. In DP-SGD, after averaging ``B``
    clipped per-sample gradients, ``std = noise_multiplier * max_norm / B``.

    Examples:
        >>> import torch, funcgrad as fg
        >>> tx = fg.add_noise(std=0.1, seed=0)
        >>> g = {"w": torch.zeros(3)}
        >>> a, s1 = tx.update(g, tx.init(g))
        >>> b, _ = tx.update(g, tx.init(g))
        >>> torch.equal(a["w"], b["w"]), int(s1.count)  # same seed and step: same noise
        (True, 1)
    """
    if not is_number(std) or not std >= 0:
        raise ValueError(f"fg.add_noise: std must be a number >= 0, got {std!r}.")
    if not is_int(seed) or not 0 <= seed < 2**32:
        raise ValueError(f"fg.add_noise: seed must be an int in [0, 2**32), got {seed!r}.")
    std = float(std)

    def init(params: Params) -> AddNoiseState:
        return AddNoiseState(torch.zeros((), dtype=torch.int64, device=params_device(params)))

    def update(
        grads: Params, state: AddNoiseState, params: Params | None = None
    ) -> tuple[Params, AddNoiseState]:
        check_state(state, AddNoiseState, "fg.add_noise")
        step_key = realize(mix32(state.count & _M32))
        out = {}
        for i, (k, g) in enumerate(grads.items()):
            param_key = mix32(mix32(seed) ^ i)  # plain Python int, folded at trace time
            key = realize(mix32(step_key ^ param_key))
            noise = normal_noise(key, g.numel(), g.dtype).reshape(g.shape)
            out[k] = g + std * noise
        return out, AddNoiseState(state.count + 1)

    return GradientTransformation(init, update)
