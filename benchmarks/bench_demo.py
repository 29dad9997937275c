"""Wall time of ``jalapeno-emu demo``: its first run on an empty cache, then warm runs with the
functional pass's executable store on and off, alternated in the same invocation.

- ``first``: a fresh cache directory (``JALAPENO_EMU_CACHE_DIR``): no compiled function, no
  stored executable, no kernel or step timing. Goal (issue 12, "Emulator speed"): at most 30 s.
- ``warm``: the same directory afterwards, so JAX's persistent cache, the executable store and the
  timing caches are all filled; ``store`` on (the default) against ``JALAPENO_EMU_EXECUTABLE_STORE=0``
  (JAX's cache only: every function is traced and lowered again to find its executable), one
  after the other ``--repeats`` times, so both see the same machine load. Goal: at most 15 s.

Each figure is the wall time of the whole process (Python start-up and imports included, what a
user waits for) and the demo's own "demo took" line (from its first step).

Run: ``python benchmarks/bench_demo.py [--repeats 2] [--json out.json] [--cache-dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import write_json

FIRST_GOAL_S, WARM_GOAL_S = 30.0, 15.0


def run_demo(cache_dir: str, **env: str) -> dict[str, float]:
    """One ``jalapeno-emu demo`` process; its wall time and the time it reports, in seconds."""
    full = {**os.environ, "JALAPENO_EMU_CACHE_DIR": cache_dir, **env}
    full.pop("JAX_COMPILATION_CACHE_DIR", None)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "jalapeno_emu.cli.main", "demo"], env=full,
                         capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"demo failed ({out.returncode}):\n{out.stderr[-2000:]}")
    said = re.search(r"demo took ([0-9.]+) s", out.stdout)
    return {"wall_s": wall, "reported_s": float(said.group(1)) if said else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--cache-dir", help="cache directory (default: a fresh temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
        cache = args.cache_dir or tmp
        doc: dict[str, Any] = {"machine": platform.processor() or platform.machine(),
                               "cpus": os.cpu_count(), "first": run_demo(cache)}
        print(f"first run: {doc['first']['wall_s']:.1f} s wall, demo says {doc['first']['reported_s']:.1f} s "
              f"(goal {FIRST_GOAL_S:.0f} s)", flush=True)
        runs: dict[str, list[dict[str, float]]] = {"store": [], "no_store": []}
        for _ in range(args.repeats):
            runs["store"].append(run_demo(cache))
            runs["no_store"].append(run_demo(cache, JALAPENO_EMU_EXECUTABLE_STORE="0"))
        for name, rs in runs.items():
            best = min(rs, key=lambda r: r["wall_s"])
            doc[f"warm_{name}"] = {"runs": rs, "best_wall_s": best["wall_s"],
                                   "best_reported_s": best["reported_s"]}
            walls = ", ".join(f"{r['wall_s']:.1f}" for r in rs)
            print(f"warm, {name.replace('_', ' ')}: best {best['wall_s']:.1f} s wall, demo says "
                  f"{best['reported_s']:.1f} s (all: {walls})", flush=True)
        ratio = doc["warm_no_store"]["best_wall_s"] / doc["warm_store"]["best_wall_s"]
        doc["warm_speedup_from_store"] = ratio
        print(f"warm: the store makes the demo {ratio:.2f}x faster; goal {WARM_GOAL_S:.0f} s "
              f"{'met' if doc['warm_store']['best_wall_s'] <= WARM_GOAL_S else 'missed'}")
    if args.json:
        write_json(args.json, doc)


if __name__ == "__main__":
    main()
