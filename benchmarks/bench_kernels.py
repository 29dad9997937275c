"""Functional emulation of every library kernel against its pure-JAX reference, same shapes.

For each registered kernel at its default (small) shape on the tiny preset: the functional pass
(after a warm-up run, so compilation is excluded) against the kernel's own pure-JAX reference
(also warmed up). Goal (issue 4): at most 2x. Times are the best of ``--repeats``.

Run: python benchmarks/bench_kernels.py [--preset tiny] [--json out.json]
"""

from __future__ import annotations

import argparse

from _common import best_time_s, write_json

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.kernels import all_kernels


def main() -> None:
    """Time every kernel and print the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    spec = load_preset(args.preset)
    rows = []
    for kdef in all_kernels():
        build = kdef.build(kdef.defaults(), spec)
        inputs = build.make_inputs(0)
        run_functional(build.program, inputs)  # compile
        build.reference(inputs)
        emu = best_time_s(lambda b=build, x=inputs: run_functional(b.program, x).buffers, args.repeats)
        ref = best_time_s(lambda b=build, x=inputs: b.reference(x), args.repeats)
        rows.append({"kernel": kdef.name, "shape": kdef.defaults(),
                     "instructions": len(build.program.instructions),
                     "functional_s": emu, "reference_s": ref, "ratio": emu / ref})
        print(f"{kdef.name:>18}: {len(build.program.instructions):5d} instr  functional "
              f"{emu * 1e3:8.2f} ms  reference {ref * 1e3:8.2f} ms  ratio {emu / ref:6.2f}x")
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
