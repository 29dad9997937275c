"""Speed of the functional pass: a double-buffered MXFP4 GEMM program against ``mx.matmul``.

Both compute the same [M, N] product bit for bit; the ratio (functional run / ``mx.matmul``) is
what the emulator's byte-level memory, instruction dispatch and tiling cost on top of the bare
math. The baseline is ``mx.matmul`` under one ``jax.jit``, warm, on inputs already on the device:
the fastest honest form of the same math. Compilation is timed separately (first call) and
excluded from the steady-state ratio; ``--whole-program`` also times
``compile="program"`` (one traced function: long compile, faster runs). Goal (issue 12,
"Emulator speed"): at most 1.5x (an earlier issue asked 2x).

Where the time goes (measured on a 2-core CPU): the default 1024 x 1024 x 2048 program runs 256
``mxu.matmul`` of [128, 512] x [512, 128] MXFP4. ``mx.matmul`` alone on one such tile took
500-930 us across runs (a plain float32 dot of that size 200-320 us; the rest is decoding codes
and the fast path's checks), and per MAC a tile is about 2x slower than one call on the whole
problem: XLA's CPU dot is much less efficient at this size. So even free dispatch leaves well
over 1.5x on ``tiny``, where at most two matmuls (one per core) are ever ready together, fewer
than a batch: the target needs fewer, larger matmul calls, not a faster instruction path.

Run: python benchmarks/bench_functional.py [--m 1024 --n 1024 --k 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.emu.functional import run_functional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _common import best_time_s, write_json
from gemm_from_scratch import build_gemm


def main() -> None:
    """Time both and print the ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--whole-program", action="store_true",
                    help="also time compile='program' (one traced function; slow to compile)")
    ap.add_argument("--json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    a = mx.quantize(rng.standard_normal((args.m, args.k)).astype(np.float32), axis=1)
    b = mx.quantize(rng.standard_normal((args.k, args.n)).astype(np.float32), axis=0)
    t0 = time.perf_counter()
    prog = build_gemm(args.m, args.n, args.k, double_buffer=True, chip=args.preset)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = run_functional(prog, {"A": a, "B": b}).read("C")
    first_s = time.perf_counter() - t0
    # One compiled call (mx.matmul alone is jitted inside but allocates its zero accumulators in
    # a separate dispatch); its first call here compiles it, so the timed calls are warm.
    matmul = jax.jit(mx.matmul)
    want = np.asarray(matmul(a, b))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), "functional != mx.matmul"
    emu_s = best_time_s(lambda: run_functional(prog, {"A": a, "B": b}).buffers, args.repeats)
    ref_s = best_time_s(lambda: matmul(a, b), args.repeats)
    res = {"shape": [args.m, args.n, args.k], "instructions": len(prog.instructions),
           "build_s": build_s, "first_call_s": first_s, "functional_s": emu_s,
           "mx_matmul_s": ref_s, "ratio": emu_s / ref_s}
    if args.whole_program:
        t0 = time.perf_counter()
        run_functional(prog, {"A": a, "B": b}, compile="program")
        res["program_first_call_s"] = time.perf_counter() - t0
        res["program_functional_s"] = best_time_s(
            lambda: run_functional(prog, {"A": a, "B": b}, compile="program").buffers, args.repeats)
        res["program_ratio"] = res["program_functional_s"] / ref_s
    for k, v in res.items():
        print(f"{k:>14}: {v}")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
