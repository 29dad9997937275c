"""Speed of the timing pass: instructions timed per second on a 100k-instruction program.

The program (``microbench.pipeline_program``) runs a DMA -> matrix unit -> vector unit pipeline
on every core of jalapeno-v1 with semaphores between the stages: HBM loads, MXFP4 matmuls, vector
ops, signals and waits, twelve instructions per iteration per core. Goal: at least 500k
instructions/s. Two figures per program:

- cold: the program has not been timed before, so the pass reads every Instruction object
  (``costs.ProgramFacts``) and then runs the event loop; this is the figure the goal is about.
- warm: the same Program object timed again (a what-if with other hardware knobs), which reuses
  what was read from it and only prices it and runs the loop.

Also reported: the parts (reading the program, pricing it on the chip, the event loop) and, for
comparison, a DMA-heavy 4 GiB stream and a 4 GiB MXFP4 GEMV.

Run: ``python benchmarks/bench_timing.py [--instructions 100000] [--json out.json]``. Times are the
best of several runs after one warm-up; building the programs (the builder) is not timed.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
from _common import best_time_s, write_json

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu import costs, microbench, run_timing

GOAL_PER_S = 500_000


def main() -> None:
    """Build the programs, time the timing pass, print instructions/s and the ratio to the goal."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instructions", type=int, default=100_000, help="size of the pipeline program")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()

    spec = load_preset("jalapeno-v1")
    per_iteration = 12 * spec.core.count
    t0 = time.perf_counter()
    programs = {
        "pipeline": microbench.pipeline_program(spec, -(-args.instructions // per_iteration)),
        "stream_4GiB": microbench.hbm_stream_program(spec, 4 << 30),
        "gemv_4GiB": microbench.streamed_matmul_program(spec, 1, 32768, 262144, chunk_k=512, nbuf=4),
    }
    build_s = time.perf_counter() - t0
    results: dict[str, dict[str, float]] = {}
    for name, prog in programs.items():
        n = len(prog.instructions)
        run_timing(prog, spec)  # warm-up: imports, numpy, the channel-split cache

        def cold(prog=prog):
            costs._FACTS.clear()  # forget what was read from the program
            return run_timing(prog, spec)

        cold_s = best_time_s(cold, args.repeats)
        read_s = best_time_s(lambda prog=prog: costs.ProgramFacts(prog), args.repeats)
        tl = run_timing(prog, spec)
        warm_s = best_time_s(lambda prog=prog: run_timing(prog, spec), args.repeats)
        price_s = best_time_s(lambda prog=prog: costs.StaticCosts(prog, spec), args.repeats)
        results[name] = {
            "instructions": n,
            "cold_s": cold_s,
            "warm_s": warm_s,
            "read_program_s": read_s,
            "price_s": price_s,
            "event_loop_s": warm_s - price_s,
            "cold_instructions_per_s": n / cold_s,
            "warm_instructions_per_s": n / warm_s,
            "cold_ratio_to_goal": n / cold_s / GOAL_PER_S,
            "warm_ratio_to_goal": n / warm_s / GOAL_PER_S,
            "simulated_time_s": tl.time_s,
        }
    env = {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
           "numpy": np.__version__, "build_s": build_s}
    for name, r in results.items():
        print(f"{name:>12}: {r['instructions']:6d} instructions | cold {1e3 * r['cold_s']:6.1f} ms = "
              f"{r['cold_instructions_per_s'] / 1e3:4.0f}k/s ({r['cold_ratio_to_goal']:.2f}x goal) | warm "
              f"{1e3 * r['warm_s']:6.1f} ms = {r['warm_instructions_per_s'] / 1e3:4.0f}k/s "
              f"({r['warm_ratio_to_goal']:.2f}x) | read {1e3 * r['read_program_s']:5.1f} + price "
              f"{1e3 * r['price_s']:4.1f} + loop {1e3 * r['event_loop_s']:5.1f} ms")
    if args.json:
        write_json(args.json, {"results": results, "goal_instructions_per_s": GOAL_PER_S, "env": env})


if __name__ == "__main__":
    main()
