"""What the example scripts share: the --help formatter, checking the output directory
up front, and the one-line summary each prints last."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path


class ShowDefaults(argparse.HelpFormatter):
    """``--help`` shows every option's default (flags that default to off excepted)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = not any(action.default is v for v in (None, False, argparse.SUPPRESS))
        if shown and action.option_strings and "%(default)" not in text:
            text = f"{text} (default: %(default)s)".strip()
        return text

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings:  # argparse skips an empty help
            action = copy.copy(action)
            action.help = self._get_help_string(action) or None
        return super()._format_action(action)


def check_out_dir(ap: argparse.ArgumentParser, out: Path) -> None:
    """Create ``out`` and make sure it is writable, or exit with argparse's error."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        ap.error(f"cannot write to --out {str(out)!r}: {err.strerror}. Pick a writable directory.")


def summary(example: str, **figures: float | int | str) -> str:
    """Print, and return, the example's last line: ``summary NAME: key=value, ...``.

    One line per run, in the same form for every example, so that a reader can
    compare a run with the figures in ``docs/examples.md`` (floats to 4 significant
    digits)."""
    parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()]
    line = f"summary {example}: {', '.join(parts)}"
    print(line)
    return line
