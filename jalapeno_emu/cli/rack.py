"""``jalapeno-emu serve``, ``sweep`` and ``compare``: a model served on a rack (InferenceX metrics).

``serve`` predicts one ISL/OSL/concurrency point (searching the best mapping unless one is given);
``sweep`` runs every concurrency with the mappings worth simulating there and prints the Pareto
frontier (plot, CSV); ``compare`` puts presets side by side at matched concurrencies. Kernel
timings are kept on disk between runs (``--no-cache`` to re-time everything). ``sweep`` (one task
per mapping) and ``compare`` (one per preset) run their tasks in local processes (``--workers``)
or on a Dask cluster (``--scheduler``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from rich.markup import escape
from rich.table import Table

from jalapeno_emu.chip.spec import STACK_NAMES
from jalapeno_emu.cli.app import Abort, App, add_executor_options, output_file
from jalapeno_emu.errors import EmuError
from jalapeno_emu.files import all_or_nothing, check_output_paths

_POWER_KINDS = ("package", "sustained", "all_in")
_DEFAULT_CONCURRENCIES = "1,2,4,8,16,32,64,128,256,512,1024"


def _workload(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="gpt-oss-120b, gpt-oss-20b, deepseek-r1, kimi-k2.5, tiny-*, or a path to a config.json",
    )
    p.add_argument("--isl", type=int, default=8192, help="input length (default 8192)")
    p.add_argument("--osl", type=int, default=1024, help="output length (default 1024)")
    p.add_argument(
        "--routing", default="uniform", help="MoE routing: uniform (default) or zipf:S, e.g. zipf:1.2"
    )
    p.add_argument(
        "--finalists",
        type=int,
        default=2,
        help="mappings simulated per objective after the analytic screen (default 2)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=8192,
        help="token budget of one DP group's step (default 8192)",
    )
    p.add_argument(
        "--no-cache", action="store_true", help="do not read or write the kernel-timing disk cache"
    )
    p.add_argument(
        "--fusion",
        choices=("none", "layer", "step"),
        default=None,
        help="how each chip's launches join into programs: none (one per kernel), layer, step "
        "(one persistent program per step); default: each preset's software.fusion",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--stack", type=str.lower, choices=STACK_NAMES, default=None,
                   help="serving stack whose host costs (per step, per request) the simulator charges: "
                   f"{', '.join(STACK_NAMES)}; default: each preset's software.stack "
                   "(jalapeno-emu stack show NAME lists them)")
    p.add_argument("--mtp", type=int, default=0, metavar="K",
                   help="speculative decoding with multi-token prediction: K draft tokens per step, verified "
                   "in one pass of K + 1 tokens per sequence (default 0: single-token prediction)")
    p.add_argument("--mtp-acceptance", metavar="P", default=None,
                   help="conditional acceptance of each draft token: one probability, or one per position "
                   "(comma-separated, e.g. 0.9,0.8; default 0.85, DeepSeek-V3's reported low end)")


def speculation_from_args(args: argparse.Namespace) -> Any:
    """The run's :class:`~jalapeno_emu.serving.speculative.Speculation` from ``--mtp`` and
    ``--mtp-acceptance`` (None: single-token prediction); a bad value is one line."""
    from jalapeno_emu.errors import InvalidArgumentError
    from jalapeno_emu.serving.speculative import parse_acceptance, speculation

    try:
        acceptance = None if args.mtp_acceptance is None else parse_acceptance(args.mtp_acceptance)
        return speculation(args.mtp, acceptance)
    except InvalidArgumentError as exc:
        raise Abort(f"--mtp {args.mtp}: {exc}") from None


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve``, ``sweep`` and ``compare`` commands."""
    p = sub.add_parser("serve", help="serve a model on a rack at one ISL/OSL/concurrency point")
    _workload(p)
    p.add_argument("--preset", default="jalapeno-v1", help="chip preset (default jalapeno-v1)")
    p.add_argument("--chips", type=int, help="search only deployments of this many chips")
    p.add_argument("--mapping", help="e.g. tp=8,ep=8,dp=1,pp=1 (default: the best for --objective)")
    p.add_argument("--concurrency", type=int, required=True, help="requests in flight")
    p.add_argument(
        "--objective",
        default="interactivity",
        choices=("interactivity", "throughput"),
        help="what the mapping search maximises (default interactivity)",
    )
    p.add_argument("--requests", type=int, help="measured requests (default max(64, 2 x concurrency))")
    p.add_argument("--seed", type=int, default=0, help="seed of the request lengths")
    add_executor_options(p)  # kernel builds of the step model's grid points, side by side
    p.set_defaults(run=run_serve)

    p = sub.add_parser("sweep", help="every concurrency x the mappings worth simulating: Pareto frontier")
    _workload(p)
    p.add_argument("--preset", default="jalapeno-v1", help="chip preset (default jalapeno-v1)")
    p.add_argument("--chips", type=int, help="only deployments of this many chips")
    p.add_argument(
        "--concurrency",
        default=_DEFAULT_CONCURRENCIES,
        help=f"comma-separated (default {_DEFAULT_CONCURRENCIES})",
    )
    p.add_argument(
        "--y",
        default="throughput_tok_s_per_chip",
        choices=("throughput_tok_s_per_chip", *(f"tok_s_per_kw.{k}" for k in _POWER_KINDS)),
        help="frontier's y metric (default throughput_tok_s_per_chip)",
    )
    p.add_argument("--plot", type=output_file, metavar="FILE.png|FILE.svg",
                   help="write the plot here, in the format its suffix names: .png (an SVG of the same "
                   "name is written beside it) or .svg")
    p.add_argument("--csv", type=output_file, help="write every point here")
    p.add_argument("--mapping", help="hold this mapping at every concurrency, e.g. tp=8,ep=8 (default: "
                   "the mappings worth simulating at each)")
    add_executor_options(p)
    p.set_defaults(run=run_sweep)

    p = sub.add_parser("compare", help="presets side by side at matched concurrencies, with ratios")
    _workload(p)
    p.add_argument(
        "--presets",
        default="jalapeno-v1,gb300-nvl72",
        help="comma-separated, the first is the reference of the ratios (default jalapeno-v1,gb300-nvl72)",
    )
    p.add_argument("--concurrency", default=None,
                   help="comma-separated (default 1,64,1024; with --interactivity or --peak, the sweep's "
                   f"{_DEFAULT_CONCURRENCIES})")
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
        choices=_POWER_KINDS,
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
                raise Abort(f"{what} {_clipped(part)} must be a number (tok/s per user)") from None
            if not (v > 0 and v != float("inf")):
                raise Abort(f"{what} {_clipped(part)} must be a positive, finite number (tok/s per user)")
            if v not in out:
                out.append(v)
    if not out:
        raise Abort(f"{what} needs at least one number")
    return out


