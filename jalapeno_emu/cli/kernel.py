"""``jalapeno-emu kernel list`` and ``jalapeno-emu kernel NAME``: run a library kernel."""

from __future__ import annotations

import argparse

from rich.table import Table

from jalapeno_emu.chip import apply_overrides, load_preset
from jalapeno_emu.cli.app import App


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``kernel`` command."""
    p = sub.add_parser("kernel", help="list the kernel library, or check and time one kernel")
    p.add_argument("name", help="'list', or a kernel name (see `kernel list`)")
    p.add_argument("--preset", default="tiny", help="chip preset (default tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a chip spec field (repeatable)")
    p.add_argument("--shape", action="append", default=[], metavar="KEY=VALUE",
                   help="shape key (repeatable), e.g. --shape m=1 --shape k=2880")
    p.add_argument("--check", action="store_true",
                   help="also run functionally and compare with the pure-JAX reference")
    p.add_argument("--timing-only", action="store_true",
                   help="time only: no functional run and no race/uninitialised-read analysis "
                        "(legality, capacity and deadlocks are still checked); fast at full size")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace JSON here")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def run(app: App, args: argparse.Namespace) -> int:
    """List kernels, or run one."""
    from jalapeno_emu.kernels import all_kernels, get_kernel, run_kernel

    if args.name == "list":
        kernels = all_kernels()
        if app.json_output:
            app.emit_json("kernel list", {"kernels": [
                {"name": k.name, "doc": k.doc, "shape": k.defaults(),
                 "shape_keys": {s.name: s.doc for s in k.shape_keys}} for k in kernels]})
            return 0
        table = Table(title="kernel library")
        for col in ("kernel", "default shape", "what"):
            table.add_column(col)
        for k in kernels:
            table.add_row(k.name, " ".join(f"{n}={v}" for n, v in k.defaults().items()), k.doc)
        app.console.print(table)
        return 0
    kdef = get_kernel(args.name)
    spec = apply_overrides(load_preset(args.preset), args.overrides)
    shape = kdef.shape(texts=args.shape)
    app.status(f"{kdef.name} {shape} on {spec.name}")
    report = run_kernel(kdef.name, shape, preset=spec, check=args.check and not args.timing_only,
                        safety_checks=not args.timing_only)
    if args.trace:
        report.timeline.write_chrome_trace(args.trace)
    doc = report.as_dict()
    if app.json_output:
        app.emit_json(f"kernel {kdef.name}", doc)
    else:
        table = Table(title=f"{kdef.name} on {spec.name}: "
                            + " ".join(f"{k}={v}" for k, v in shape.items()))
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key in ("instructions", "time_s", "bound", "hbm_bytes", "hbm_utilization",
                    "hbm_utilization_of_achievable", "flops", "mxu_utilization", "lower_bound_s"):
            v = doc[key]
            table.add_row(key, f"{v:.4g}" if isinstance(v, float) else f"{v}")
        if report.check is not None:
            for key in ("max_abs_error", "max_rel_error", "passed"):
                table.add_row(key, f"{doc[key]:.3g}" if isinstance(doc[key], float) else str(doc[key]))
        app.console.print(table)
        if report.check is not None:
            app.console.print(f"tolerance: atol={doc['tolerance']['atol']:g} "
                              f"rtol={doc['tolerance']['rtol']:g} ({doc['tolerance']['why']})")
    if report.check is not None and not report.check["passed"]:
        return 1
    return 0
