"""The InferenceX-style plot: interactivity (tok/s/user) against throughput per chip (or per kW).

Stage: serving. One colour per series (chip/preset), every point drawn faint, each series'
Pareto frontier as a line with markers labelled with its concurrency. Drawn on a bare matplotlib
``Figure`` with the Agg canvas (no pyplot state, never a window) and written through
:func:`~jalapeno_emu.serving.output.atomic_write`, so a PNG or SVG is complete or absent.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.serving.output import atomic_write
from jalapeno_emu.serving.pareto import X_DEFAULT, Y_DEFAULT, pareto_fronts, point_value

__all__ = ["axis_label", "plot_pareto"]

_LABELS = {
    "interactivity_tok_s_user": "Interactivity (tok/s/user)",
    "throughput_tok_s_per_chip": "Throughput per chip (tok/s/chip)",
    "tok_s_per_kw.package": "Throughput per kW, package TDP (tok/s/kW)",
    "tok_s_per_kw.sustained": "Throughput per kW, sustained draw (tok/s/kW)",
    "tok_s_per_kw.all_in": "Throughput per kW, all-in facility (tok/s/kW)",
}


def axis_label(key: str) -> str:
    """A readable axis label for a metric key."""
    return _LABELS.get(key, key)


def _fields(point: Any) -> dict[str, Any]:
    return dict(point) if isinstance(point, dict) else point.as_dict()


def _title(points: Sequence[Any], model_name: str | None) -> str:
    first = _fields(points[0])
    lengths = {(_fields(p)["isl"], _fields(p)["osl"]) for p in points}
    isl_osl = f"ISL/OSL {first['isl']}/{first['osl']}" if len(lengths) == 1 else "mixed ISL/OSL"
    return f"{model_name} — {isl_osl}" if model_name else isl_osl


def plot_pareto(points: Sequence[Any], path_png: str | os.PathLike[str] | None,
                path_svg: str | os.PathLike[str] | None = None, *, x: str = X_DEFAULT, y: str = Y_DEFAULT,
                model_name: str | None = None, title: str | None = None, log_x: bool = False,
                annotate: bool = True) -> None:
    """Draw the points and each series' frontier, and write PNG and/or SVG.

    Args:
        points: :class:`~jalapeno_emu.serving.sweep.SweepPoint` objects or their flat dicts.
        path_png, path_svg: output files (either may be None, not both).
        x, y: metric keys (dotted for nested fields, e.g. ``"tok_s_per_kw.all_in"``).
        model_name: shown in the title with the ISL/OSL of the points.
        title: replaces the generated title.
        log_x: logarithmic interactivity axis.
        annotate: label frontier markers with their concurrency.
    """
    if not points:
        raise InvalidArgumentError("plot_pareto needs at least one point")
    if path_png is None and path_svg is None:
        raise InvalidArgumentError("plot_pareto needs path_png or path_svg")
    for key in (x, y):
        point_value(points[0], key)  # an unknown metric raises before anything is drawn
    figure = _draw(points, x, y, title or _title(points, model_name), log_x, annotate)
    for path, fmt in ((path_png, "png"), (path_svg, "svg")):
        if path is not None:
            atomic_write(path, lambda f, fmt=fmt: figure.savefig(f, format=fmt, dpi=150))


def _draw(points: Sequence[Any], x: str, y: str, title: str, log_x: bool, annotate: bool) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5.5), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    fronts = pareto_fronts(points, x, y, by="series")
    for index, (series, front) in enumerate(fronts.items()):
        colour = f"C{index % 10}"
        members = [p for p in points if str(_fields(p)["series"]) == series]
        xs, ys = _values(members, x, y)
        ax.scatter(xs, ys, color=colour, alpha=0.25, s=18, linewidths=0)
        fx, fy = _values(front, x, y)
        ax.plot(fx, fy, color=colour, marker="o", markersize=5, linewidth=1.8, label=series)
        if annotate:
            for p, px, py in zip(front, fx, fy, strict=True):
                ax.annotate(str(_fields(p)["concurrency"]), (px, py), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=colour)
    if log_x:
        from matplotlib.ticker import FuncFormatter

        ax.set_xscale("log")
        # plain numbers (50, 100, 200) rather than powers of ten: interactivity spans ~1-2 decades
        plain = FuncFormatter(lambda value, _pos: f"{value:g}")
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(plain)
    ax.set_xlabel(axis_label(x))
    ax.set_ylabel(axis_label(y))
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(title="frontier (labels: concurrency)" if annotate else "frontier", fontsize=8)
    return figure


def _values(points: Sequence[Any], x: str, y: str) -> tuple[list[float], list[float]]:
    pairs = [(point_value(p, x), point_value(p, y)) for p in points]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    return [a for a, _ in pairs], [b for _, b in pairs]
