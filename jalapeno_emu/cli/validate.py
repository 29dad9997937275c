"""``jalapeno-emu validate``: the GPU presets against measured InferenceX points.

Predicts every row of the packaged calibration CSV (or ``--rows``), prints measured, predicted and
error per metric and row with its class, the median absolute percentage error (MAPE), the
calibrated timing knobs per GPU family and the leave-one-out MAPE (``--no-calibrate``: the presets'
own values only). Nothing is written: calibrated values are printed (and in ``--json``) only. Rows
are predicted in local processes (``--workers``) or on a Dask cluster (``--scheduler``), one task
per row; the calibration runs here.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from rich.table import Table

from jalapeno_emu.cli.app import App, add_executor_options

_SHORT = {"tok_s_user": "tok/s/user", "tput_per_gpu": "tok/s/GPU", "ttft_s": "TTFT s"}


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``validate`` command."""
    p = sub.add_parser("validate", help="predict the measured InferenceX GPU points; calibrate GPU knobs")
    p.add_argument("--rows", help="CSV data rows to use, e.g. 1-12,17 (default: all)")
    p.add_argument("--no-calibrate", action="store_true", help="predict at the presets' own values only")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--mtp", type=int, default=1, metavar="K",
                   help="draft tokens per step the rows measured with MTP on are predicted with (the data "
                   "does not say; default 1)")
    p.add_argument("--mtp-acceptance", metavar="P", default=None,
                   help="their conditional acceptance per draft position (default 0.85)")
    add_executor_options(p)
    p.set_defaults(run=run_validate)


def _clean(x: Any) -> Any:
    """NaN and infinities become None, so the JSON is standard."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:+.0f}%"


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.3f}" if abs(x) < 10 else f"{x:,.0f}"


def _rows_table(records: list[dict[str, Any]], calibrated: bool) -> Table:
    table = Table(title="InferenceX GPU points: measured, predicted (preset values), error"
                  + (", error after calibration" if calibrated else ""))
    for col in ("row", "hardware", "model", "isl/osl", "conc", "class", "mapping"):
        table.add_column(col, justify="right" if col in ("row", "conc") else "left")
    for m in _SHORT.values():
        table.add_column(f"{m}\nmeas / pred / err" + (" / cal" if calibrated else ""), justify="right")
    for r in records:
        cells = [str(r["row"]), f"{r['preset'] or '?'}", f"{r['config'] or r['model']}",
                 f"{r['isl']}/{r['osl']}", str(r["concurrency"] or "-"), r["class"], r.get("mapping") or "-"]
        for m in _SHORT:
            meas = r["measured"].get(m)
            if meas is None:
                cells.append("-")
                continue
            pred = (r.get("predicted") or {}).get(m)
            text = f"{_num(meas)} / {_num(pred)} / {_pct((r.get('error') or {}).get(m))}"
            if calibrated and "error_calibrated" in r:
                text += f" / {_pct(r['error_calibrated'].get(m))}"
            cells.append(text)
        table.add_row(*cells)
    return table


def _print_summary(app: App, doc: dict[str, Any]) -> None:
    s = doc["summary"]
    c = s["classes"]
    app.console.print(f"rows: {c['fit']} fit, {c['predicted-only']} predicted-only, "
                      f"{c['not-predicted']} not-predicted")
    fit = s["mape_fit"]
    line = f"MAPE over {fit['rows']} fit rows: preset values {_pct(fit['before']).lstrip('+')}"
    if fit["after"] is not None:
        line += f", calibrated {_pct(fit['after']).lstrip('+')}, leave-one-out {_pct(fit['loo']).lstrip('+')}"
    app.console.print(line)
    po = s["mape_predicted_only"]
    if po["rows"]:
        line = f"MAPE over {po['rows']} predicted-only rows: preset values {_pct(po['before']).lstrip('+')}"
        if po["after"] is not None:
            line += f", calibrated {_pct(po['after']).lstrip('+')}"
        app.console.print(line)
    for fam, f in s["families"].items():
        if "setting_label" in f:
            per_preset = "; ".join(f"{p} " + ", ".join(f"{k}={v:.3g}" for k, v in kv.items())
                                   for p, kv in f["knobs"].items())
            app.console.print(f"{fam}: calibrated knobs {f['setting_label']} (MAPE {_pct(f['mape_before'])} "
                              f"-> {_pct(f['mape_after'])}, leave-one-out {_pct(f['loo_mape'])}); "
                              f"per preset: {per_preset}")
    for metric, m in s["per_metric"].items():
        line = f"{_SHORT[metric]}: median |error| over the fit rows {_pct(m['median_before']).lstrip('+')}"
        if "median_loo" in m:
            line += (f", calibrated {_pct(m['median_after']).lstrip('+')}, leave-one-out "
                     f"{_pct(m['median_loo']).lstrip('+')}")
            if m["worst_loo_row"] is not None:
                line += f" (worst: row {m['worst_loo_row']}, {_pct(m['worst_loo'])})"
        app.console.print(line)
    for r in doc["rows"]:
        if r["reasons"]:
            app.console.print(f"row {r['row']} ({r['class']}): " + "; ".join(r["reasons"]), soft_wrap=True)
    app.console.print(f"wall time {doc['wall_s']:.1f} s")


def run_validate(app: App, args: argparse.Namespace) -> int:
    """Predict, calibrate, report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from jalapeno_emu.cli.rack import speculation_from_args
    from jalapeno_emu.parallel import executor
    from jalapeno_emu.validation.points import load_points
    from jalapeno_emu.validation.run import parse_rows, run_validation

    rows = parse_rows(args.rows, len(load_points())) if args.rows is not None else None
    mtp = speculation_from_args(args)  # 0: rows measured with MTP on are predicted without it
    progress = Progress(TextColumn("validate {task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=app.err_console, transient=True, disable=app.json_output)
    with executor(args.workers, args.scheduler) as ex, progress:
        task = progress.add_task("", total=None)
        doc = run_validation(
            rows,
            calibrate=not args.no_calibrate,
            on_plan=lambda n: progress.update(task, total=n),
            progress=lambda label: progress.update(task, advance=1, description=label),
            executor=ex,
            mtp=mtp,
        )
    doc = _clean(doc)
    if app.json_output:
        app.emit_json("validate", doc)
        return 0
    app.console.print(_rows_table(doc["rows"], not args.no_calibrate))
    _print_summary(app, doc)
    return 0
