"""Speed of the program checker: instructions checked per second, on kernels of growing size.

``check_program`` proves a program free of races and of reads of memory nothing wrote before
either pass runs, and is the part of a functional kernel run that grows with the program. For
each case (a registered kernel and shape on the preset) the program is built once (not timed)
and checked ``--repeats`` times; the figure is instructions per second of the best run. A
checker that scales linearly keeps the rate as programs grow: compare gemm 1024^3 (3k
instructions), 2048^3 (22k) and, with ``--large``, 4096^3 (212k; the first checker compared
each access with every earlier live one and took 390 s there, ~540 instructions/s).

Run: python benchmarks/bench_check.py [--preset tiny] [--large] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import time

from _common import best_time_s, write_json

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.kernels import get_kernel

CASES: list[tuple[str, dict]] = [
    ("gemm", {"m": 1024, "n": 1024, "k": 1024}),
    ("gemm", {"m": 2048, "n": 2048, "k": 2048}),
    ("attention-prefill", {"seq": 1024}),
    ("attention-decode", {"batch": 8, "context": 4096}),
    ("mla-prefill", {"seq": 512}),
    ("moe", {"tokens": 64, "hidden": 1024, "intermediate": 512, "experts": 16}),
]
LARGE: list[tuple[str, dict]] = [("gemm", {"m": 4096, "n": 4096, "k": 4096})]


def main() -> None:
    """Check every case and print instructions per second."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--large", action="store_true", help="add gemm 4096^3 (212k instructions)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    spec = load_preset(args.preset)
    rows = []
    for name, shape in CASES + (LARGE if args.large else []):
        kdef = get_kernel(name)
        t0 = time.perf_counter()
        program = kdef.build(kdef.shape(shape), spec).program
        build_s = time.perf_counter() - t0
        n = len(program.instructions)
        # Large programs once: their rate is steady, and a run takes tens of seconds.
        check_s = best_time_s(lambda p=program: check_program(p, spec),
                              1 if n > 100_000 else args.repeats)
        rows.append({"kernel": name, "shape": shape, "instructions": n, "build_s": build_s,
                     "check_s": check_s, "instructions_per_s": n / check_s})
        label = ",".join(f"{k}={v}" for k, v in shape.items())
        print(f"{name:>18} {label:<48} {n:7d} instr  build {build_s:6.2f} s  check "
              f"{check_s:7.2f} s  {n / check_s:9,.0f} instr/s")
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
