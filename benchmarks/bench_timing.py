"""Speed of the timing pass: instructions timed per second on a 100k-instruction program.

The program (``microbench.pipeline_program``) runs a DMA -> matrix unit -> vector unit pipeline
on every core of jalapeno-v1 with semaphores between the stages: HBM loads, MXFP4 matmuls, vector
ops, signals and waits, twelve instructions per iteration per core. Goal: at least 2M
instructions/s (issue 12). Two figures per program:

- cold: the program has not been timed before, so the pass reads every Instruction object
  (``costs.ProgramFacts``) and then runs the event loop; this is the figure the goal is about.
- warm: the same Program object timed again (a what-if with other hardware knobs), which reuses
  what was read from it and only prices it and runs the loop.

Also reported: the parts (reading the program, pricing it on the chip, the event loop) and, for
comparison, a DMA-heavy 4 GiB stream and a 4 GiB MXFP4 GEMV. Each program is built twice: with
hardware loops where it repeats (``KernelBuilder.repeat``: a round of the pipeline's buffers, a
round of the stream's queues; the form the goal counts, every iteration a loop stands for
included) and unrolled (``isa.unrolled_loops``); both give the same per-engine times, checked.
The event loop is compiled (``emu/timing_core.py``, numba); the same run times the pure-Python
loop it replaced (``tests/emu/timing_reference.py``, the test oracle) for the ratio, and checks
that both give the same bits. ``first_call_s`` is the process's first ``run_timing`` (importing
numba and loading the compiled loop from numba's cache, or compiling it when the cache is empty).

Run: ``python benchmarks/bench_timing.py [--instructions 100000] [--json out.json]``. Times are the
best of several runs after one warm-up; building the programs (the builder) is not timed.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
from _common import best_time_s, write_json

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu import costs, microbench, run_timing
from jalapeno_emu.emu.timing import event_loop_args
from jalapeno_emu.isa import unrolled_loops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for the test oracle
from tests.emu.timing_reference import reference_run_timing

GOAL_PER_S = 2_000_000


def _per_engine(prog, tl) -> dict:
    """Engine -> its instructions with their start and end times, in issue order."""
    out: dict = {}
    for i, ins in enumerate(prog.instructions):
        out.setdefault(ins.engine, []).append((ins, tl.start_s[i], tl.end_s[i]))
    return out


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
    makers = {
        "pipeline": lambda: microbench.pipeline_program(spec, -(-args.instructions // per_iteration)),
        "stream_4GiB": lambda: microbench.hbm_stream_program(spec, 4 << 30),
        "gemv_4GiB": lambda: microbench.streamed_matmul_program(spec, 1, 32768, 262144, chunk_k=512, nbuf=4),
    }
    programs = {}
    for name, make in makers.items():
        programs[name] = make()
        with unrolled_loops():
            programs[f"{name}_unrolled"] = make()
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_timing(programs["stream_4GiB"], spec)
    first_call_s = time.perf_counter() - t0
    from jalapeno_emu.emu.timing_core import event_loop

    results: dict[str, dict[str, float]] = {}
    for name, prog in programs.items():
        n = prog.n_instructions
        run_timing(prog, spec)  # warm-up: imports, numpy, the channel-split cache

        def cold(prog=prog):
            costs._FACTS.clear()  # forget what was read from the program
            return run_timing(prog, spec)

        cold_s = best_time_s(cold, args.repeats)
        read_s = best_time_s(lambda prog=prog: costs.ProgramFacts(prog), args.repeats)
        tl = run_timing(prog, spec)
        warm_s = best_time_s(lambda prog=prog: run_timing(prog, spec), args.repeats)
        price_s = best_time_s(lambda prog=prog: costs.StaticCosts(prog, spec), args.repeats)
        loop_args = event_loop_args(costs.StaticCosts(prog, spec), spec)
        loop_s = best_time_s(lambda loop_args=loop_args: event_loop(*loop_args), args.repeats)
        ref = reference_run_timing(prog, spec)
        assert ref.end_s.tobytes() == tl.end_s.tobytes() and ref.pred.tobytes() == tl.pred.tobytes()
        if name.endswith("_unrolled"):  # the looped form times every engine's stream the same
            looped = programs[name.removesuffix("_unrolled")]
            assert _per_engine(looped, run_timing(looped, spec)) == _per_engine(prog, tl)
        ref_repeats = max(1, args.repeats // 2)
        ref_warm_s = best_time_s(lambda prog=prog: reference_run_timing(prog, spec), ref_repeats)
        ref_loop_s = ref_warm_s - price_s  # pricing and the Timeline are shared; the loop is not
        results[name] = {
            "instructions": n,
            "cold_s": cold_s,
            "warm_s": warm_s,
            "read_program_s": read_s,
            "price_s": price_s,
            "event_loop_s": loop_s,
            "python_loop_s": ref_loop_s,
            "python_warm_s": ref_warm_s,
            "loop_instructions_per_s": n / loop_s,
            "python_loop_instructions_per_s": n / ref_loop_s,
            "loop_speedup": ref_loop_s / loop_s,
            "warm_speedup": ref_warm_s / warm_s,
            "cold_instructions_per_s": n / cold_s,
            "warm_instructions_per_s": n / warm_s,
            "cold_ratio_to_goal": n / cold_s / GOAL_PER_S,
            "warm_ratio_to_goal": n / warm_s / GOAL_PER_S,
            "simulated_time_s": tl.time_s,
        }
    env = {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
           "numpy": np.__version__, "build_s": build_s, "first_call_s": first_call_s}
    for name, r in results.items():
        print(f"{name:>21}: {r['instructions']:6d} instructions | cold {1e3 * r['cold_s']:6.1f} ms = "
              f"{r['cold_instructions_per_s'] / 1e3:4.0f}k/s ({r['cold_ratio_to_goal']:.2f}x goal) | warm "
              f"{1e3 * r['warm_s']:6.1f} ms = {r['warm_instructions_per_s'] / 1e3:4.0f}k/s "
              f"({r['warm_ratio_to_goal']:.2f}x) | read {1e3 * r['read_program_s']:5.1f} + price "
              f"{1e3 * r['price_s']:4.1f} + loop {1e3 * r['event_loop_s']:5.1f} ms")
        print(f"{'':>21}  event loop {r['loop_instructions_per_s'] / 1e6:5.2f}M/s compiled vs "
              f"{r['python_loop_instructions_per_s'] / 1e3:4.0f}k/s pure Python ({r['loop_speedup']:.0f}x); "
              f"warm run_timing {r['warm_speedup']:.1f}x the pure-Python pass")
    print(f"first run_timing of the process (numba import + cache load or compile): {first_call_s:.2f} s")
    if args.json:
        write_json(args.json, {"results": results, "goal_instructions_per_s": GOAL_PER_S, "env": env})


if __name__ == "__main__":
    main()
