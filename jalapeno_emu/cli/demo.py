"""``jalapeno-emu demo``: the whole stack on embedded defaults (on two CPU cores about two minutes
the first time, about one once compiled functions and kernel timings are cached).

1. A tiny gpt-oss (same structure as gpt-oss-120b, small dimensions, seeded weights) prefills a
   32-token prompt and generates tokens on the emulated Jalapeño die, every kernel launch run
   functionally; each step's time, bound and HBM utilisation come from the timing pass, and one
   decode step is broken down per layer.
2. The full-size gpt-oss-120b decode step (batch 1 and 64, context 8192), timing-only: per-layer
   latency, what bounds it, HBM bandwidth utilisation, weights and KV cache against HBM capacity.
3. The rack estimate: gpt-oss-120b served at 8k/1k, concurrency 1 and 64 (mapping searched).

``demo --numerics`` is the MX numerics demo: a synthetic gpt-oss-120b expert gate/up projection
(2880 x 5760, BF16, blocked along the 2880-long contraction axis) quantised under each scale rule,
with bytes, error statistics and time.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from rich.table import Table

from jalapeno_emu.cli.app import Abort, App

HIDDEN = 2880  # gpt-oss-120b hidden_size (https://huggingface.co/openai/gpt-oss-120b config.json)
GATE_UP = 5760  # 2 x intermediate_size 2880: gate and up projections fused, as in the checkpoint


def synthetic_expert_weight(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A BF16-valued float32 [rows, cols] matrix with the heavy tails of trained LLM weights.

    Student-t (4 degrees of freedom) entries scaled to std 0.02, plus a few outlier input channels
    10x larger, so block amax varies and the scale rules differ.
    """
    import jax.numpy as jnp  # here: `jalapeno-emu --help` and other commands need not load JAX

    rng = np.random.default_rng(seed)
    w = rng.standard_t(4, size=(rows, cols)).astype(np.float32) * np.float32(0.02 / np.sqrt(2.0))
    outliers = rng.choice(rows, size=max(1, rows // 256), replace=False)
    w[outliers] *= 10
    return np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` command."""
    p = sub.add_parser("demo", help="a tiny gpt-oss on the die, then the full-size gpt-oss-120b decode "
                       "step (--numerics: MXFP4 quantisation of a gpt-oss-sized expert weight)")
    p.add_argument("--numerics", action="store_true", help="the MX numerics demo instead")
    p.add_argument("--tokens", type=int, default=8, help="tokens the tiny model generates (default 8)")
    p.add_argument("--fmt", default="e2m1", help="--numerics: element format, in either spelling: "
                   "e2m1 or fp4 (MXFP4, the default), e2m3 or fp6e2, e3m2 or fp6e3, e4m3 or fp8e4, "
                   "e5m2 or fp8e5, int8")
    p.add_argument("--rows", type=int, default=HIDDEN, help="--numerics: contraction length (default 2880)")
    p.add_argument("--cols", type=int, default=GATE_UP, help="--numerics: output features (default 5760)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights")
    p.add_argument("--no-cache", action="store_true",
                   help="time the full-size steps afresh (neither read nor write the timing disk "
                        "cache, $JALAPENO_EMU_CACHE_DIR, default ~/.cache/jalapeno-emu)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def _timed(fn, repeats: int = 3) -> tuple[float, object]:
    """(best wall seconds over `repeats` after one warm-up call, result)."""
    import jax

    out = jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(app: App, args: argparse.Namespace) -> int:
    """The stack demo, or with ``--numerics`` the MX numerics demo."""
    if args.numerics:
        return run_numerics(app, args)
    from jalapeno_emu.cli.demo_model import run_model_demo

    return run_model_demo(app, args)


def run_numerics(app: App, args: argparse.Namespace) -> int:
    """Quantise the synthetic weight under each scale mode and report."""
    import jax.numpy as jnp

    from jalapeno_emu import mx

    if args.rows <= 0 or args.cols <= 0 or args.rows % 32:
        raise Abort(f"--rows must be a positive multiple of 32 and --cols positive "
                    f"(got {args.rows} x {args.cols})")
    fmt = mx.element_format(args.fmt, argname="--fmt")
    app.status(f"building a synthetic {args.rows} x {args.cols} expert weight (seed {args.seed})")
    w = synthetic_expert_weight(args.rows, args.cols, args.seed)
    x = jnp.asarray(w, jnp.bfloat16)
    bf16_bytes = w.size * 2
    rows = []
    for mode in mx.SCALE_MODES:
        app.status(f"quantising with scale_mode={mode}")
        q_s, q = _timed(lambda m=mode: mx.quantize(x, fmt.name, axis=0, scale_mode=m))
        dq_s, deq = _timed(lambda q=q: mx.dequantize(q))
        stats = mx.error_stats(np.asarray(deq), w, ulp_format="bfloat16")
        # Clipped: |x| beyond the largest value its block can represent (max_normal * scale).
        block_max = fmt.max_normal * np.exp2(np.repeat(np.asarray(q.scales, np.float64), 32, 0) - 127)
        saturated = int(np.count_nonzero(np.abs(w) > block_max))
        rows.append({
            "scale_mode": mode,
            "packed_bytes": q.packed_bytes,
            "compression_vs_bf16": bf16_bytes / q.packed_bytes,
            "rmse": stats.rmse,
            "snr_db": stats.snr_db,
            "max_abs_error": stats.max_abs_error,
            "cosine_similarity": stats.cosine_similarity,
            "saturated_fraction": saturated / w.size,
            "quantize_s": q_s,
            "dequantize_s": dq_s,
        })
    if app.json_output:
        app.emit_json("demo --numerics", {
            "matrix": {"rows": args.rows, "cols": args.cols, "dtype": "bfloat16",
                       "bytes": bf16_bytes, "seed": args.seed, "blocked_axis": 0},
            "fmt": fmt.name, "block_size": 32, "results": rows,
        })
        return 0
    table = Table(title=f"MX{fmt.name.upper()}: {args.rows} x {args.cols} BF16 weight, "
                        f"{bf16_bytes / 2**20:.1f} MiB -> {rows[0]['packed_bytes'] / 2**20:.2f} MiB "
                        f"({rows[0]['compression_vs_bf16']:.2f}x), blocks of 32 along K")
    for col in ("scale", "RMSE", "SNR dB", "cosine", "clipped %", "q ms", "dq ms"):
        table.add_column(col, justify="left" if col == "scale" else "right")
    for r in rows:
        table.add_row(
            r["scale_mode"], f"{r['rmse']:.3e}", f"{r['snr_db']:.2f}",
            f"{r['cosine_similarity']:.5f}", f"{100 * r['saturated_fraction']:.2f}",
            f"{1e3 * r['quantize_s']:.1f}", f"{1e3 * r['dequantize_s']:.1f}",
        )
    app.console.print(table)
    app.console.print(
        "floor = OCP MX v1.0 and microxcaling; even = torchao EVEN / AMD Quark; "
        "rceil = NVIDIA cvt.rp.satfinite.ue8m0 / torchao RCEIL; ceil never saturates."
    )
    return 0
