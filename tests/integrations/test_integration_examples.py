"""examples/lightning_fit.py runs and learns (needs ``funcgrad[integrations]``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def test_lightning_fit_example_trains_and_reports_the_monitor(capsys):
    import lightning_fit

    out = lightning_fit.main(["--epochs", "2"])
    text = capsys.readouterr().out
    assert "layer 0: zero fraction" in text and "layer 2: zero fraction" in text
    assert "Lightning + fg.Optimizer + cosine lr" in text
    assert out["accuracy"] > 0.3  # chance is 0.1
