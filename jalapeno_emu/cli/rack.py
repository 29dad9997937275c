"""``jalapeno-emu serve`` and ``sweep``: a model served on a rack (InferenceX metrics), and the
workload options and helpers ``compare`` (``cli/compare.py``) shares with them.

``serve`` predicts one ISL/OSL/concurrency point (searching the best mapping unless one is given);
``sweep`` runs every concurrency with the mappings worth simulating there and prints the Pareto
frontier (plot, CSV). Kernel timings are kept on disk between runs (``--no-cache`` to re-time
everything). ``sweep`` (one task per mapping) runs its tasks in local processes (``--workers``) or
on a Dask cluster (``--scheduler``); ``serve`` builds its step model's kernels side by side there.
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
from jalapeno_emu.files import all_or_nothing, check_output_paths
from jalapeno_emu.serving.metrics import POWER_KINDS

DEFAULT_CONCURRENCIES = "1,2,4,8,16,32,64,128,256,512,1024"


def add_workload_options(p: argparse.ArgumentParser) -> None:
    """The options every rack command takes: the model and workload, the search, the caches,
    fusion, the serving stack, speculative decoding and ``--json``."""
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
    """Add the ``serve`` and ``sweep`` commands."""
    p = sub.add_parser("serve", help="serve a model on a rack at one ISL/OSL/concurrency point")
    add_workload_options(p)
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
    add_workload_options(p)
    p.add_argument("--preset", default="jalapeno-v1", help="chip preset (default jalapeno-v1)")
    p.add_argument("--chips", type=int, help="only deployments of this many chips")
    p.add_argument(
        "--concurrency",
        default=DEFAULT_CONCURRENCIES,
        help=f"comma-separated (default {DEFAULT_CONCURRENCIES})",
    )
    p.add_argument(
        "--y",
        default="throughput_tok_s_per_chip",
        choices=("throughput_tok_s_per_chip", *(f"tok_s_per_kw.{k}" for k in POWER_KINDS)),
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


def clipped(text: str, width: int = 60) -> str:
    """``repr(text)``, cut to ``width`` characters: a list of thousands of values is not echoed."""
    shown = repr(text)
    return shown if len(shown) <= width else f"{shown[:width - 4]}...'"


def concurrencies_of(text: str, what: str) -> list[int]:
    """The comma-separated concurrencies of ``text``, each once, in the order first given (the
    library's :func:`~jalapeno_emu.serving.limits.distinct_concurrencies`, so that the rows printed
    match the points simulated); more distinct values than its limit are refused."""
    from jalapeno_emu.serving.limits import distinct_concurrencies

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise Abort(f"{what} {clipped(text)} must be comma-separated integers") from None
    if not values or any(v < 1 for v in values):
        raise Abort(f"{what} {clipped(text)} must be integers >= 1")
    return list(distinct_concurrencies(values, what))


def disk_cache_of(args: argparse.Namespace) -> bool:
    """Whether the kernel-timing disk cache is on (not ``--no-cache``)."""
    return not args.no_cache


def software_overrides(args: argparse.Namespace) -> dict[str, str] | None:
    """The ``software`` fields ``--fusion`` and ``--stack`` set on every preset (None: neither)."""
    out = {f"software.{key}": getattr(args, key) for key in ("fusion", "stack") if getattr(args, key, None)}
    return out or None


def preset_spec(args: argparse.Namespace, preset: str) -> Any:
    """The preset, with ``--fusion`` and ``--stack`` (when given) as its software's."""
    from jalapeno_emu.chip import load_preset

    spec = load_preset(preset)
    changes = software_overrides(args)
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
    spec = preset_spec(args, args.preset)
    timer = shared_timer(spec, disk_cache=disk_cache_of(args))  # the one the step models will use
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
            disk_cache=disk_cache_of(args),
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
    print_kernel_limits(app, doc["kernel_limits"])
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

    concs = concurrencies_of(args.concurrency, "--concurrency")
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
            preset_spec(args, args.preset),
            args.isl,
            args.osl,
            concs,
            routing=args.routing,
            finalists=args.finalists,
            chips=args.chips,
            max_batch_tokens=args.max_batch_tokens,
            disk_cache=disk_cache_of(args),
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
                "kernel_limits": kernel_limits_of(points),
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
    print_kernel_limits(app, kernel_limits_of(points))
    simulated = (f"{len(points)} points simulated with {held} held" if held else
                 f"{len(points)} points simulated over {len({p.mapping for p in points})} mappings "
                 f"(of {screened} screened)")
    app.console.print(
        simulated
        + (f"; plot {args.plot}" if args.plot else "")
        + (f"; CSV {args.csv}" if args.csv else "")
    )
    return 0


def kernel_limits_of(points: list[Any]) -> list[str]:
    """The distinct ``kernel_limits`` lines of sweep points, in first-seen order."""
    return list(dict.fromkeys(line for p in points for line in p.kernel_limits))


def print_kernel_limits(app: App, lines: list[str]) -> None:
    """Each ``kernel_limits`` line as a ``note:`` after a command's table."""
    for line in lines:
        app.console.print(f"[yellow]note:[/yellow] {escape(line)}", soft_wrap=True)


