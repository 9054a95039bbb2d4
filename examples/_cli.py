"""What the example scripts share: checking the output directory up front."""

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
