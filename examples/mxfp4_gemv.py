"""MXFP4 weights times an MXFP8 activation, checked against float references.

The shape of a batch-1 decode step through one gpt-oss expert projection, scaled down:
quantise a BF16 weight to MXFP4 (gpt-oss's checkpoint format), an activation to MXFP8 (E4M3),
multiply them with the block-scaled matmul the emulated matrix unit implements, and see how far
the result is from the same product in float32 on the unquantised inputs.

Run: python examples/mxfp4_gemv.py [--k 2880] [--n 5760]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jalapeno_emu import mx


def main() -> None:
    """Quantise, multiply, compare, print."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=512, help="contraction length (multiple of 32)")
    ap.add_argument("--n", type=int, default=256, help="output features")
    args = ap.parse_args()

    kw, kx = jax.random.split(jax.random.key(0))
    w = (jax.random.normal(kw, (args.k, args.n)) * 0.02).astype(jnp.bfloat16)
    x = jax.random.normal(kx, (1, args.k)).astype(jnp.bfloat16)

    w_q = mx.quantize(w, "e2m1", axis=0)  # blocks of 32 along K, as the checkpoint stores them
    x_q = mx.quantize(x, "e4m3", axis=1)
    y = mx.matmul(x_q, w_q)

    exact_inputs = np.asarray(mx.dequantize(x_q), np.float64) @ np.asarray(mx.dequantize(w_q), np.float64)
    unquantised = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    print(f"weight: {w.size * 2 / 1e6:.2f} MB BF16 -> {w_q.packed_bytes / 1e6:.2f} MB MXFP4")
    s = mx.error_stats(y, exact_inputs)
    print("matmul vs float64 product of the same MX values (the FP32 accumulation's rounding):")
    print(f"   max rel {s.max_rel_error:.2e}, ULP distances {s.ulp_histogram}")
    print("matmul vs the unquantised BF16 product (quantisation error):")
    s = mx.error_stats(y, unquantised)
    print(f"   SNR {s.snr_db:.1f} dB, cosine {s.cosine_similarity:.5f}, max abs {s.max_abs_error:.3g}")


if __name__ == "__main__":
    main()