def _clipped(text: str, width: int = 60) -> str:
    """``repr(text)``, cut to ``width`` characters: a list of thousands of values is not echoed."""
    shown = repr(text)
    return shown if len(shown) <= width else f"{shown[:width - 4]}...'"


def _ints(text: str, what: str) -> list[int]:
    """The comma-separated concurrencies of ``text``, each once, in the order first given (the
    library's :func:`~jalapeno_emu.serving.limits.distinct_concurrencies`, so that the rows printed
    match the points simulated); more distinct values than its limit are refused."""
    from jalapeno_emu.serving.limits import distinct_concurrencies

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise Abort(f"{what} {_clipped(text)} must be comma-separated integers") from None
    if not values or any(v < 1 for v in values):
        raise Abort(f"{what} {_clipped(text)} must be integers >= 1")
    return list(distinct_concurrencies(values, what))


def _cache(args: argparse.Namespace) -> bool:
    return not args.no_cache


def _software(args: argparse.Namespace) -> dict[str, str] | None:
    """The ``software`` fields ``--fusion`` and ``--stack`` set on every preset (None: neither)."""
    out = {f"software.{key}": getattr(args, key) for key in ("fusion", "stack") if getattr(args, key, None)}
    return out or None


def _spec(args: argparse.Namespace, preset: str) -> Any:
    """The preset, with ``--fusion`` and ``--stack`` (when given) as its software's."""
    from jalapeno_emu.chip import load_preset

    spec = load_preset(preset)
    changes = _software(args)
    return spec.replace(**changes) if changes else spec


def _row(d: dict[str, Any]) -> list[str]:
    return [
        str(d["concurrency"]),
        str(d["mapping"]),
        str(d["chips"]),
        f"{d['interactivity_tok_s_user']:,.1f}",
        f"{d['ttft_s']:.3f}",
        f"{d['tpot_s'] * 1e3:,.2f}",
        f"{d['e2e_s']:.2f}",
        f"{d['throughput_tok_s_per_chip']:,.0f}",
        f"{d['tok_s_per_kw']['all_in']:,.0f}",
    ]


_COLS = (
    "concurrency",
    "mapping",
    "chips",
    "tok/s/user",
    "TTFT s",
    "TPOT ms",
    "E2E s",
    "tok/s/chip",
    "tok/s/kW all-in",
)


def _table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    for col in _COLS:
        table.add_column(col, justify="left" if col == "mapping" else "right")
    for d in rows:
        table.add_row(*_row(d))
    return table


