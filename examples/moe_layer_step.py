"""One MoE layer step on the emulated die: route, gather only the chosen experts, combine.

The ``moe`` kernel (``jalapeno_emu.kernels.moe``) at a small gpt-oss-like shape: a BF16 router
with a bias, top-k and a softmax over the k selected logits, MXFP4 experts with gpt-oss's clamped
SwiGLU, MXFP8 activations. The script runs the program functionally, checks it against the
kernel's pure-JAX reference (bit for bit) and against the model's float64 definition, then
prints where it sits on the roofline: time, what bounds it, HBM bytes against the bytes of the
distinct experts the routing hit, utilisation. It writes the Perfetto trace.

``--hot N`` biases the router so every token picks among N experts and builds the program for
N expert slots: HBM bytes drop with the number of distinct experts, not the expert count.
``--full`` also times gpt-oss-120b's MoE at batch 1 on jalapeno-v1 (timing only, ~10 s).

Run: python examples/moe_layer_step.py [--tokens 4] [--experts 8] [--top-k 2] [--hot 2] [--full]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.kernels import get_kernel, run_kernel


def _roofline(name: str, summary: dict, notes: dict) -> str:
    s, n = summary, notes
    moved = n["routed_expert_bytes"] + n["shared_expert_bytes"]
    return (f"{name}: {s['time_s'] * 1e6:.1f} us (roofline lower bound {s['lower_bound_s'] * 1e6:.2f} us), "
            f"bound: {s['bound']}\n"
            f"   HBM {s['hbm_bytes'] / 1e6:.3f} MB = {n['distinct_experts']} expert slots x "
            f"{n['expert_bytes'] / 1e6:.3f} MB ({moved / 1e6:.3f} MB of experts) + activations/router; "
            f"HBM utilisation {s['hbm_utilization']:.1%}, matrix unit {s['mxu_utilization']:.2%}")


def main() -> None:
    """Build, check, time, trace."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hot", type=int, default=0, help="route every token among this many experts")
    ap.add_argument("--full", action="store_true", help="also time gpt-oss-120b's MoE at batch 1")
    ap.add_argument("--trace-dir", default=None)
    args = ap.parse_args()

    kdef, spec = get_kernel("moe"), load_preset("tiny")
    shape = kdef.shape({"tokens": args.tokens, "experts": args.experts, "top_k": args.top_k,
                        "distinct_experts": args.hot})
    build = kdef.build(shape, spec)
    check_program(build.program, spec)
    inputs = build.make_inputs(0)
    if args.hot:  # a router bias of +30 on experts 0..hot-1 wins every token's top-k
        bias = np.zeros((1, args.experts), np.float32)
        bias[0, :args.hot] = 30.0
        inputs["router_bias"] = bias.astype(inputs["router_bias"].dtype)
    got = run_functional(build.program, inputs).read("y")
    want = build.reference(inputs)["y"]
    exact = np.array_equal(got.view(np.uint16), want.view(np.uint16))
    timeline = run_timing(build.program, spec)
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="jalapeno-moe-")
    trace = os.path.join(trace_dir, f"{build.program.name}.json")
    timeline.write_chrome_trace(trace)
    print(f"MoE layer step, {args.tokens} tokens, top-{args.top_k} of {args.experts} experts, "
          f"{len(build.program.instructions)} instructions on {build.notes['cores']} cores of {spec.name}")
    print(f"   bit-exact vs the pure-JAX reference: {exact}")
    print(_roofline("   tiny", timeline.summary(), build.notes))
    print(f"   trace: {trace}")
    if not exact:
        raise SystemExit("functional result differs from the reference")
    if args.full:
        r = run_kernel("moe", {"tokens": 1, "hidden": 2880, "intermediate": 2880, "experts": 128,
                               "top_k": 4}, preset="jalapeno-v1")
        print(_roofline("gpt-oss-120b MoE, batch 1, jalapeno-v1", r.summary, r.notes))


if __name__ == "__main__":
    main()
