"""Speed of the serving simulator: sweep points per second, against the cost of the step model alone.

Workload: ISL/OSL 8192/1024 (the InferenceX headline), concurrency 1, 2, 4, ... 1024, default
measured requests (max(64, 2 x concurrency), capped at 2048). Step model: a synthetic roofline
(``RooflineStepModel``) on one jalapeno-v1 chip: its FLOP/s and achievable HBM bytes/s come from the
chip spec; the model sizes are gpt-oss-120b-sized round numbers (65.1 GB of weights read every step,
10.2 GFLOP per token, 294,912 FLOP per (query, key) pair, 36,864 KV bytes per token); KV capacity is
the HBM left after the weights. The metrics are illustrative of the simulator, not predictions
for gpt-oss-120b (real step times come from the emulator's timing pass).

Three ways to run the same sweep:

- ``stretch hook``: the model prices decode-only stretches in one vectorised call;
- ``step by step``: the hook hidden, every step priced by ``step_time_s``;
- ``5 us model``: step by step with a model that busy-waits to cost 5 us per call (the goal: the
  concurrency-1024 point well under a second).

Baseline, measured in the same run: the step-model calls alone, replaying every StepWork the
step-by-step sweep asked for. The simulator's own overhead is the difference.
Run: ``python benchmarks/bench_serving.py [--json out.json] [--max-concurrency 1024]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass

import numpy as np
from _common import write_json

from jalapeno_emu.chip import load_preset
from jalapeno_emu.serving import RooflineStepModel, StepWork, power_w_from_spec, simulate

ISL, OSL = 8192, 1024
WEIGHT_BYTES = 65.1e9
KV_BYTES_PER_TOKEN = 36_864
FLOPS_PER_TOKEN = 10.2e9
ATTENTION_FLOPS_PER_PAIR = 294_912
MAX_BATCH_TOKENS = 8192
SLOW_CALL_S = 5e-6


def chip_model(preset: str = "jalapeno-v1") -> RooflineStepModel:
    """The synthetic roofline on one chip of ``preset`` (rates and HBM capacity from the spec)."""
    derived = load_preset(preset).derived()
    kv_tokens = int((derived["hbm_capacity_bytes"] - WEIGHT_BYTES) // KV_BYTES_PER_TOKEN)
    return RooflineStepModel(
        name=f"{preset} x1 (synthetic roofline)", chips=1, kv_capacity_tokens=kv_tokens,
        max_batch_tokens=MAX_BATCH_TOKENS, flops_per_s=derived["peak_mxfp4_flops_per_s"],
        bytes_per_s=derived["hbm_achievable_bytes_per_s"], weight_bytes=WEIGHT_BYTES,
        flops_per_token=FLOPS_PER_TOKEN, kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        attention_flops_per_pair=ATTENTION_FLOPS_PER_PAIR)


@dataclass
class Stepwise:
    """The model without its stretch hook; optionally records the works or busy-waits per call."""

    inner: RooflineStepModel
    record: list | None = None
    call_cost_s: float = 0.0

    def __post_init__(self) -> None:
        inner = self.inner
        self.name, self.chips = inner.name, inner.chips
        self.kv_capacity_tokens, self.max_batch_tokens = inner.kv_capacity_tokens, inner.max_batch_tokens

    def step_time_s(self, work: StepWork) -> float:
        if self.record is not None:
            self.record.append(work)
        if self.call_cost_s:
            until = time.perf_counter() + self.call_cost_s
            while time.perf_counter() < until:
                pass
        return self.inner.step_time_s(work)


def timed_sweep(model, concurrencies: list[int], power: dict) -> tuple[float, list[float], list]:
    """Total seconds, seconds per point and the metrics of a sweep run in this process."""
    per_point, metrics = [], []
    for c in concurrencies:
        t0 = time.perf_counter()
        metrics.append(simulate(model, isl=ISL, osl=OSL, concurrency=c, power_w=power))
        per_point.append(time.perf_counter() - t0)
    return sum(per_point), per_point, metrics


def replay_s(model: RooflineStepModel, works: list[StepWork]) -> float:
    """Seconds to call ``model.step_time_s`` on every recorded work (the baseline)."""
    t0 = time.perf_counter()
    for work in works:
        model.step_time_s(work)
    return time.perf_counter() - t0


def print_metrics(concurrencies: list[int], metrics: list) -> None:
    print(f"{'conc':>5} {'TTFT med s':>10} {'TPOT med ms':>11} {'tok/s/user':>10} {'tok/s/chip':>11} "
          f"{'tok/s/kW all-in':>15} {'dec batch':>9} {'KV-bound':>8} {'steps':>7}")
    for c, m in zip(concurrencies, metrics, strict=True):
        print(f"{c:>5} {m.ttft_s.median:>10.3f} {1e3 * m.tpot_s.median:>11.2f} "
              f"{m.interactivity_tok_s_user:>10.1f} {m.throughput_tok_s_per_chip:>11.0f} "
              f"{m.tok_s_per_kw['all_in']:>15.0f} {m.mean_decode_batch:>9.1f} "
              f"{m.kv_bound_step_share:>8.2f} {m.total_steps:>7}")


def main() -> None:
    """Run the three sweeps and the baseline, print the figures (and JSON with --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-concurrency", type=int, default=1024)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    concurrencies = [2**i for i in range(args.max_concurrency.bit_length()) if 2**i <= args.max_concurrency]
    spec_model = chip_model()
    power = power_w_from_spec(load_preset("jalapeno-v1"))

    simulate(spec_model, isl=ISL, osl=OSL, concurrency=4, requests=8, power_w=power)  # warm-up imports
    hook_s, hook_pts, metrics = timed_sweep(spec_model, concurrencies, power)
    works: list[StepWork] = []
    step_s, step_pts, step_metrics = timed_sweep(Stepwise(spec_model, works), concurrencies, power)
    assert [m.as_dict() for m in step_metrics] == [m.as_dict() for m in metrics]  # the hook is exact
    base_s = replay_s(spec_model, works)
    top = concurrencies[-1]
    slow = Stepwise(spec_model, call_cost_s=SLOW_CALL_S)
    t0 = time.perf_counter()
    simulate(slow, isl=ISL, osl=OSL, concurrency=top, power_w=power)
    slow_top_s = time.perf_counter() - t0
    top_works = sum(m.total_steps for m in step_metrics[-1:])

    print_metrics(concurrencies, metrics)
    print()
    n = len(concurrencies)
    print(f"sweep of {n} points, stretch hook: {hook_s:7.3f} s  ({n / hook_s:7.1f} points/s)")
    print(f"sweep of {n} points, step by step: {step_s:7.3f} s  ({n / step_s:7.1f} points/s)")
    print(f"  baseline, the {len(works)} step_time_s calls alone: {base_s:7.3f} s "
          f"({1e6 * base_s / len(works):.2f} us/call); simulator overhead "
          f"{1e6 * (step_s - base_s) / len(works):.2f} us/step")
    print(f"concurrency {top} with a {1e6 * SLOW_CALL_S:.0f} us/call model ({top_works} steps): "
          f"{slow_top_s:.3f} s")
    pairs = zip(concurrencies, hook_pts, step_pts, strict=True)
    print("per point, s (hook / step by step): " + ", ".join(f"{c}: {a:.3f}/{b:.3f}" for c, a, b in pairs))
    if args.json:
        env = {"cpus": os.cpu_count(), "machine": platform.machine(), "numpy": np.__version__}
        write_json(args.json, {
            "workload": {"isl": ISL, "osl": OSL, "concurrencies": concurrencies, "model": spec_model.name},
            "sweep_s": {"stretch_hook": hook_s, "step_by_step": step_s, "step_model_calls_alone": base_s},
            "points_per_s": {"stretch_hook": n / hook_s, "step_by_step": n / step_s},
            "step_calls": len(works), f"concurrency_{top}_with_5us_model_s": slow_top_s,
            "per_point_s": {"stretch_hook": hook_pts, "step_by_step": step_pts},
            "points": [m.as_dict() for m in metrics], "env": env})


if __name__ == "__main__":
    main()
