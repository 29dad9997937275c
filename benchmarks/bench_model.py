"""Model-level speed: timing-only decode step of a full-size model, functional tiny-model steps.

1. Timing-only: the decode step of all 36 gpt-oss-120b layers (plus embedding and logits) at
   batch 64, context 8192 on jalapeno-v1, each in a fresh process (no kernel built, nothing in
   memory, no disk cache): what ``jalapeno-emu model --model gpt-oss-120b --phase decode --batch
   64 --no-cache`` costs, with the launches back to back (``--fusion none``: 9 distinct launches,
   identical layers timed once) and as the preset's default fused step program (``step``: one
   program of every layer kind, built and timed whole). The wall time counts from the first call
   after the imports. Goal (issue 12, "Emulator speed"): at most 0.5 s; an earlier issue asked
   2 s for the launches.
2. Functional: one decode step of a tiny model on the die (every launch emulated) against one
   step of the pure-JAX reference forward pass with the whole step under one ``jax.jit``
   (``ReferenceModel(jit="step")``: every layer and the head in one compiled function, caches
   donated), both warm (compilation excluded), same weights and caches. That is the fastest
   honest baseline: the eager reference (``jit=False``, the numerics check) dispatches every
   operation on its own and is slower than the die, which made the ratio read 0.0x. Ratio = die
   step / reference step (> 1: the emulator's cost over the bare math). Goal (issue 5): at most 3x.

Run: python benchmarks/bench_model.py [--json out.json] [--model tiny-gpt-oss] [--repeats 3]
    [--fusion none|layer|step]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from _common import write_json

from jalapeno_emu.model import Step, load_model_config
from jalapeno_emu.model.die import DieModel
from jalapeno_emu.model.reference import ReferenceModel
from jalapeno_emu.model.timing import StepTimer, time_model
from jalapeno_emu.model.weights import init_weights


def timing_only(model: str, batch: int, context: int, fusion: str) -> dict:
    """Wall time of a whole decode step's timing in this process (cold when it is the first)."""
    cfg = load_model_config(model)
    t0 = time.perf_counter()
    timer = StepTimer("jalapeno-v1")
    report = time_model(cfg, Step("decode", batch=batch, context=context), timer=timer, fusion=fusion)
    wall = time.perf_counter() - t0
    return {"model": model, "batch": batch, "context": context, "fusion": fusion, "wall_s": wall,
            "distinct_launches": report.distinct_launches, "layers": cfg.layers,
            "step_time_s": report.totals["time_s"], "goal_s": 0.5}


def timing_only_cold(model: str, batch: int, context: int, fusion: str) -> dict:
    """:func:`timing_only` in a fresh Python process, so that nothing is built or loaded yet."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import bench_model; "
            "print(json.dumps(bench_model.timing_only(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), "
            "sys.argv[5])))")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), model, str(batch),
                          str(context), fusion], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def functional(model: str, repeats: int, fusion: str = "none", compile: str = "program") -> dict:
    """Warm decode-step wall time (s, best of ``repeats``) on the die against the whole-step
    jitted reference, same weights and cache capacity; ratio = die / reference.

    ``compile``: the die's policy for its launches' programs ("program": the recurring ones
    compiled whole from their second step, the steady state "auto" reaches on a long run;
    "instruction": every launch per instruction signature).
    """
    cfg = load_model_config(model)
    w = init_weights(cfg, 0)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab, (1, 32))
    total = 32 + 3 + repeats
    die = DieModel(cfg, w, batch=1, max_positions=total, fusion=fusion, compile=compile)
    ref = ReferenceModel(cfg, w, batch=1, max_positions=total, jit="step")
    die.forward(prompt)
    ref.forward(prompt)
    tok = np.zeros((1, 1), np.int64)
    for _ in range(2):  # the first decode steps compile what the prefill did not (the second: the
        die.forward(tok)  # launches that recur, each compiled whole)
        ref.forward(tok)
    die_s, die_run_s, ref_s = [], [], []
    # Each side's steps back to back: on 2 cores, die steps timed right after a reference step
    # (XLA's CPU threads still busy) read 98-101 ms where back to back they read 65 ms.
    for _ in range(repeats):
        t0 = time.perf_counter()
        step = die.forward(tok)
        die_s.append(time.perf_counter() - t0)
        die_run_s.append(step.wall_s)  # the launches' functional runs alone, without their timing
    for _ in range(repeats):
        t0 = time.perf_counter()
        ref.forward(tok)
        ref_s.append(time.perf_counter() - t0)
    d, r = min(die_s), min(ref_s)
    return {"model": model, "fusion": fusion, "die_step_s": d, "die_functional_only_s": min(die_run_s),
            "reference_step_s": r,
            "reference": "whole step under one jax.jit", "ratio": d / r, "goal_ratio": 3.0}


def main() -> None:
    """Run both measurements and print them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-gpt-oss", help="tiny model for the functional step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fusion", default="none", choices=("none", "layer", "step"),
                    help="the die's launch fusion for the functional step (default none)")
    ap.add_argument("--json")
    args = ap.parse_args()
    timings = {}
    for fusion in ("none", "step"):
        t = timings[fusion] = timing_only_cold("gpt-oss-120b", 64, 8192, fusion)
        what = (f"{t['distinct_launches']} distinct launches for {t['layers']} layers" if fusion == "none"
                else "the fused step program")
        print(f"timing-only gpt-oss-120b decode, batch 64, context 8192, fusion {fusion}, cold process: "
              f"{t['wall_s']:.2f} s wall ({what}; goal <= {t['goal_s']} s); step "
              f"{t['step_time_s'] * 1e3:.3f} ms on the die")
    f = functional(args.model, args.repeats, args.fusion)
    p = functional(args.model, args.repeats, args.fusion, compile="instruction")
    for label, r in (("recurring launches compiled whole", f), ("every launch per instruction", p)):
        print(f"functional {args.model} decode step (fusion {r['fusion']}, {label}): die "
              f"{r['die_step_s'] * 1e3:.1f} ms ({r['die_functional_only_s'] * 1e3:.1f} ms of it running "
              f"the launches), jitted reference step {r['reference_step_s'] * 1e3:.2f} ms, "
              f"ratio {r['ratio']:.1f}x (goal <= 3x)")
    print(f"compiling recurring launches whole: {p['die_step_s'] / f['die_step_s']:.2f}x faster steps")
    if args.json:
        write_json(args.json, {"timing_only": timings, "functional": f, "functional_per_instruction": p})


if __name__ == "__main__":
    main()
