"""``jalapeno-emu bench hbm|mxu [--preset P] [--set k=v ...] [--json]``: the chip's headline rates.

Each builds a microbenchmark program (``jalapeno_emu.emu.microbench``), times it with the timing
pass and compares the achieved rate with the preset's peak:

- ``hbm``: a streaming read from HBM into SRAM over every core and DMA queue (4 GiB on
  jalapeno-v1, at most half the HBM on smaller presets): achieved B/s, peak B/s, utilization
  (achieved / peak) and achieved / (peak x efficiency).
- ``mxu``: an MXFP4 GEMM's matmul instructions on every core with operands resident in SRAM:
  achieved FLOP/s, peak MXFP4 FLOP/s and utilization.

``--set`` applies overrides first (``--set hbm.efficiency=0.8``), so what-if questions are one flag.
"""

from __future__ import annotations

import argparse

from rich.table import Table

from jalapeno_emu.chip import (
    ChipSpec,
    apply_overrides,
    format_quantity,
    list_presets,
    load_preset,
    parse_quantity,
)
from jalapeno_emu.cli.app import Abort, App
from jalapeno_emu.cli.options import add_key_value_option

DEFAULT_PRESET = "jalapeno-v1"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``bench`` command group: ``bench hbm`` and ``bench mxu``."""
    p = sub.add_parser("bench", help="time microbenchmarks: HBM bandwidth, matrix-unit FLOP/s")
    bench_sub = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)
    hbm = bench_sub.add_parser("hbm", help="stream from HBM over all cores: achieved vs peak B/s")
    hbm.add_argument("--bytes", dest="total", default=None, metavar="SIZE",
                     help="bytes to stream, e.g. 1GiB (default: 4 GiB, at most half the HBM)")
    mxu = bench_sub.add_parser("mxu", help="an MXFP4 GEMM on every core: achieved vs peak FLOP/s")
    mxu.add_argument("--shape", default="8192x8192x8192", metavar="MxNxK",
                     help="GEMM shape (default 8192x8192x8192)")
    for cmd, run in ((hbm, run_hbm), (mxu, run_mxu)):
        cmd.add_argument("--preset", default=DEFAULT_PRESET,
                         help=f"shipped preset ({', '.join(list_presets())}) or a path to a TOML "
                              f"preset (default {DEFAULT_PRESET})")
        add_key_value_option(cmd, "--set", dest="overrides", what="override chip fields",
                             examples=("hbm.efficiency=0.85", "core.count=4"))
        cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
        cmd.set_defaults(run=run)


def _spec(args: argparse.Namespace) -> ChipSpec:
    return apply_overrides(load_preset(args.preset), args.overrides)


def _report(app: App, command: str, args: argparse.Namespace, spec: ChipSpec, rows: list[tuple],
            payload: dict) -> int:
    """Print the JSON document or a table of (label, value, unit) rows."""
    if app.json_output:
        app.emit_json(command, {"preset": args.preset, "chip": spec.name,
                                "overrides": list(args.overrides), **payload})
        return 0
    table = Table(title=f"{command} on {spec.name}" + (f" ({', '.join(args.overrides)})"
                                                        if args.overrides else ""), title_justify="left")
    table.add_column("quantity", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    for label, value, unit in rows:
        text = f"{100 * value:.1f} %" if unit == "%" else format_quantity(value, unit)
        table.add_row(label, text)
    app.console.print(table)
    app.console.print(f"bound: {payload['bound']}")
    return 0


def run_hbm(app: App, args: argparse.Namespace) -> int:
    """Stream from HBM on every core and DMA queue; report achieved and peak bandwidth."""
    spec = _spec(args)
    from jalapeno_emu.emu import microbench, run_timing  # the builder loads JAX (via mx): only here

    total = microbench.default_stream_bytes(spec)
    if args.total is not None:
        try:
            total = int(parse_quantity(args.total, "B", what="--bytes"))
        except ValueError as exc:
            raise Abort(str(exc)) from None
    queues = spec.core.count * spec.dma.queues_per_core
    chunk = min(256 * 1024, spec.sram.scratchpad_bytes // spec.dma.queues_per_core)
    if total <= 0 or total % chunk or total > spec.hbm.capacity_bytes:
        raise Abort(f"--bytes must be a positive multiple of {chunk} B (one descriptor) and fit "
                    f"{spec.name}'s {format_quantity(spec.hbm.capacity_bytes, 'B')} of HBM, "
                    f"found {args.total}")
    app.status(f"timing a {format_quantity(total, 'B')} stream over {queues} DMA queues")
    tl = run_timing(microbench.hbm_stream_program(spec, total, chunk_bytes=chunk), spec)
    s = tl.summary()
    d = spec.derived()
    peak, achievable = d["hbm_bytes_per_s"], d["hbm_achievable_bytes_per_s"]
    achieved = s["hbm_bytes_per_s"]
    payload = {
        "bytes": s["hbm_bytes"], "time_s": s["time_s"], "launch_s": s["launch_s"],
        "achieved": achieved, "peak": peak, "utilization": achieved / peak,
        "achievable": achievable, "utilization_of_achievable": achieved / achievable,
        "efficiency": spec.hbm.efficiency, "descriptors": s["instructions"], "dma_queues": queues,
        "channel_utilization": s["channel_utilization"], "bound": s["bound"], "unit": "B/s",
    }
    rows = [("bytes streamed", total, "B"), ("time (launch included)", s["time_s"], "s"),
            ("achieved", achieved, "B/s"), ("peak", peak, "B/s"),
            ("achievable (peak x efficiency)", achievable, "B/s"),
            ("utilization (of peak)", achieved / peak, "%"),
            ("utilization (of achievable)", achieved / achievable, "%")]
    return _report(app, "bench hbm", args, spec, rows, payload)


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise Abort(f"--shape must look like MxNxK, e.g. 8192x8192x8192, found {text!r}") from None
    return m, n, k


def run_mxu(app: App, args: argparse.Namespace) -> int:
    """Run an MXFP4 GEMM's matmuls on every core; report achieved and peak FLOP/s."""
    spec = _spec(args)
    m, n, k = _shape(args.shape)
    app.status(f"timing a {m}x{n}x{k} MXFP4 GEMM on {spec.core.count} cores")
    from jalapeno_emu.emu import microbench, run_timing

    tl = run_timing(microbench.mxu_program(spec, m, n, k), spec)
    s = tl.summary()
    peak = spec.derived()["peak_mxfp4_flops_per_s"]
    payload = {
        "shape": [m, n, k], "flops": s["flops"], "time_s": s["time_s"], "launch_s": s["launch_s"],
        "achieved": s["flops_per_s"], "peak": peak, "utilization": s["flops_per_s"] / peak,
        "matmuls": s["instructions"], "bound": s["bound"], "unit": "FLOP/s",
    }
    rows = [("FLOPs", s["flops"], "FLOP"), ("time (launch included)", s["time_s"], "s"),
            ("achieved", s["flops_per_s"], "FLOP/s"), ("peak MXFP4", peak, "FLOP/s"),
            ("utilization", s["flops_per_s"] / peak, "%")]
    return _report(app, "bench mxu", args, spec, rows, payload)
