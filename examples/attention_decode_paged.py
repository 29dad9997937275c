"""Decode attention over a paged KV cache: checked against its reference, placed on the roofline.

One new token per sequence attends to its cache, whose pages sit anywhere in HBM: a block table
[batch, context/page_size] names each sequence's physical pages, and the kernel fetches a tile of
pages with one ``dma.gather`` whose indices it loaded from that table (so the program is the same
whatever the table holds). Grouped-query attention loads each KV page once for all the query
heads of its KV head; gpt-oss's attention sinks and YaRN RoPE are on.

The default runs a small cache on the ``tiny`` chip in a few seconds, runs it functionally and
compares it with the pure-JAX reference (which reads the pages through the table on its own), then
prints where the kernel sits against its lower bound and writes a Perfetto trace. With
``--full`` it times gpt-oss-120b's full attention (batch 64, 8k context) on jalapeno-v1
(timing only: no data is allocated).

Run: python examples/attention_decode_paged.py [--batch 2 --context 512 --page-size 64]
     [--kv-dtype bf16|fp8e4] [--full] [--trace out.json]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.kernels import get_kernel, run_kernel


def _roofline(s: dict) -> str:
    return (f"time {s['time_s'] * 1e6:.1f} us vs lower bound {s['lower_bound_s'] * 1e6:.1f} us "
            f"({s['lower_bound_s'] / s['time_s']:.0%} of the roofline), bound: {s['bound']}, "
            f"HBM {s['hbm_bytes'] / 1e6:.2f} MB at {s['hbm_utilization']:.1%} of peak "
            f"({s['hbm_utilization_of_achievable']:.1%} of achievable), "
            f"matrix unit {s['mxu_utilization']:.2%}")


def main() -> None:
    """Check a small paged decode against the reference, print its roofline position, write a trace."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8e4"))
    ap.add_argument("--full", action="store_true", help="also time gpt-oss-120b at batch 64, 8k")
    ap.add_argument("--trace", default=None, help="Perfetto trace path (default: a temp file)")
    args = ap.parse_args()

    shape = {"batch": args.batch, "context": args.context, "page_size": args.page_size,
             "kv_dtype": args.kv_dtype, "q_heads": 8, "kv_heads": 2, "head_dim": 64, "sinks": True}
    r = run_kernel("attention-decode", shape, preset="tiny", check=True)
    c = r.check
    print(f"attention-decode, paged ({args.page_size}-token pages, {args.kv_dtype} KV), "
          f"batch {args.batch}, context {args.context}, GQA 8:2 on tiny: "
          f"{r.summary['instructions']} instructions, {r.notes['kv_tiles_per_unit']} KV tiles of "
          f"{r.notes['tile_keys']} keys per sequence and KV head")
    print(f"  vs reference: max abs error {c['max_abs_error']:.2e} (tolerance atol "
          f"{c['tolerance']['atol']}, rtol {c['tolerance']['rtol']:.4f}): "
          f"{'passed' if c['passed'] else 'FAILED'}")
    print(f"  {_roofline(r.summary)}")
    trace = args.trace or os.path.join(tempfile.mkdtemp(prefix="jalapeno-attn-"), "decode_paged.json")
    r.timeline.write_chrome_trace(trace)
    print(f"  trace: {trace}")

    if args.full:
        spec = load_preset("jalapeno-v1")
        kdef = get_kernel("attention-decode")
        full = kdef.shape({"batch": 64, "context": 8192, "q_heads": 64, "kv_heads": 8, "head_dim": 64,
                           "page_size": 128, "kv_dtype": args.kv_dtype})
        s = run_timing(kdef.build(full, spec).program, spec).summary()
        print(f"gpt-oss-120b full attention, batch 64, 8k context, 128-token pages on jalapeno-v1:"
              f"\n  {_roofline(s)}")
    if not c["passed"]:
        raise SystemExit("functional result differs from the reference")


if __name__ == "__main__":
    main()