@contextlib.contextmanager
def _builds_shown(app: App, timer: Any, what: str, every_s: float = 0.5) -> Iterator[None]:
    """While the block runs: a spinner on stderr with the kernel programs ``timer`` has built and
    timed so far (a cold ``serve`` on a GPU preset builds for minutes before its first figure);
    nothing with ``--json`` or off a terminal."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                        console=app.err_console, transient=True, disable=app.json_output)
    stop = threading.Event()
    with progress:
        task = progress.add_task(f"{what}: simulating")

        def poll() -> None:
            while not stop.wait(every_s):
                progress.update(task, description=f"{what}: {timer.builds:,} kernel programs built and timed")

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()


def run_serve(app: App, args: argparse.Namespace) -> int:
    """Predict one serving point."""
    from jalapeno_emu.model.config import load_model_config
    from jalapeno_emu.parallel import executor
    from jalapeno_emu.rack.deployment import check_workload, predict
    from jalapeno_emu.rack.launch_timer import launch_executor, shared_timer

    # Arguments beyond their limits are refused before the status line, not after it.
    spec_decode = speculation_from_args(args)
    cfg = load_model_config(args.model)
    check_workload(cfg, args.isl, args.osl, [args.concurrency], requests=args.requests,
                   max_batch_tokens=args.max_batch_tokens)
    app.status(
        f"{args.model} on {args.preset} at {args.isl}/{args.osl}, concurrency {args.concurrency}"
        + ("" if args.mapping else f" (searching the best mapping for {args.objective})")
    )
    spec = _spec(args, args.preset)
    timer = shared_timer(spec, disk_cache=_cache(args))  # the one the step models will use
    with executor(args.workers, args.scheduler) as pool, launch_executor(pool), \
            _builds_shown(app, timer, f"{args.model} on {args.preset}"):
        pred = predict(
            cfg,
            spec,
            args.isl,
            args.osl,
            args.concurrency,
            mapping=args.mapping,
            objective=args.objective,
            routing=args.routing,
            chips=args.chips,
            finalists=args.finalists,
            max_batch_tokens=args.max_batch_tokens,
            requests=args.requests,
            seed=args.seed,
            disk_cache=_cache(args),
            speculation=spec_decode,
        )
    doc = pred.as_dict()
    if app.json_output:
        app.emit_json("serve", doc)
        return 0
    app.console.print(
        _table(
            f"{pred.model} on {pred.preset}, ISL/OSL {args.isl}/{args.osl} (routing {pred.routing.name})",
            [doc],
        )
    )
    pk = doc["tok_s_per_kw"]
    app.console.print(
        f"medians over {doc['measured_requests']} requests; tok/s per kW: package {pk['package']:,.0f}, "
        f"sustained {pk['sustained']:,.0f}, all-in {pk['all_in']:,.0f}; KV capacity "
        f"{doc['kv_capacity_tokens']:,} tokens; mean decode batch {doc['mean_decode_batch']:.1f}"
    )
    _print_limits(app, doc["kernel_limits"])
    if spec_decode is not None and doc["tokens_per_decode_step"] is not None:
        mtp = doc["mtp"]
        app.console.print(
            f"MTP: {mtp['draft_tokens']} draft token(s) per step, acceptance "
            f"{', '.join(f'{p:.2f}' for p in mtp['acceptance'])}: expected "
            f"{mtp['expected_tokens_per_step']:.2f} tokens per sequence and step, simulated "
            f"{doc['tokens_per_decode_step']:.2f}"
        )
    if pred.finalists:
        app.console.print(
            f"searched {pred.screened} mappings (analytic screen); simulated: "
            + "; ".join(
                f"{f['mapping']} ({f['interactivity_tok_s_user']:,.1f} tok/s/user, "
                f"{f['throughput_tok_s_per_chip']:,.0f} tok/s/chip)"
                for f in doc["finalists"]
            )
        )
    return 0


def _plot_paths(path: str) -> tuple[str | None, str]:
    """(PNG, SVG) that ``--plot PATH`` writes: ``x.png`` gives x.png and x.svg beside it (as it
    always has), ``x.svg`` gives x.svg alone; any other suffix is refused rather than guessed."""
    root, ext = os.path.splitext(path)
    if ext.lower() == ".png":
        return path, root + ".svg"
    if ext.lower() == ".svg":
        return None, path
    raise Abort(f"--plot {path}: the file name must end in .png (a PNG, with an SVG beside it) or .svg "
                "(an SVG alone)")


def run_sweep(app: App, args: argparse.Namespace) -> int:
    """Every concurrency with its shortlisted mappings; the Pareto frontier."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from jalapeno_emu.parallel import executor
    from jalapeno_emu.rack.deployment import sweep_mappings
    from jalapeno_emu.serving import pareto_front, plot_pareto, write_points_csv

    concs = _ints(args.concurrency, "--concurrency")
    spec_decode = speculation_from_args(args)
    # Every output checked before the sweep (which can take an hour), not after it.
    png, svg = _plot_paths(args.plot) if args.plot else (None, None)
    check_output_paths({"--csv": args.csv, "--plot": png or svg,
                        f"the SVG beside --plot {png}": svg if png else None}, inputs=[args.model])
    progress = Progress(
        TextColumn(f"{args.model} sweep"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=app.err_console,
        transient=True,
        disable=app.json_output,
    )
    with executor(args.workers, args.scheduler) as ex, progress:
        task = progress.add_task("points", total=None)
        points, screened = sweep_mappings(
            args.model,
            _spec(args, args.preset),
            args.isl,
            args.osl,
            concs,
            routing=args.routing,
            finalists=args.finalists,
            chips=args.chips,
            max_batch_tokens=args.max_batch_tokens,
            disk_cache=_cache(args),
            on_plan=lambda n: progress.update(task, total=n),
            on_point=lambda _p: progress.advance(task),
            executor=ex,
            mapping=args.mapping,
            speculation=spec_decode,
        )
    held = points[0].mapping if args.mapping and points else None
    front = pareto_front(points, y=args.y)
    rows = [dict(p.as_dict()) for p in points]
    front_rows = [dict(p.as_dict()) for p in front]
    with all_or_nothing():  # a plot that fails leaves no CSV behind, and the reverse
        if args.csv:
            write_points_csv(points, args.csv)
        if args.plot:
            plot_pareto(points, png, svg, y=args.y, model_name=args.model, log_x=True)
    if app.json_output:
        app.emit_json(
            "sweep",
            {
                "model": args.model,
                "preset": args.preset,
                "isl": args.isl,
                "osl": args.osl,
                "routing": args.routing,
                "concurrencies": concs,
                "candidates_screened": screened,
                "mapping": held,
                "kernel_limits": _kernel_limits(points),
                "mtp": None if spec_decode is None else spec_decode.as_dict(),
                "y": args.y,
                "points": rows,
                "frontier": front_rows,
            },
        )
        return 0
    app.console.print(
        _table(
            f"{args.model} on {args.preset}, ISL/OSL {args.isl}/{args.osl}: Pareto frontier "
            f"(interactivity vs {args.y})" + (f", mapping {held}" if held else ""),
            front_rows,
        )
    )
    _print_limits(app, _kernel_limits(points))
    simulated = (f"{len(points)} points simulated with {held} held" if held else
                 f"{len(points)} points simulated over {len({p.mapping for p in points})} mappings "
                 f"(of {screened} screened)")
    app.console.print(
        simulated
        + (f"; plot {args.plot}" if args.plot else "")
        + (f"; CSV {args.csv}" if args.csv else "")
    )
    return 0


def run_compare(app: App, args: argparse.Namespace) -> int:
    """Presets side by side at the same concurrencies; a preset that cannot be modelled fails loudly."""
    from jalapeno_emu.parallel import executor
    from jalapeno_emu.rack.deployment import compare_presets

    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if len(presets) < 2:
        raise Abort(f"--presets {args.presets!r} needs at least two presets")
    frontier = bool(args.interactivity) or args.peak
    xs = _floats(args.interactivity, "--interactivity") if args.interactivity else []
    default = _DEFAULT_CONCURRENCIES if frontier else "1,64,1024"
    concs = _ints(args.concurrency or default, "--concurrency")
    spec_decode = speculation_from_args(args)
    for preset in presets:
        # A preset that does not load (a typo, a bad TOML) is the user's to fix before anything
        # runs: one line now, not a status line, a table and a JSON "errors" entry later.
        try:
            _spec(args, preset)
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
            disk_cache=_cache(args),
            spec_overrides=_software(args),
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
            max_batch_tokens=args.max_batch_tokens, disk_cache=_cache(args),
            spec_overrides=_software(args), executor=ex,
            speculation=spec_decode, on_plan=planned,
            on_point=lambda preset, _p: progress.advance(tasks[preset]))
    ref = presets[0]
    limits = {p: _kernel_limits(pts) for p, pts in results.items()}
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
        _print_limits(app, [line for lines in limits.values() for line in lines])
    return _report_errors(app, errors)


def _kernel_limits(points: list[Any]) -> list[str]:
    """The distinct ``kernel_limits`` lines of sweep points, in first-seen order."""
    return list(dict.fromkeys(line for p in points for line in p.kernel_limits))


def _print_limits(app: App, lines: list[str]) -> None:
    for line in lines:
        app.console.print(f"[yellow]note:[/yellow] {escape(line)}", soft_wrap=True)


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
