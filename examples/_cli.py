"""What the example scripts share: checking the output directory up front."""

from __future__ import annotations

import argparse
from pathlib import Path


def check_out_dir(ap: argparse.ArgumentParser, out: Path) -> None:
    """Create ``out`` and make sure it is writable, or exit with argparse's error."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        ap.error(f"cannot write to --out {str(out)!r}: {err.strerror}. Pick a writable directory.")
