"""fg.add_noise: the integer hash against plain Python ints, and the statistics."""

from __future__ import annotations

import math
import re

import pytest
import torch
from references import check_compiles

import funcgrad as fg

M32 = 0xFFFFFFFF


def py_mix(x: int) -> int:
    # Written independently of funcgrad's version: explicit steps on Python ints.
    x = ((x ^ (x >> 16)) * 0x45D9F3B) % 2**32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) % 2**32
    return x ^ (x >> 16)


def py_noise(seed: int, step: int, index: int, j: int) -> float:
    key = py_mix(py_mix(step & M32) ^ py_mix(py_mix(seed) ^ index))
    a = py_mix((key + 2 * j * 0x2545F491) % 2**32)
    b = py_mix((key + (2 * j + 1) * 0x2545F491) % 2**32)
    u1, u2 = (a + 0.5) / 2**32, (b + 0.5) / 2**32
    return math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)


def test_noise_matches_python_reference():
    tx = fg.add_noise(std=2.0, seed=12345)
    g = {"a": torch.zeros(3, 4, dtype=torch.float64), "b": torch.ones(5, dtype=torch.float64)}
    state = tx.init(g)
    for step in range(3):
        out, state = tx.update(g, state)
        for index, (k, t) in enumerate(g.items()):
            want = [
                t.flatten()[j].item() + 2.0 * py_noise(12345, step, index, j)
                for j in range(t.numel())
            ]
            torch.testing.assert_close(
                out[k].flatten(), torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12
            )


def test_noise_statistics():
    tx = fg.add_noise(std=1.0, seed=0)
    g = {"a": torch.zeros(200_000), "b": torch.zeros(200_000)}
    s = tx.init(g)
    n1, s = tx.update(g, s)
    n2, _ = tx.update(g, s)
    for t in (n1["a"], n1["b"], n2["a"]):
        assert abs(t.mean().item()) < 0.01
        assert abs(t.std().item() - 1.0) < 0.01
        # Tail mass of a standard normal: P(|z| > 2) = 0.0455.
        assert abs((t.abs() > 2).float().mean().item() - 0.0455) < 0.003
    # Parameters and steps draw independent streams.
    for x, y in ((n1["a"], n1["b"]), (n1["a"], n2["a"])):
        assert abs(torch.corrcoef(torch.stack([x, y]))[0, 1].item()) < 0.01


def test_noise_compiles_and_keeps_dtype():
    tx = fg.add_noise(std=0.1, seed=3)
    g = {"w": torch.zeros(4, 3, dtype=torch.bfloat16), "v": torch.zeros(7)}
    s = tx.init(g)
    out, _ = tx.update(g, s)
    assert out["w"].dtype == torch.bfloat16
    s2 = tx.update(g, s)[1]
    check_compiles(tx.update, (g, s), (g, s2), rtol=1e-6, atol=1e-6)


def test_noise_errors():
    with pytest.raises(
        ValueError, match=re.escape("fg.add_noise: seed must be an int in [0, 2**32), got 1.5")
    ):
        fg.add_noise(std=1.0, seed=1.5)  # type: ignore[arg-type]
