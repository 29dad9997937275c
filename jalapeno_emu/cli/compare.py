"""``jalapeno-emu compare``: presets side by side, at matched concurrency (each preset's best
mapping for ``--objective`` at each concurrency) or as published comparisons are quoted: each
preset's best throughput at ``--interactivity X`` tok/s/user or faster and its ``--peak``, read
from its frontier (``jalapeno_emu.serving.quotes``). The workload options are ``serve``'s and
``sweep``'s (``cli/rack.py``); one task per preset (matched concurrency) or per mapping of each
preset's sweep (frontiers), in local processes or on a Dask cluster.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape
from rich.table import Table

from jalapeno_emu.cli.app import Abort, App, add_executor_options
from jalapeno_emu.cli.rack import (
    DEFAULT_CONCURRENCIES,
    add_workload_options,
    clipped,
    concurrencies_of,
    disk_cache_of,
    kernel_limits_of,
    preset_spec,
    print_kernel_limits,
    software_overrides,
    speculation_from_args,
)
from jalapeno_emu.errors import EmuError
from jalapeno_emu.serving.metrics import POWER_KINDS


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``compare`` command."""
    p = sub.add_parser("compare", help="presets side by side at matched concurrencies, with ratios")
    add_workload_options(p)
    p.add_argument(
        "--presets",
        default="jalapeno-v1,gb300-nvl72",
        help="comma-separated, the first is the reference of the ratios (default jalapeno-v1,gb300-nvl72)",
    )
    p.add_argument("--concurrency", default=None,
                   help="comma-separated (default 1,64,1024; with --interactivity or --peak, the sweep's "
                   f"{DEFAULT_CONCURRENCIES})")
    p.add_argument(
        "--objective",
        default="interactivity",
        choices=("interactivity", "throughput"),
        help="what each preset's mapping search maximises at matched concurrency (default "
        "interactivity; a frontier keeps the best of both)",
    )
    p.add_argument(
        "--interactivity", action="append", metavar="X",
        help="instead of matching concurrency: each preset's best throughput per chip and per kW at X "
        "tok/s/user or faster, read from its Pareto front (interpolated); comma-separated or repeated",
    )
    p.add_argument("--peak", action="store_true",
                   help="each preset's peak throughput per chip and per kW over its sweep, with the ratios")
    p.add_argument(
        "--power",
        default="all_in",
        type=_power_kind,
        choices=POWER_KINDS,
        help="power per chip for tok/s per kW: package, sustained or all-in (default all-in)",
    )
    add_executor_options(p)
    p.set_defaults(run=run_compare)


def _power_kind(text: str) -> str:
    """``all-in`` and ``all_in`` both name the all-in power (the JSON field is ``all_in``)."""
    return text.strip().lower().replace("-", "_")

def _floats(values: list[str], what: str) -> list[float]:
    """The positive numbers of repeated and/or comma-separated ``values``, each once, in order."""
    out: list[float] = []
    for text in values:
        for part in text.split(","):
            if not part.strip():
                continue
            try:
                v = float(part)
            except ValueError:
                raise Abort(f"{what} {clipped(part)} must be a number (tok/s per user)") from None
            if not (v > 0 and v != float("inf")):
                raise Abort(f"{what} {clipped(part)} must be a positive, finite number (tok/s per user)")
            if v not in out:
                out.append(v)
    if not out:
        raise Abort(f"{what} needs at least one number")
    return out

def run_compare(app: App, args: argparse.Namespace) -> int:
    """Presets side by side at the same concurrencies; a preset that cannot be modelled fails loudly."""
    from jalapeno_emu.parallel import executor
    from jalapeno_emu.rack.deployment import compare_presets

    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if len(presets) < 2:
        raise Abort(f"--presets {args.presets!r} needs at least two presets")
    frontier = bool(args.interactivity) or args.peak
    xs = _floats(args.interactivity, "--interactivity") if args.interactivity else []
    default = DEFAULT_CONCURRENCIES if frontier else "1,64,1024"
    concs = concurrencies_of(args.concurrency or default, "--concurrency")
    spec_decode = speculation_from_args(args)
    for preset in presets:
        # A preset that does not load (a typo, a bad TOML) is the user's to fix before anything
        # runs: one line now, not a status line, a table and a JSON "errors" entry later.
        try:
            preset_spec(args, preset)
        except EmuError as exc:
            raise Abort(f"--presets: {exc}") from None
    if frontier:
        return _run_compare_frontiers(app, args, presets, concs, xs, spec_decode)
    with executor(args.workers, args.scheduler) as ex:
        app.status(f"{args.model} on {', '.join(presets)}, concurrency {', '.join(map(str, concs))}")
        results, errors = compare_presets(
            args.model,
            presets,
            args.isl,
            args.osl,
            concs,
            objective=args.objective,
            routing=args.routing,
            finalists=args.finalists,
            max_batch_tokens=args.max_batch_tokens,
            disk_cache=disk_cache_of(args),
            spec_overrides=software_overrides(args),
            executor=ex,
            speculation=spec_decode,
            on_preset=lambda preset, error: app.status(
                f"{preset}: " + ("failed (the error is printed at the end)" if error else "done")),
        )
    ref = presets[0]
    rows = _compare_rows(results, ref, concs, args.power)
    if app.json_output:
        app.emit_json(
            "compare",
            {
                "model": args.model,
                "isl": args.isl,
                "osl": args.osl,
                "objective": args.objective,
                "power": args.power,
                "mtp": None if spec_decode is None else spec_decode.as_dict(),
                "presets": presets,
                "rows": rows,
                "errors": errors,
            },
        )
    else:
        _print_compare(app, args, presets, results, rows)
    return _report_errors(app, errors)

