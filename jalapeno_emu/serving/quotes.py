"""The figures published comparisons quote, read from each chip's frontier: the best throughput at
a matched interactivity, and the peak throughput.

Stage: serving, after the sweeps. Comparisons between accelerators are made at matched user
experience (the best throughput per chip, and per kW, each reaches at X tok/s per user or faster)
and at each one's peak throughput: SemiAnalysis InferenceX (formerly InferenceMAX) plots these
curves and quotes these points (https://github.com/SemiAnalysisAI/InferenceX-app, the blog post
``best-gpu-for-dsr1-inference``; ``jalapeno_emu/validation/data/README.md``). Matching
concurrency instead compares a fast chip at a slow chip's load. Points are the flat dicts of
:meth:`~jalapeno_emu.serving.sweep.SweepPoint.as_dict` (or the points themselves), grouped by
preset; every function here is pure.

Per kW: a chip's power is one number per preset and power kind, so the frontier by throughput per
chip is also its frontier per kW, and per kW is read from the same points.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.serving.metrics import POWER_KINDS
from jalapeno_emu.serving.pareto import X_DEFAULT, Y_DEFAULT, pareto_front, peak_point, point_value, value_at

__all__ = ["at_interactivity", "peaks"]

_KW = "tok_s_per_kw"


def _check_power(power: str) -> str:
    if power not in POWER_KINDS:
        raise InvalidArgumentError(f"power {power!r} is not one of {', '.join(POWER_KINDS)}")
    return power


def _brief(point: Any, power: str) -> dict[str, Any]:
    """What a quote says about a point it was read from."""
    d = point if isinstance(point, Mapping) else point.as_dict()
    return {"mapping": d["mapping"], "chips": d["chips"], "concurrency": d["concurrency"],
            X_DEFAULT: d[X_DEFAULT], Y_DEFAULT: d[Y_DEFAULT], _KW: point_value(d, f"{_KW}.{power}")}


def _ratios(row: dict[str, Any], ref: str, presets: Sequence[str], fields: Sequence[str]) -> dict[str, Any]:
    """ref / preset for each field of each other preset (None where either value is missing)."""
    out: dict[str, Any] = {}
    r = row.get(ref)
    for p in presets:
        if p == ref:
            continue
        o = row.get(p)
        out[p] = {f: (r[f] / o[f] if r and o and r[f] is not None and o[f] else None) for f in fields}
    return out


def at_interactivity(points: Mapping[str, Sequence[Any]], interactivity: float, *, ref: str,
                     power: str = "all_in") -> dict[str, Any]:
    """Each preset's best throughput per chip and per kW at ``interactivity`` tok/s per user or
    faster, from its Pareto front (interactivity against throughput per chip), interpolated
    linearly between the two front points around it (:func:`~jalapeno_emu.serving.pareto.value_at`).

    Args:
        points: preset -> its sweep points (every mapping and concurrency simulated).
        interactivity: the required tok/s per user.
        ref: the preset the ratios are relative to (ref / other: above 1, ref is better).
        power: the power kind of tok/s per kW (``package``, ``sustained``, ``all_in``).

    Returns:
        ``{"interactivity_tok_s_user": x, <preset>: {"throughput_tok_s_per_chip", "tok_s_per_kw",
        "from": [the front points it was read from], "reason": None or why there is no value}, ...,
        "ratios": {<other preset>: {"throughput_tok_s_per_chip", "tok_s_per_kw"}}}``. A preset
        whose fastest point is slower than ``interactivity`` has None values and says so.

    Raises:
        InvalidArgumentError: ``interactivity`` is not a positive finite number, ``power`` unknown.
    """
    power = _check_power(power)
    if (isinstance(interactivity, bool) or not isinstance(interactivity, (int, float))
            or not 0 < interactivity < float("inf")):
        raise InvalidArgumentError(f"interactivity {interactivity!r} must be a positive, finite number of "
                                   "tok/s per user")
    row: dict[str, Any] = {X_DEFAULT: float(interactivity)}
    for preset, pts in points.items():
        front = pareto_front(pts)
        per_chip, used = value_at(front, interactivity)
        per_kw, _ = value_at(front, interactivity, y=f"{_KW}.{power}")
        reason = None
        if per_chip is None:
            fastest = max((point_value(p, X_DEFAULT) or 0.0 for p in pts), default=0.0)
            reason = (f"no point reaches {interactivity:,.1f} tok/s/user: the fastest simulated is "
                      f"{fastest:,.1f}" if pts else "no points")
        row[preset] = {Y_DEFAULT: per_chip, _KW: per_kw, "from": [_brief(p, power) for p in used],
                       "reason": reason}
    row["ratios"] = _ratios(row, ref, list(points), (Y_DEFAULT, _KW))
    return row


def peaks(points: Mapping[str, Sequence[Any]], *, ref: str, power: str = "all_in") -> dict[str, Any]:
    """Each preset's peak throughput per chip (its best point over every mapping and
    concurrency), with that point's tok/s per kW, interactivity, mapping and concurrency.

    Returns:
        ``{<preset>: {"throughput_tok_s_per_chip", "tok_s_per_kw", "interactivity_tok_s_user",
        "mapping", "chips", "concurrency"} or None, ..., "ratios": {<other preset>:
        {"throughput_tok_s_per_chip", "tok_s_per_kw"}}}`` (ref / other).
    """
    power = _check_power(power)
    out: dict[str, Any] = {}
    for preset, pts in points.items():
        best = peak_point(pts)
        out[preset] = _brief(best, power) if best is not None else None
    out["ratios"] = _ratios(out, ref, list(points), (Y_DEFAULT, _KW))
    return out
