"""Wall time of the rack serving sweep: gpt-oss-120b, DeepSeek-R1 and Kimi K2.5 on jalapeno-v1 at
ISL/OSL 8192/1024, concurrency 1, 2, 4, ... 1024, every candidate mapping screened and the
shortlisted ones simulated with the timing-pass step model (what ``jalapeno-emu sweep`` does).

Reported per model: wall and CPU seconds (CPU is what a loaded machine does not inflate), wall split
into kernel builds + timing passes (the grid points timed,
``LaunchTimer.build_wall_s``) and the rest (screen, collectives, the serving simulator); kernels
built; candidates screened; points simulated; and the best simulated mapping at concurrency 1, 64
and 1024 for each objective with its metrics.

Two runs of the same sweep, measured in the same invocation:

- ``cold``: no kernel timing known (every grid point built and timed by the emulator);
- ``warm``: a second process run reading the figures the cold run left in the disk cache
  (``--cache-dir``), which is what a repeated ``jalapeno-emu sweep`` costs.

Run: ``python benchmarks/bench_sweep.py [--models gpt-oss-120b,...] [--json out.json]
[--cache-dir DIR] [--phase cold|warm|both] [--workers N]``. The cache directory defaults to a
fresh temporary one, so ``cold`` is cold. ``--workers 2`` on a 2-core machine measures what
``jalapeno-emu sweep`` does there (its default is the CPU count).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

MODELS = ("gpt-oss-120b", "deepseek-r1", "kimi-k2.5")
ISL, OSL = 8192, 1024
CONCURRENCIES = [2**i for i in range(11)]
REPORT_AT = (1, 64, 1024)


def run_models(models: list[str], cache_dir: str, workers: int = 1) -> dict[str, Any]:
    """Sweep each model with the disk cache in ``cache_dir``; figures per model. ``workers`` > 1:
    the mappings run in that many local processes, as ``jalapeno-emu sweep --workers`` does (the
    kernel counts below are then this process's only)."""
    os.environ["JALAPENO_EMU_CACHE_DIR"] = cache_dir
    from jalapeno_emu.parallel import executor
    from jalapeno_emu.rack.deployment import sweep_mappings
    from jalapeno_emu.rack.launch_timer import shared_timer
    from jalapeno_emu.rack.search import OBJECTIVES

    out: dict[str, Any] = {}
    timer = shared_timer("jalapeno-v1", disk_cache=True)
    for model in models:
        builds0, build_s0 = timer.builds, timer.build_wall_s
        t0, cpu0 = time.perf_counter(), time.process_time()
        with executor(workers) as ex:
            points, screened = sweep_mappings(model, "jalapeno-v1", ISL, OSL, CONCURRENCIES, disk_cache=True,
                                              executor=ex)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        best = {}
        for c in REPORT_AT:
            here = [p for p in points if p.concurrency == c]
            for objective, key in OBJECTIVES.items():
                top = max(here, key=lambda p, key=key: getattr(p.metrics, key))
                d = top.metrics.as_dict()
                best[f"{objective}@{c}"] = {k: d[k] for k in (
                    "mapping", "chips", "interactivity_tok_s_user", "ttft_s", "tpot_s", "e2e_s",
                    "throughput_tok_s_per_chip", "tok_s_per_kw")}
        out[model] = {"wall_s": wall, "cpu_s": cpu, "build_and_time_s": timer.build_wall_s - build_s0,
                      "kernels_built": timer.builds - builds0, "candidates_screened": screened,
                      "points_simulated": len(points), "mappings_simulated": len({p.mapping for p in points}),
                      "best": best}
        built_s = timer.build_wall_s - build_s0
        print(f"{model}: {wall:.1f} s wall, {cpu:.1f} s CPU ({built_s:.1f} s building/timing "
              f"{timer.builds - builds0} kernels), {len(points)} points over "
              f"{out[model]['mappings_simulated']} mappings of {screened} screened", flush=True)
        for name, b in best.items():
            print(f"  best {name:18s} {b['mapping']:22s} {b['chips']:>4} chips  "
                  f"{b['interactivity_tok_s_user']:8.1f} tok/s/user  TTFT {b['ttft_s']:.3f} s  "
                  f"TPOT {b['tpot_s'] * 1e3:.2f} ms  {b['throughput_tok_s_per_chip']:9.0f} tok/s/chip  "
                  f"{b['tok_s_per_kw']['all_in']:8.0f} tok/s/kW all-in", flush=True)
    return out


def _phase(models: list[str], cache_dir: str, workers: int) -> dict[str, Any]:
    """One phase in a fresh process (a process-wide timer would otherwise remember the cold run)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, __file__, "--models", ",".join(models), "--cache-dir", cache_dir,
           "--phase", "inner", "--json", path, "--workers", str(workers)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t0
    with open(path) as f:
        doc = json.load(f)
    os.unlink(path)
    doc["process_wall_s"] = wall
    return doc


def main() -> None:
    """Run the cold and warm sweeps (each in its own process) and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--cache-dir", help="disk cache directory (default: a fresh temporary one)")
    ap.add_argument("--phase", default="both", choices=("cold", "warm", "both", "inner"))
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--workers", type=int, default=1,
                    help="local processes for the mappings (1: serial, the default; the CPU count is "
                         "what `jalapeno-emu sweep` uses)")
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="jalapeno-emu-bench-")
    if args.phase == "inner":
        doc = run_models(models, cache_dir, args.workers)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=2)
        return
    results: dict[str, Any] = {"workload": {"isl": ISL, "osl": OSL, "concurrencies": CONCURRENCIES,
                                            "preset": "jalapeno-v1"}, "cpus": os.cpu_count(),
               "workers": args.workers}
    for phase in (("cold", "warm") if args.phase == "both" else (args.phase,)):
        print(f"--- {phase} (cache {cache_dir}, {args.workers} worker(s))", flush=True)
        results[phase] = _phase(models, cache_dir, args.workers)
        total = sum(v["wall_s"] for k, v in results[phase].items() if k in models)
        proc = results[phase]["process_wall_s"]
        print(f"{phase}: all models {total:.1f} s (process {proc:.1f} s)", flush=True)
    if args.json:
        sys.path.insert(0, os.path.dirname(__file__))
        from _common import write_json

        write_json(args.json, results)


if __name__ == "__main__":
    main()