def _report_errors(app: App, errors: dict[str, str]) -> int:
    """Each preset's error on stderr (with ``--json`` too: the exit status says something failed,
    and a reader of the terminal or a CI log should see what without parsing stdout); the exit
    status."""
    for preset, msg in errors.items():
        app.err_console.print(f"[bold red]error:[/bold red] {escape(f'{preset}: {msg}')}", markup=True,
                              soft_wrap=True)
    return 2 if errors else 0

def _run_compare_frontiers(app: App, args: argparse.Namespace, presets: list[str], concs: list[int],
                           xs: list[float], spec_decode: Any) -> int:
    """``compare --interactivity X`` / ``--peak``: each preset swept, its frontier read at X and at
    its peak (:mod:`jalapeno_emu.serving.quotes`)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from jalapeno_emu.parallel import executor
    from jalapeno_emu.rack.deployment import compare_frontiers
    from jalapeno_emu.serving import pareto_front
    from jalapeno_emu.serving.quotes import at_interactivity, peaks

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=app.err_console, transient=True,
                        disable=app.json_output)
    tasks: dict[str, Any] = {}

    def planned(preset: str, n: int) -> None:
        tasks[preset] = progress.add_task(f"{preset} sweep", total=n)

    with executor(args.workers, args.scheduler) as ex, progress:
        results, errors = compare_frontiers(
            args.model, presets, args.isl, args.osl, concs, routing=args.routing, finalists=args.finalists,
            max_batch_tokens=args.max_batch_tokens, disk_cache=disk_cache_of(args),
            spec_overrides=software_overrides(args), executor=ex,
            speculation=spec_decode, on_plan=planned,
            on_point=lambda preset, _p: progress.advance(tasks[preset]))
    ref = presets[0]
    limits = {p: kernel_limits_of(pts) for p, pts in results.items()}
    points = {p: [pt.as_dict() for pt in pts] for p, pts in results.items()}
    rows = [at_interactivity(points, x, ref=ref, power=args.power) for x in xs]
    peak = peaks(points, ref=ref, power=args.power) if args.peak else None
    if app.json_output:
        app.emit_json("compare", {
            "model": args.model, "isl": args.isl, "osl": args.osl, "power": args.power, "presets": presets,
            "mtp": None if spec_decode is None else spec_decode.as_dict(), "concurrencies": concs,
            "interactivity": rows, "peak": peak,
            "frontiers": {p: pareto_front(pts) for p, pts in points.items()}, "errors": errors,
            "kernel_limits": limits})
    else:
        _print_frontier_quotes(app, args, presets, points, rows, peak)
        print_kernel_limits(app, [line for lines in limits.values() for line in lines])
    return _report_errors(app, errors)

def _print_frontier_quotes(app: App, args: argparse.Namespace, presets: list[str],
                           points: dict[str, list[dict[str, Any]]], rows: list[dict[str, Any]],
                           peak: dict[str, Any] | None) -> None:
    ok = [p for p in presets if p in points]
    ref = presets[0]
    others = [p for p in ok if p != ref] if ref in points else []
    kw = f"tok/s/kW {args.power.replace('_', '-')}"
    where = f"{args.model}, ISL/OSL {args.isl}/{args.osl}"

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f}"

    def ratio(r: dict[str, Any]) -> str:
        a, b = r["throughput_tok_s_per_chip"], r["tok_s_per_kw"]
        return "-" if a is None or b is None else f"{a:.2f}x, {b:.2f}x"

    if rows:
        table = Table(title=f"{where}: best throughput at the interactivity or faster (each preset's "
                      "Pareto front, interpolated)")
        table.add_column("tok/s/user", justify="right")
        for p in ok:
            table.add_column(f"{p}\ntok/s/chip", justify="right")
            table.add_column(f"{p}\n{kw}", justify="right")
        for p in others:
            table.add_column(f"{ref} / {p}\ntok/s/chip, {kw}", justify="right")
        notes = []
        for row in rows:
            cells = [f"{row['interactivity_tok_s_user']:,.1f}"]
            for p in ok:
                cells += [num(row[p]["throughput_tok_s_per_chip"]), num(row[p]["tok_s_per_kw"])]
                if row[p]["reason"]:
                    notes.append(f"{p}: {row[p]['reason']}")
            cells += [ratio(row["ratios"][p]) for p in others]
            table.add_row(*cells)
        app.console.print(table)
        for note in dict.fromkeys(notes):
            app.console.print(f"   {escape(note)}")
    if peak is not None:
        table = Table(title=f"{where}: peak throughput per chip over the sweep")
        for col in ("preset", "tok/s/chip", kw, "at tok/s/user", "mapping", "concurrency", f"{ref} / preset"):
            table.add_column(col, justify="left" if col in ("preset", "mapping") else "right")
        for p in ok:
            d = peak[p]
            if d is None:
                continue
            table.add_row(p, num(d["throughput_tok_s_per_chip"]), num(d["tok_s_per_kw"]),
                          f"{d['interactivity_tok_s_user']:,.1f}", d["mapping"], str(d["concurrency"]),
                          ratio(peak["ratios"][p]) if p in peak["ratios"] else "1.00x, 1.00x")
        app.console.print(table)
    n = sum(len(v) for v in points.values())
    concs = sorted({d["concurrency"] for pts in points.values() for d in pts})
    app.console.print(f"{n} points simulated at concurrencies {', '.join(map(str, concs))} (the frontiers "
                      "and every point: --json)")

def _compare_rows(
    results: dict[str, list[dict[str, Any]]], ref: str, concs: list[int], power: str
) -> list[dict[str, Any]]:
    rows = []
    for i, c in enumerate(concs):
        row: dict[str, Any] = {"concurrency": c}
        for preset, points in results.items():
            d = points[i]
            row[preset] = {
                "mapping": d["mapping"],
                "chips": d["chips"],
                "interactivity_tok_s_user": d["interactivity_tok_s_user"],
                "e2e_s": d["e2e_s"],
                "throughput_tok_s_per_chip": d["throughput_tok_s_per_chip"],
                "tok_s_per_kw": d["tok_s_per_kw"][power],
            }
        if ref in results:
            r = row[ref]
            row["ratios"] = {
                p: {
                    "interactivity": r["interactivity_tok_s_user"] / row[p]["interactivity_tok_s_user"],
                    "e2e": row[p]["e2e_s"] / r["e2e_s"],
                    "tok_s_per_kw": r["tok_s_per_kw"] / row[p]["tok_s_per_kw"],
                }
                for p in results
                if p != ref
            }
        rows.append(row)
    return rows

def _print_compare(
    app: App,
    args: argparse.Namespace,
    presets: list[str],
    results: dict[str, list[dict[str, Any]]],
    rows: list[dict[str, Any]],
) -> None:
    ok = [p for p in presets if p in results]
    table = Table(
        title=f"{args.model}, ISL/OSL {args.isl}/{args.osl}, best mapping per preset for {args.objective}; "
        f"tok/s per kW at {args.power} power"
    )
    table.add_column("concurrency", justify="right")
    for p in ok:
        for col in ("mapping", "tok/s/user", "E2E s", "tok/s/kW"):
            table.add_column(f"{p}\n{col}", justify="left" if col == "mapping" else "right")
    ref = presets[0]
    others = [p for p in ok if p != ref] if ref in results else []
    for p in others:
        table.add_column(f"{ref} / {p}\ntok/s/user, E2E, tok/s/kW", justify="right")
    for row in rows:
        cells = [str(row["concurrency"])]
        for p in ok:
            d = row[p]
            cells += [
                d["mapping"],
                f"{d['interactivity_tok_s_user']:,.1f}",
                f"{d['e2e_s']:.2f}",
                f"{d['tok_s_per_kw']:,.0f}",
            ]
        for p in others:
            r = row["ratios"][p]
            cells.append(f"{r['interactivity']:.2f}x, {r['e2e']:.2f}x, {r['tok_s_per_kw']:.2f}x")
        table.add_row(*cells)
    app.console.print(table)
