"""Speed of building Programs, and a digest of each one so that speed-ups provably change nothing.

Builds a representative set of Programs:

- every registered kernel at its default shape, on ``tiny`` and on ``jalapeno-v1``;
- the launches of a gpt-oss-120b decode step at batch 64 on ``jalapeno-v1`` (the full-size
  shapes of ``bench_layer_timing.py``);
- the fused window programs that ``jalapeno-emu model`` builds for a decode step at batch 64
  (context 8192) of gpt-oss-120b: the first window (head and
  the warm-up layers) and the last one (two layers and the tail); ``--set full`` adds the last
  windows of a DeepSeek-R1 decode step at batch 8 and of a gpt-oss-120b prefill of 2,048 tokens.

For each it records the build time (CPU), the instruction count, a sha256 digest of the Program
(name, preset, every instruction's mnemonic, engine, operands and source, every allocation,
semaphore, in order; see ``program_digest``), one of the builder's tensors and regions
(``meta_digest``) and the timing pass's ``summary()`` (its ``time_s`` and a digest of the whole summary).

Run: ``python benchmarks/bench_build.py [--set quick|default|full] [--repeats N]
[--write digests.json | --check digests.json] [--json out.json]``. ``--check`` fails (exit 1),
naming each program whose digest or timing differs from the file written by ``--write`` before
a change. Build times are the best of ``repeats`` CPU times with the cyclic collector paused (as
the model runner builds).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from jalapeno_emu.isa.program import Program, Tile

Builder = Callable[[], Program]


def _value(v: Any) -> str:
    if type(v) is Tile:
        return (f"T({v.space.value},{v.core},{v.offset},{v.dtype},{v.rows},{v.cols},{v.stride})")
    return f"{type(v).__name__}:{v!r}"


def program_digest(program: Program) -> str:
    """sha256 over a canonical text of ``program`` that does not depend on how its classes are
    implemented (tiles as their fields, other operands as type and repr)."""
    h = hashlib.sha256()
    h.update(f"{program.name}|{program.preset}\n".encode())
    lines = []
    for ins in program.instructions:
        e = ins.engine
        ops = ",".join(f"{k}={_value(v)}" for k, v in ins.args)
        lines.append(f"{ins.mnemonic}|{e.core}.{e.unit}.{e.queue}|{ops}|{ins.source}\n")
        if len(lines) >= 4096:
            h.update("".join(lines).encode())
            lines.clear()
    h.update("".join(lines).encode())
    for a in program.allocations:
        h.update(f"A|{a.name}|{a.space.value}|{a.core}|{a.offset}|{a.nbytes}\n".encode())
    for s in program.semaphores:
        h.update(f"S|{s[0]}|{s[1]}\n".encode())
    for i in program.inits:
        h.update(f"I|{i!r}\n".encode())
    return h.hexdigest()


def meta_digest(program: Program) -> str:
    """sha256 of what the builder recorded beside the instructions (``Program.meta``: tensors,
    regions, ...), kept apart from ``program_digest`` as its keys may grow."""
    return hashlib.sha256(repr(program.meta).encode()).hexdigest()


def summary_digest(summary: dict[str, Any]) -> str:
    """sha256 of the timing summary as JSON (floats written exactly by repr)."""
    return hashlib.sha256(json.dumps(summary, sort_keys=True, default=repr).encode()).hexdigest()


def programs(which: str) -> Iterator[tuple[str, str, Builder]]:
    """(label, preset, builder) for the set ``which`` ("quick", "default" or "full")."""
    from jalapeno_emu.chip import load_preset
    from jalapeno_emu.kernels.registry import all_kernels, get_kernel

    presets = ("tiny",) if which == "quick" else ("tiny", "jalapeno-v1")
    for preset in presets:
        spec = load_preset(preset)
        for kdef in all_kernels():
            yield (f"{kdef.name}@{preset}", preset,
                   lambda kdef=kdef, spec=spec: kdef.build(kdef.shape({}), spec).program)
    if which == "quick":
        return
    sys.path.insert(0, __file__.rpartition("/")[0])
    from bench_layer_timing import LAUNCHES, _label

    spec = load_preset("jalapeno-v1")
    for name, shape in LAUNCHES:
        kdef = get_kernel(name)
        yield (f"{_label(name, shape)}@jalapeno-v1 (b64)", "jalapeno-v1",
               lambda kdef=kdef, shape=shape: kdef.build(kdef.shape(shape), spec).program)
    from jalapeno_emu.model.plan import Step

    yield from _windows("gpt-oss-120b", Step("decode", 64, context=8192), "decode b64", spec)
    if which == "full":
        yield from _windows("deepseek-r1", Step("decode", 8, context=8192), "decode b8", spec, first=False)
        yield from _windows("gpt-oss-120b", Step("prefill", 1, seq=2048), "prefill 2048", spec, first=False)


def _windows(model: str, step: Any, what: str, spec: Any, *, first: bool = True
             ) -> Iterator[tuple[str, str, Builder]]:
    """The window programs ``fused_model_timing`` builds for ``step``: the first (head and
    warm-up layers; unless ``first`` is False) and the last (two layers and the tail)."""
    from jalapeno_emu.model.config import load_model_config
    from jalapeno_emu.model.fused import build_fused, layer_windows
    from jalapeno_emu.model.plan import layer_launches

    cfg = load_model_config(model)
    n = cfg.layers
    warm, period = layer_windows([layer_launches(cfg, i, step) for i in range(n)])
    w = min(n, warm + 2 * period)
    if first:
        yield (f"{model} {what} L0-{w - 1}+head", spec.name,
               lambda: build_fused(cfg, step, spec, layers=range(w), head=True, tail=False,
                                   name=f"{cfg.name}_{step.phase}_L0-{w - 1}").program)
    yield (f"{model} {what} L{n - 2}-{n - 1}+tail", spec.name,
           lambda: build_fused(cfg, step, spec, layers=range(n - 2, n), head=False, tail=True,
                               name=f"{cfg.name}_{step.phase}_L{n - 2}-{n - 1}").program)


def measure(which: str, repeats: int) -> dict[str, dict[str, Any]]:
    """Per program: build CPU seconds (best of ``repeats``), instructions, digests, time_s."""
    from jalapeno_emu.chip import load_preset
    from jalapeno_emu.emu.timing import run_timing

    out: dict[str, dict[str, Any]] = {}
    for label, preset, build in programs(which):
        best = float("inf")
        program = None
        for _ in range(repeats):
            program = None
            gc.collect()
            gc.disable()
            try:
                t0 = time.process_time()
                program = build()
                best = min(best, time.process_time() - t0)
            finally:
                gc.enable()
        assert program is not None
        gc.disable()
        try:
            t0 = time.process_time()
            summary = run_timing(program, load_preset(preset)).summary()
            timing_s = time.process_time() - t0
        finally:
            gc.enable()
        out[label] = {"instructions": len(program.instructions), "build_cpu_s": best,
                      "timing_cpu_s": timing_s, "digest": program_digest(program),
                      "meta_digest": meta_digest(program),
                      "time_s": summary["time_s"], "summary_digest": summary_digest(summary)}
        n = len(program.instructions)
        print(f"{label:50s} {n:>9,} ins  build {best:8.3f} s ({n / max(best, 1e-9) / 1e3:7.1f} k ins/s)  "
              f"timing {timing_s:7.3f} s  {out[label]['digest'][:12]}  time_s={summary['time_s']!r}",
              flush=True)
    return out


def main() -> None:
    """Build the set, print per program, then write or check the digests."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=("quick", "default", "full"), default="default")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--write", help="write the digests and times here (before a change)")
    ap.add_argument("--check", help="compare the digests and times with this file (after a change)")
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args()
    t0, c0 = time.perf_counter(), time.process_time()
    results = measure(args.set, args.repeats)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = sum(r["instructions"] for r in results.values())
    build = sum(r["build_cpu_s"] for r in results.values())
    timing = sum(r["timing_cpu_s"] for r in results.values())
    print(f"total: {n:,} instructions, build {build:.2f} s CPU ({n / build / 1e3:.1f} k ins/s), "
          f"timing {timing:.2f} s CPU; whole script {wall:.1f} s wall, {cpu:.1f} s CPU")
    keys = ("digest", "meta_digest", "time_s", "summary_digest", "instructions")
    if args.write:
        with open(args.write, "w") as f:
            json.dump({k: {f: r[f] for f in keys} for k, r in results.items()}, f, indent=1)
    if args.json:
        from _common import write_json

        write_json(args.json, {"set": args.set, "results": results, "build_cpu_s": build,
                               "timing_cpu_s": timing, "instructions": n})
    if args.check:
        with open(args.check) as f:
            ref = json.load(f)
        bad = [f"{label}: {k} {ref[label][k]!r} -> {r[k]!r}" for label, r in results.items()
               if label in ref for k in keys if k in ref[label] and ref[label][k] != r[k]]
        missing = sorted(set(ref) - set(results))
        for line in bad:
            print("DIFFERS", line)
        print(f"check: {len(set(results) & set(ref))} programs compared, {len(bad)} differences"
              + (f", {len(missing)} in the file not built: {missing}" if missing else ""))
        if bad:
            sys.exit(1)


if __name__ == "__main__":
    main()
