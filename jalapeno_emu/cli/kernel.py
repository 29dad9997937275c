"""``jalapeno-emu kernel list`` and ``jalapeno-emu kernel NAME``: run a library kernel."""

from __future__ import annotations

import argparse
from types import TracebackType

from rich.progress import Progress, TaskID
from rich.table import Table

from jalapeno_emu.chip import apply_overrides, load_preset
from jalapeno_emu.cli.app import App, output_file
from jalapeno_emu.cli.human import key_values, metrics_table, path_table, trace_note, us, why_line
from jalapeno_emu.cli.options import add_key_value_option

LONG_RUN_INSTRUCTIONS = 20_000
"""Above this many instructions, ``kernel NAME`` without ``--timing-only`` warns on stderr (one
line) and shows progress bars while the race and uninitialised-read analysis (and with
``--check`` the functional run) execute. Measured on two CPU cores, gemm on ``tiny``: at 22k
instructions (m=n=k=2048) the analysis takes about 1 s and the functional run about 5 s; at 212k
(m=n=k=4096) about 12 s and 45 s, where ``--timing-only`` takes about 8 s in all (building
4.6 s, timing 1 s). Below it a run takes seconds and needs neither."""

_STAGES = {"check": "race and uninitialised-read analysis", "functional": "functional run"}


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``kernel`` command."""
    p = sub.add_parser("kernel", help="list the kernel library, or check and time one kernel")
    p.add_argument("name", help="'list', or a kernel name (see `kernel list`)")
    p.add_argument("--preset", default="tiny", help="chip preset (default tiny)")
    add_key_value_option(p, "--set", dest="overrides", what="override chip spec fields",
                         examples=("core.count=4", "hbm.efficiency=0.85"))
    add_key_value_option(p, "--shape", dest="shape", what="set shape keys (see `kernel list`; formats "
                         "in either spelling, fp8e4 or e4m3)", examples=("m=1", "k=2880"))
    p.add_argument("--check", action="store_true",
                   help="also run functionally and compare with the pure-JAX reference")
    p.add_argument("--timing-only", action="store_true",
                   help="time only: no functional run and no race/uninitialised-read analysis "
                        "(legality, capacity and deadlocks are still checked); fast at full size")
    p.add_argument("--trace", type=output_file, help="write a Chrome/Perfetto trace JSON here")
    p.add_argument("--path", action="store_true",
                   help="also show the critical path: what waited on what, the µs each run of "
                        "instructions adds and the kernel line that issued it (JSON: critical_path)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def run(app: App, args: argparse.Namespace) -> int:
    """List kernels, or run one."""
    from jalapeno_emu.emu.progress import reporting_progress
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
    shape = kdef.shape(texts=args.shape, timing_only=args.timing_only)
    app.status(f"{kdef.name} {key_values(shape)} on {spec.name}")
    given = {text.partition("=")[0] for text in args.shape or ()}
    timed_default = {k: v for k, v in kdef.timing_defaults.items() if args.timing_only and k not in given}
    if timed_default:
        functional = " ".join(f"{k}={kdef.defaults()[k]}" for k in timed_default)
        app.status(f"timing-only default {key_values(timed_default)}: the expected case "
                   f"(--shape {functional} for the functional runs' default)")
    # run_kernel builds, checks, times and runs in one call, so the passes inside it report to
    # the display through the context instead of through an argument.
    with _LongRunDisplay(app, kdef.name, check=args.check) as display, \
            reporting_progress(display.update):
        report = run_kernel(kdef.name, shape, preset=spec, check=args.check and not args.timing_only,
                            safety_checks=not args.timing_only)
    if args.trace:
        report.timeline.write_chrome_trace(args.trace)
    doc = report.as_dict()
    if args.path:
        from jalapeno_emu.emu.critical_path import launched_path_runs

        doc["critical_path"] = [r.as_dict() for r in launched_path_runs(report.timeline, label=kdef.name)]
    if app.json_output:
        app.emit_json(f"kernel {kdef.name}", doc)
    else:
        table = metrics_table(f"{kdef.name} on {spec.name}: {key_values(shape)}", doc)
        if report.check is not None:
            for key in ("max_abs_error", "max_rel_error", "passed"):
                table.add_row(key.replace("_", " "),
                              f"{doc[key]:.3g}" if isinstance(doc[key], float) else str(doc[key]))
        app.console.print(table)
        notes = f"kernel notes: {key_values(doc['notes'])}" if doc.get("notes") else None
        for line in (why_line(doc), notes):
            if line is not None:
                app.console.print(line, markup=False, soft_wrap=True)
        if report.check is not None:
            app.console.print(f"tolerance: atol={doc['tolerance']['atol']:g} "
                              f"rtol={doc['tolerance']['rtol']:g} ({doc['tolerance']['why']})")
        if args.path:
            app.console.print(path_table(f"critical path of {kdef.name} ({us(report.timeline.time_s)} µs)",
                                         doc["critical_path"]))
    if args.trace:
        trace_note(app, args.trace)
    if report.check is not None and not report.check["passed"]:
        return 1
    return 0


class _LongRunDisplay:
    """Warns once, and shows a transient progress bar on stderr, when a pass reports more than
    ``LONG_RUN_INSTRUCTIONS`` instructions; does nothing for smaller programs. With ``--json``
    the warning still goes to stderr (stdout keeps only the JSON) but the bar is off."""

    def __init__(self, app: App, kernel: str, *, check: bool) -> None:
        self.app, self.kernel, self.check = app, kernel, check
        self.warned = False
        self.bar: Progress | None = None
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self) -> _LongRunDisplay:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, stage: str, done: int, total: int) -> None:
        """The ``reporting_progress`` callback: (pass name, instructions done, total)."""
        # The first pass (the analysis) counts every instruction and decides; later passes of
        # the same program get a bar too, whatever their count (the functional run skips the
        # semaphore instructions, so it counts fewer).
        if not self.warned:
            if total <= LONG_RUN_INSTRUCTIONS:
                return
            self.warned = True
            passes = "the race and uninitialised-read analysis" + (
                " and the functional run" if self.check else "")
            # Straight to the stderr console, not app.status: with --json this is still worth
            # seeing, and stderr leaves the JSON on stdout intact. soft_wrap: one line, unbroken.
            self.app.err_console.print(
                f"[yellow]{self.kernel}: {total:,} instructions; {passes} take a while at this size "
                "(gemm m=n=k=4096 on tiny, 212k instructions: about a minute on two CPU cores); "
                "--timing-only gives the timing in seconds, without executing the arithmetic or "
                "the analysis[/yellow]", soft_wrap=True)
        if self.app.json_output:
            return
        if self.bar is None:
            self.bar = Progress(console=self.app.err_console, transient=True)
            self.bar.start()
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(_STAGES.get(stage, stage), total=total)
        self.bar.update(self.tasks[stage], completed=done, total=total)
