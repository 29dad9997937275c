"""Wall time of a cold ``serve`` on a GPU preset (issue target: at most 60 s on 2 cores).

Runs ``jalapeno-emu serve --preset gb200-nvl72 --model gpt-oss-120b --isl 8192 --osl 1024
--concurrency 1 --json`` in fresh processes with an empty cache directory each, alternating
``--workers 1`` (every kernel build in the calling process) and the default (builds of a grid
query's points side by side, ``LaunchTimer.prefetch``), so both see the same machine load. Its time
is almost all kernel builds of the step model's grid points (the attention-prefill grid on 148
cores above all). Reports each run's wall seconds, the best of each and their ratio, and whether
every run's JSON is the same prediction (it must be: the same builds, run elsewhere).

Run: ``python benchmarks/bench_gpu_serve.py [--runs 1] [--preset gb200-nvl72] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import write_json


def serve_once(preset: str, workers: int | None) -> tuple[float, dict[str, Any]]:
    """(wall seconds, the JSON document) of one cold ``serve`` in a new process."""
    with tempfile.TemporaryDirectory(prefix="jalapeno-emu-bench-") as cache:
        cmd = [sys.executable, "-m", "jalapeno_emu.cli.main", "serve", "--preset", preset,
               "--model", "gpt-oss-120b", "--isl", "8192", "--osl", "1024", "--concurrency", "1", "--json"]
        if workers is not None:
            cmd += ["--workers", str(workers)]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                             env={**os.environ, "JALAPENO_EMU_CACHE_DIR": cache})
        return time.perf_counter() - t0, json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1, help="runs of each setting, alternated (default 1)")
    ap.add_argument("--preset", default="gb200-nvl72")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    walls: dict[str, list[float]] = {"workers 1": [], "default workers": []}
    docs = []
    for _ in range(args.runs):
        for label, workers in (("workers 1", 1), ("default workers", None)):
            wall, doc = serve_once(args.preset, workers)
            walls[label].append(wall)
            docs.append(doc)
            print(f"{label:>16}: {wall:7.1f} s", flush=True)
    same = all(doc == docs[0] for doc in docs)
    best = {k: min(v) for k, v in walls.items()}
    ratio = best["workers 1"] / best["default workers"]
    print(f"best: workers 1 {best['workers 1']:.1f} s, default {best['default workers']:.1f} s "
          f"({ratio:.2f}x); the same prediction in every run: {same}")
    if args.json:
        write_json(args.json, {"preset": args.preset, "cpus": os.cpu_count(), "machine": platform.machine(),
                               "wall_s": walls, "best_s": best, "ratio": ratio, "same_prediction": same})


if __name__ == "__main__":
    main()
