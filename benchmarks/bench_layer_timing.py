"""Speed of full-size timing-only runs: the kernels of a gpt-oss-120b decode step at batch 64.

The model runner (``model.timing.time_model``) times a decode step by building and timing each
distinct launch once (the builder, then ``run_timing``; no safety checks). This script times the
whole step (gpt-oss-120b, decode, batch 64, context 8192: 36 layers, 9 distinct launches), and
the main launches one after the other through ``run_kernel(..., safety_checks=False)`` (MoE, full
and sliding-window attention, the QKV and output projections, RMSNorm, logits), keeping every
report alive as the runner does, and prints per kernel:

- its two parts: building the Program (kernel code + builder) and timing it (reading the
  program, pricing it, the event loop, the summary), and instructions per second of each;
- a baseline measured in the same run: the time to create the same Instruction objects from
  their finished fields in a plain loop (``Instruction(mnemonic, engine, args, source)``), the
  least any builder can spend recording the Program. ``build / floor`` is how much the kernel
  code, the builder's operand handling, legality checks and tile arithmetic add to it.

Everything runs twice: with Python's cyclic garbage collector as it is, and with it paused for
the whole measurement (``gc.disable()`` ... ``gc.enable()``). A step allocates a few objects per
instruction (the Instruction, its operand tuples, tiles), all of them kept (the runner keeps every
Timeline and so every Program): with the collector running, each full collection re-walks every
Program built so far, which costs more than building them.

Run: ``python benchmarks/bench_layer_timing.py [--repeats 3] [--json out.json]``. Times are
the best of ``repeats`` (after one warm-up step); steps in wall and CPU seconds, the parts in
CPU seconds, which other processes on a shared machine disturb less than wall time.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time
from typing import Any

import numpy as np
from _common import write_json

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.isa.program import Instruction
from jalapeno_emu.kernels.registry import get_kernel
from jalapeno_emu.kernels.runner import run_kernel
from jalapeno_emu.model.config import load_model_config
from jalapeno_emu.model.plan import Step
from jalapeno_emu.model.timing import time_model

GOAL_S = 2.0  # the whole 36-layer step: each distinct launch once
LAUNCHES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("moe", {"tokens": 64, "hidden": 2880, "intermediate": 2880, "experts": 128, "top_k": 4,
             "routing": "uniform"}),
    ("attention-decode", {"batch": 64, "context": 8192, "q_heads": 64, "kv_heads": 8, "head_dim": 64,
                          "window": 0}),
    ("attention-decode", {"batch": 64, "context": 8192, "q_heads": 64, "kv_heads": 8, "head_dim": 64,
                          "window": 128}),
    ("gemm", {"m": 64, "n": 5120, "k": 2880, "weight_fmt": "bf16", "act_fmt": "bf16"}),
    ("gemm", {"m": 64, "n": 2880, "k": 4096, "weight_fmt": "bf16", "act_fmt": "bf16"}),
    ("rmsnorm", {"tokens": 64, "hidden": 2880}),
    ("logits", {"tokens": 64, "hidden": 2880, "vocab": 201088}),
)


def _label(name: str, shape: dict[str, Any]) -> str:
    if name == "attention-decode":
        return f"{name} window={shape['window']}"
    if name == "gemm":
        return f"gemm {shape['m']}x{shape['n']}x{shape['k']}"
    return name


def _step(spec: Any) -> tuple[float, float, list[Any]]:
    """One step as the runner runs it: wall and CPU seconds, and the reports (kept alive)."""
    reports = []
    t0, c0 = time.perf_counter(), time.process_time()
    for name, shape in LAUNCHES:
        reports.append(run_kernel(name, shape, preset=spec, safety_checks=False))
    return time.perf_counter() - t0, time.process_time() - c0, reports


def _model_step(spec: Any) -> tuple[float, float]:
    """Wall and CPU seconds of ``time_model`` on the gpt-oss-120b decode step (a fresh timer)."""
    cfg = load_model_config("gpt-oss-120b")
    t0, c0 = time.perf_counter(), time.process_time()
    time_model(cfg, Step("decode", 64, context=8192), spec, fusion="none")
    return time.perf_counter() - t0, time.process_time() - c0


def _parts(spec: Any) -> list[dict[str, float]]:
    """Per launch: build and timing CPU seconds, instructions, and the Instruction-creation floor."""
    out = []
    for name, shape in LAUNCHES:
        kdef = get_kernel(name)
        full = kdef.shape(shape)
        t0 = time.process_time()
        program = kdef.build(full, spec).program
        t1 = time.process_time()
        run_timing(program, spec).summary()
        t2 = time.process_time()
        fields = [(i.mnemonic, i.engine, i.args, i.source) for i in program.instructions]
        t3 = time.process_time()
        copies = [Instruction(m, e, a, s) for m, e, a, s in fields]
        floor_s = time.process_time() - t3
        out.append({"build_s": t1 - t0, "timing_s": t2 - t1, "instructions": len(copies),
                    "floor_s": floor_s})
    return out


def _best(runs: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    return [{k: min(r[i][k] for r in runs) for k in runs[0][i]} for i in range(len(runs[0]))]


def main() -> None:
    """Time the step with the collector running and paused; print per-kernel figures and totals."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    spec = load_preset("jalapeno-v1")
    _model_step(spec)  # warm-up: imports, caches

    results: dict[str, Any] = {}
    for mode in ("gc running", "gc paused"):
        steps, cpus, models, parts = [], [], [], []
        for _ in range(args.repeats):
            for measure in (_model_step, _step, _parts):
                gc.collect()
                if mode == "gc paused":
                    gc.disable()
                try:
                    out = measure(spec)
                finally:
                    gc.enable()
                if measure is _model_step:
                    models.append(out)
                elif measure is _step:
                    steps.append(out[0])
                    cpus.append(out[1])
                else:
                    parts.append(out)
                del out
        best = _best(parts)
        results[mode] = {
            "model_step_s": min(m[0] for m in models), "model_step_cpu_s": min(m[1] for m in models),
            "launches_s": min(steps), "launches_cpu_s": min(cpus),
            "kernels": {_label(n, s): p for (n, s), p in zip(LAUNCHES, best, strict=True)}}

    for mode, r in results.items():
        print(f"--- {mode}: gpt-oss-120b decode step (time_model) {r['model_step_s']:.2f} s wall, "
              f"{r['model_step_cpu_s']:.2f} s CPU (goal {GOAL_S:.1f} s wall); the launches below "
              f"{r['launches_s']:.2f} s wall, {r['launches_cpu_s']:.2f} s CPU")
        tot = dict.fromkeys(("build_s", "timing_s", "instructions", "floor_s"), 0.0)
        for label, p in r["kernels"].items():
            for k in tot:
                tot[k] += p[k]
            print(f"{label:32s} {p['instructions']:7.0f} instr | build {p['build_s']:6.3f} s "
                  f"({p['instructions'] / p['build_s'] / 1e3:5.0f}k/s, {p['build_s'] / p['floor_s']:4.1f}x "
                  f"floor {p['floor_s']:.3f} s) | timing {p['timing_s']:6.3f} s "
                  f"({p['instructions'] / p['timing_s'] / 1e3:5.0f}k/s)")
        print(f"{'total':32s} {tot['instructions']:7.0f} instr | build {tot['build_s']:6.3f} s "
              f"({tot['build_s'] / tot['floor_s']:4.1f}x floor {tot['floor_s']:.3f} s) | timing "
              f"{tot['timing_s']:6.3f} s")
        r["totals"] = tot
    env = {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
           "numpy": np.__version__}
    if args.json:
        write_json(args.json, {"results": results, "goal_s": GOAL_S, "env": env})


if __name__ == "__main__":
    main()
