"""``jalapeno-emu run FILE``: check, execute and time an assembly (.jasm) or binary (.bin) program."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import numpy as np
from rich.table import Table

from jalapeno_emu.chip import apply_overrides, load_preset
from jalapeno_emu.cli.app import Abort, App, output_file
from jalapeno_emu.cli.human import metrics_table, trace_note, why_line
from jalapeno_emu.cli.options import add_key_value_option
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.files import check_output_paths, read_input_bytes
from jalapeno_emu.isa.asm import assemble
from jalapeno_emu.isa.encoding import decode_program
from jalapeno_emu.isa.program import Program
from jalapeno_emu.isa.table import Space


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``run`` command."""
    p = sub.add_parser("run", help="check, execute and time a program (.jasm or .bin)")
    p.add_argument("file", help="assembly text (.jasm) or binary (.bin) program")
    p.add_argument("--preset", default=None, help="chip preset (default: the program's .preset)")
    add_key_value_option(p, "--set", dest="overrides", what="override chip spec fields",
                         examples=("hbm.efficiency=0.85", "core.count=4"))
    p.add_argument("--trace", type=output_file, help="write a Chrome/Perfetto trace JSON here")
    p.add_argument("--timing-only", action="store_true", help="skip the functional pass")
    p.add_argument("--debug", action="store_true",
                   help="fill memory nothing wrote with NaN bytes (0xFF) in the functional pass")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def load_program(path_text: str) -> Program:
    """Read a program from .jasm text or .bin bytes, with one clear error for anything else."""
    path = Path(path_text)
    if path.is_dir():
        raise Abort(f"{path}: is a directory, expected a .jasm or .bin program")
    # A FIFO or a device is refused before it is opened (reading one could wait forever).
    data = read_input_bytes(path, what="program")
    if data[:4] == b"JEMU":
        return decode_program(data, source=path.name)
    if b"\0" in data:
        raise Abort(f"{path}: binary file without the JEMU header; expected .jasm text or a .bin "
                    "written by `jalapeno-emu asm`")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Abort(f"{path}: not UTF-8 text (byte {exc.start}); expected .jasm assembly") from None
    return assemble(text, source=path.name)


def run(app: App, args: argparse.Namespace) -> int:
    """Check, run functionally (unless --timing-only), time, and report."""
    check_output_paths([args.trace], inputs=[args.file])  # `--trace K.jasm` would replace the program
    program = load_program(args.file)
    spec = apply_overrides(load_preset(args.preset or program.preset), args.overrides)
    check_program(program, spec)
    functional = None
    if not args.timing_only:
        app.status(f"functional pass: {len(program.instructions)} instructions")
        from jalapeno_emu.emu.functional import run_functional  # loads JAX: only when it runs

        result = run_functional(program, debug=args.debug)
        functional = {}
        for a in program.allocations:
            if a.space is Space.HBM:
                raw = result.read_bytes(a.name, space="hbm")  # an sram buffer may share the name
                functional[a.name] = {
                    "bytes": int(raw.size),
                    "sha256": hashlib.sha256(raw.tobytes()).hexdigest()[:16],
                }
    app.status("timing pass")
    timeline = run_timing(program, spec)
    summary = timeline.summary()
    if args.trace:
        timeline.write_chrome_trace(args.trace)
    if app.json_output:
        app.emit_json("run", {"program": program.name, "preset": spec.name,
                              "instructions": len(program.instructions),
                              "timing": _jsonable(summary), "functional": functional,
                              "trace": args.trace})
    else:
        app.console.print(metrics_table(f"{program.name} on {spec.name}", summary))
        why = why_line(summary)
        if why is not None:
            app.console.print(why, markup=False, soft_wrap=True)
        if functional:
            ft = Table(title="HBM after the functional pass")
            for col in ("allocation", "bytes", "sha256 (first 16 hex)"):
                ft.add_column(col, justify="right" if col == "bytes" else "left")
            for name, info in functional.items():
                ft.add_row(name, f"{info['bytes']:,}", info["sha256"])
            app.console.print(ft)
    if args.trace:
        trace_note(app, args.trace)
    return 0


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value
