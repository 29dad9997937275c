"""What tables and status lines print for people: times in µs, bytes in MB, rates in %, settings
as ``key=value``, the metrics-and-explanation table of one program, and the note saying where a
trace went. ``--json`` output keeps SI units (seconds, bytes, fractions); only text goes here."""

from __future__ import annotations

import math
from typing import Any

from rich.table import Table

from jalapeno_emu.cli.app import App

# The figures every timed program has (``Timeline.summary()``, ``KernelReport.as_dict()``).
_FIXED_KINDS = {"launch": "launch", "dma_setup": "DMA set-up", "hbm_latency": "HBM latency",
                "issue": "compute issue", "link_latency": "link latency"}


def _significant(value: float, digits: int = 4) -> str:
    """``value`` with about ``digits`` significant digits and thousands separators, never in
    exponent form (a table column of ``6.054e-06`` is what people asked not to read)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = min(max(digits - 1 - math.floor(math.log10(abs(value))), 0), 6)
    text = f"{value:,.{decimals}f}"
    # "2.000" reads as more precise than it is meant; "2" and "0.09" read as what they are.
    return text.rstrip("0").rstrip(".") if "." in text else text


def us(seconds: float) -> str:
    """Seconds as microseconds, without the unit: ``6.054``."""
    return _significant(seconds * 1e6)


def mb(nbytes: float) -> str:
    """Bytes as (decimal) megabytes, without the unit: ``0.09523``."""
    return _significant(nbytes / 1e6)


def pct(fraction: float) -> str:
    """A fraction as a percentage with its sign: ``9.8%``; below 1 % two significant digits
    (``0.17%``, ``0.006%``) so that a small utilisation does not read as zero."""
    if fraction == 0 or abs(fraction) >= 1e-2 or not math.isfinite(fraction):
        return f"{fraction:.1%}"
    return f"{_significant(fraction * 100, 2)}%"


def key_values(mapping: dict[str, Any]) -> str:
    """``m=16 n=256 k=512``: a dict as a status line shows it (not as a Python literal)."""
    return " ".join(f"{k}={v}" for k, v in mapping.items())


def trace_note(app: App, path: str) -> None:
    """One line saying where a trace was written and how to open it: on stdout with the tables,
    on stderr under ``--json`` (stdout then holds only the JSON document)."""
    console = app.err_console if app.json_output else app.console
    console.print(f"trace written to {path}: open it in https://ui.perfetto.dev (or chrome://tracing)",
                  markup=False, highlight=False, soft_wrap=True)


def _busiest_by_unit(busy_s: dict[str, float]) -> dict[str, float]:
    """Per unit kind (dma, mxu, vpu, link), the busiest engine's busy time, s, from a per-engine
    map (``c0.dma1`` -> s): the same reduction as ``kernel --json``'s ``busy_s_by_unit``."""
    out: dict[str, float] = {}
    for engine, t in busy_s.items():
        unit = "link" if engine == "link" else engine.split(".", 1)[-1].rstrip("0123456789")
        out[unit] = max(out.get(unit, 0.0), t)
    return out


def metrics_table(title: str, doc: dict[str, Any]) -> Table:
    """The table of one timed program (``kernel NAME``, ``run FILE``) from its JSON figures: time,
    bound, critical engine, cores, HBM traffic and utilisation, FLOPs and MXU utilisation, busy
    time per unit, and the fixed costs on the critical path by kind. Fields a document lacks are
    left out; the ``why`` line goes under the table (:func:`why_line`)."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    t = doc["time_s"]

    def share(seconds: float) -> str:
        return f" ({pct(seconds / t)})" if t else ""

    table.add_row("instructions", f"{doc['instructions']:,}")
    table.add_row("time", f"{us(t)} µs" + (f" ({doc['cycles']:,.0f} cycles)" if "cycles" in doc else ""))
    table.add_row("roofline (lower bound)", f"{us(doc['lower_bound_s'])} µs")
    table.add_row("bound", str(doc["bound"]))
    if doc.get("critical_engine") is not None:
        table.add_row("critical engine", str(doc["critical_engine"]))
    if "cores_used" in doc and "cores_total" in doc:
        table.add_row("cores used", f"{doc['cores_used']} of {doc['cores_total']}")
    table.add_row("HBM traffic", f"{mb(doc['hbm_bytes'])} MB")
    hbm = f"{pct(doc['hbm_utilization'])} of peak"
    if "hbm_utilization_of_achievable" in doc:
        hbm += f", {pct(doc['hbm_utilization_of_achievable'])} of achievable"
    table.add_row("HBM bandwidth used", hbm)
    table.add_row("matrix work", f"{_significant(doc['flops'] / 1e6)} MFLOP")
    mxu = f"{pct(doc['mxu_utilization'])} of MXFP4 peak"
    if "mxu_utilization_of_format_peak" in doc:
        mxu += f", {pct(doc['mxu_utilization_of_format_peak'])} of the formats' peak"
    table.add_row("MXU utilisation", mxu)
    busy = doc.get("busy_s_by_unit")
    if busy is None and "busy_s" in doc:
        busy = _busiest_by_unit(doc["busy_s"])
    for unit, seconds in (busy or {}).items():
        table.add_row(f"busiest {unit} engine busy", f"{us(seconds)} µs{share(seconds)}")
    if "critical_fixed_s" in doc:
        fixed = doc["critical_fixed_s"]
        table.add_row("fixed costs on the critical path", f"{us(fixed)} µs{share(fixed)}")
        for kind, seconds in doc.get("critical_fixed_by_kind_s", {}).items():
            if seconds > 0:
                table.add_row(f"  {_FIXED_KINDS.get(kind, kind)}", f"{us(seconds)} µs")
    return table


def why_line(doc: dict[str, Any]) -> str | None:
    """``why: ...`` under a table, from the document's ``why`` (None when it has none)."""
    why = doc.get("why")
    return None if not why else f"why: {why}"


PATH_SHOWN_FRACTION = 0.01
"""``--path`` tables show the runs that add at least this fraction of the path; the runs between
two shown ones fold into one row (``--json`` keeps every run)."""


def path_table(title: str, runs: list[dict[str, Any]]) -> Table:
    """The critical path (``emu.critical_path.PathRun.as_dict()`` rows, first to last) as a table:
    what waited on what, the µs each run adds and when it ran, with short runs folded."""
    total = sum(r["critical_s"] for r in runs)
    table = Table(title=title)
    for col, justify in (("operator", "left"), ("engine", "left"), ("instructions", "left"),
                         ("adds µs", "right"), ("cause", "left"), ("at µs", "right"), ("issued at", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    folded: list[dict[str, Any]] = []

    def fold() -> None:
        if folded:
            n = sum(r["count"] for r in folded)
            table.add_row("", "", f"... {len(folded)} short run(s), {n} instruction(s)",
                          us(sum(r["critical_s"] for r in folded)), "", "", "", style="dim")
            folded.clear()

    for r in runs:
        if r["critical_s"] < PATH_SHOWN_FRACTION * total:
            folded.append(r)
            continue
        fold()
        what = r["mnemonic"] if r["count"] == 1 else f"{r['mnemonic']} x{r['count']}"
        table.add_row(r["operator"], r["engine"], what, us(r["critical_s"]), r["cause"],
                      f"{us(r['start_s'])}..{us(r['end_s'])}", r["source"])
    fold()
    return table
