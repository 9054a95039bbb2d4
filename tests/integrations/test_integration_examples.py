"""examples/lightning_fit.py runs and learns (needs ``funcgrad[integrations]``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def test_lightning_fit_example_trains_and_reports_the_monitor(capsys):
    import lightning_fit

    out = lightning_fit.main(["--epochs", "2"])
    text = capsys.readouterr().out
    assert "layer 0: zero fraction" in text and "layer 2: zero fraction" in text
    assert "Lightning + fg.Optimizer + cosine lr" in text
    last = text.rstrip().splitlines()[-1]
    assert last.startswith("summary lightning_fit: "), last
    shown = dict(part.split("=", 1) for part in last.split(": ", 1)[1].split(", "))
    assert float(shown["test_acc"]) == pytest.approx(out["accuracy"], rel=1e-3)
    assert out["accuracy"] > 0.3  # chance is 0.1
