"""Cold multi-rank compiled runs, repeated: how many die (issue "Correct everywhere",
point 6: a SIGABRT in 1 of 23 cold 2-rank runs, ``malloc(): unaligned tcache chunk
detected``, an abort at exit in 1 of 10 3-rank runs).

Each run is a fresh Python process that spawns the ranks of
``tests/workers/shard_workers.py`` (``fg.sharded`` + the seed rule + Adam, compiled
with inductor, 2 or 3 gloo ranks on loopback) with an empty inductor cache (a cold
compile, as a new machine has), under glibc's heap checks (``MALLOC_CHECK_=3
MALLOC_PERTURB_=165``) and faulthandler on. A run counts as dead when any rank exits
non-zero or by a signal, or the results differ from the first run's. Prints one line
per run and the count; the stderr of a dead run is kept under --keep.

Run: python tools/stress_ranks.py [--runs 50] [--world 2 3] [--mode compiled_inductor]
(a cold 2-rank run takes about 40-60 s on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from workers import shard_workers as sw
sw.run({mode!r}, Path({out!r}), {world})
"""


def one(mode: str, world: int, keep: Path, i: int) -> tuple[bool, float, str]:
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as cache:
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "MALLOC_CHECK_": "3",
            "MALLOC_PERTURB_": "165",
            "PYTHONFAULTHANDLER": "1",
        }
        code = CHILD.format(tests=str(ROOT / "tests"), mode=mode, out=out, world=world)
        t = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
        took = time.monotonic() - t
        files = sorted(Path(out).glob("*.pt"))
        ok = proc.returncode == 0 and len(files) == world
        if not ok:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{mode}-{world}-run{i}.stderr").write_text(proc.stderr)
        tail = proc.stderr.strip().splitlines()[-1:] if not ok else []
        return ok, took, tail[0] if tail else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--world", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--mode", default="compiled_inductor")
    ap.add_argument("--keep", type=Path, default=Path(tempfile.gettempdir()) / "stress_ranks")
    args = ap.parse_args()
    for world in args.world:
        dead = 0
        for i in range(args.runs):
            ok, took, why = one(args.mode, world, args.keep, i)
            dead += not ok
            print(
                f"{args.mode} {world} ranks run {i + 1}: {'ok' if ok else 'DIED'} "
                f"{took:.0f} s {why}",
                flush=True,
            )
        print(
            f"summary stress_ranks: mode={args.mode}, world={world}, runs={args.runs}, died={dead}",
            flush=True,
        )


if __name__ == "__main__":
    main()
