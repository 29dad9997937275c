"""Speed of the MX numerics against plain baselines measured in the same run.

- MXFP4 quantise and dequantise of a 4096 x 4096 float32 matrix, against
  ``np.asarray(x).astype(ml_dtypes.float4_e2m1fn)`` (an element cast with no scale computation).
- ``mx.matmul`` 2048 x 2048 x 2048 (MXFP4 x MXFP4), against a float32 ``jnp.matmul``.

Goals (issue 2): quantise within 2x of the cast, matmul within 4x of the float32 matmul.
Run: ``python benchmarks/bench_mx.py [--json out.json]``. Times are the best of several runs
after a warm-up (compilation excluded, reported separately).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from _common import best_time_s, write_json

from jalapeno_emu import mx


def first_call_s(fn) -> float:
    """Wall time of the first call, compilation included."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def main() -> None:
    """Run the benchmarks and print ratios (and write JSON with --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096, help="quantise/dequantise matrix side")
    ap.add_argument("--mm", type=int, default=2048, help="matmul M = N = K")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((args.size, args.size)).astype(np.float32)
    x = jnp.asarray(x_np)
    results: dict[str, float] = {}

    results["cast_ml_dtypes_s"] = best_time_s(
        lambda: np.asarray(x_np).astype(ml_dtypes.float4_e2m1fn), args.repeats)
    results["quantize_compile_s"] = first_call_s(lambda: mx.quantize(x).codes)
    results["quantize_s"] = best_time_s(lambda: mx.quantize(x).codes, args.repeats)
    q = mx.quantize(x)
    results["dequantize_compile_s"] = first_call_s(lambda: mx.dequantize(q))
    results["dequantize_s"] = best_time_s(lambda: mx.dequantize(q), args.repeats)

    n = args.mm
    a_f = jnp.asarray(rng.standard_normal((n, n)).astype(np.float32))
    b_f = jnp.asarray(rng.standard_normal((n, n)).astype(np.float32))
    f32mm = jax.jit(jnp.matmul)
    results["matmul_f32_s"] = best_time_s(lambda: f32mm(a_f, b_f), args.repeats)
    a_q, b_q = mx.quantize(a_f, axis=1), mx.quantize(b_f, axis=0)
    results["matmul_mx_compile_s"] = first_call_s(lambda: mx.matmul(a_q, b_q))
    results["matmul_mx_s"] = best_time_s(lambda: mx.matmul(a_q, b_q), args.repeats)

    ratios = {
        "quantize_vs_cast": results["quantize_s"] / results["cast_ml_dtypes_s"],
        "dequantize_vs_cast": results["dequantize_s"] / results["cast_ml_dtypes_s"],
        "matmul_vs_f32_matmul": results["matmul_mx_s"] / results["matmul_f32_s"],
    }
    env = {"cpus": os.cpu_count(), "machine": platform.machine(), "jax": jax.__version__,
           "ml_dtypes": ml_dtypes.__version__, "numpy": np.__version__}
    for k, v in results.items():
        print(f"{k:>24}: {1e3 * v:9.1f} ms")
    for k, v in ratios.items():
        print(f"{k:>24}: {v:9.2f} x")
    if args.json:
        write_json(args.json, {"results_s": results, "ratios": ratios, "env": env})


if __name__ == "__main__":
    main()
