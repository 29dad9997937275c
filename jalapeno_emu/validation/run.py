"""Predict every measured point, calibrate the GPU timing knobs per family, report the errors.

Stage: validation, the engine behind ``jalapeno-emu validate``.

A row is predicted with :func:`jalapeno_emu.rack.deployment.predict` on its preset at its
ISL/OSL/concurrency, within one 8-GPU node (the preset's scale-up domain): the stated TP8 mapping
where the source gives it, else the best mapping for throughput per GPU over 1 to 8 GPUs (the
points are each GPU's highest-throughput configuration), kernel timings cached on disk. The
serving stack is the one the row's framework names (``serving.stack.stack_for_framework``: vLLM,
SGLang, TensorRT-LLM, Dynamo), else the preset's; a row measured with MTP on is predicted with
``mtp`` (the data does not say how many draft tokens: one by default).

Calibration is per GPU family (NVIDIA: b200, h100, h200; AMD: mi300x, mi325x, mi355x): the knobs
stand for the software stack (CUDA/NCCL/TensorRT-LLM vs ROCm/RCCL) as much as for the silicon, and
one setting shared by a family's presets keeps enough fitted rows per fit. Steps:

1. ``fit`` rows at every setting of the grid (:data:`~jalapeno_emu.validation.retime.DEFAULT_GRID`),
   the preset's own values first (a row that fails there is ``not-predicted`` with the reason);
   ``predicted-only`` rows at the preset's values;
2. per family, the setting of lowest MAPE over its fit rows, and leave-one-out (fit on the others,
   predict the one left out);
3. ``predicted-only`` rows again at their family's calibrated setting.

The presets' files are never changed: calibrated values are reported only.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, NamedTuple

import numpy as np

from jalapeno_emu.chip import ChipSpec, load_preset
from jalapeno_emu.errors import EmuError, InvalidArgumentError
from jalapeno_emu.parallel import ordered_map
from jalapeno_emu.rack.deployment import predict
from jalapeno_emu.rack.launch_timer import install_timer
from jalapeno_emu.serving.speculative import Speculation, speculation
from jalapeno_emu.validation.calibrate import fit_setting, leave_one_out, mape, relative_errors
from jalapeno_emu.validation.points import METRICS, load_points
from jalapeno_emu.validation.retime import DEFAULT_GRID, KnobSetting, knob_spec, setting_timers
from jalapeno_emu.validation.rows import RowPlan, model_config, plan_row

__all__ = ["DEFAULT_MTP", "FAMILIES", "parse_rows", "run_validation"]

FAMILIES = {"b200": "nvidia", "h100": "nvidia", "h200": "nvidia", "mi300x": "amd", "mi325x": "amd",
            "mi355x": "amd"}
"""Preset -> the family whose fit rows calibrate it."""

_COLS = list(METRICS)
DEFAULT_MTP = speculation(1)
"""What rows measured with MTP on are predicted with by default: 1 draft token at the default
acceptance (``serving.speculative``; the data says MTP was on, not how many draft tokens)."""
Progress = Callable[[str], None]


def parse_rows(spec: str, count: int) -> list[int]:
    """1-based row numbers from ``"1-5,17,30"``.

    Raises:
        InvalidArgumentError: not integers or ranges, or outside 1..count.
    """
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        try:
            if dash and not hi:  # "1-": a range without its end
                raise ValueError(part)
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise InvalidArgumentError(f"--rows {spec!r}: {part!r} is not N or N-M") from None
        if not 1 <= a <= b <= count:
            raise InvalidArgumentError(f"--rows {spec!r}: {part!r} is outside rows 1..{count}")
        out.extend(r for r in range(a, b + 1) if r not in out)
    if not out:
        raise InvalidArgumentError(f"--rows {spec!r} selects no row")
    return out


def _predict_row(plan: RowPlan, spec: ChipSpec, mapping: str | None = None) -> tuple[str, np.ndarray]:
    """(mapping, float[M] predicted metrics) of ``plan`` on ``spec``; ``mapping`` (else the row's
    stated one, else the best for throughput per GPU on one node)."""
    p = plan.point
    assert p.concurrency is not None
    # Without a stated mapping, every GPU count of the node is searched (1 to 8 on the HGX and
    # MI300-series presets, whose scale-up domain is the node): an InferenceX point is the best
    # throughput per GPU at its concurrency, often on fewer than all eight GPUs.
    if plan.stack is not None and plan.stack != spec.software.stack:
        spec = spec.replace(**{"software.stack": plan.stack})
    pred = predict(model_config(plan), spec, p.isl, p.osl, p.concurrency, mapping=mapping or plan.mapping,
                   objective="throughput", disk_cache=True, speculation=plan.speculation)
    d = pred.as_dict()
    vals = [d[METRICS[c]] for c in _COLS]
    return pred.mapping.name, np.array([math.nan if v is None else float(v) for v in vals])


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if isinstance(exc, EmuError) else f"internal error (a bug) {type(exc).__name__}: {text}"


class _Group:
    """Timers of one preset and its knob settings, wired to build each Program once
    (:func:`~jalapeno_emu.validation.retime.setting_timers`) and installed as the shared timers
    the rack step model picks up."""

    def __init__(self, preset: str, grid: Sequence[KnobSetting]) -> None:
        self.spec = load_preset(preset)
        self.base, self.timers = setting_timers(self.spec, list(grid), disk_cache=True)
        self.specs: dict[KnobSetting, ChipSpec] = {}
        for setting, timer in self.timers.items():
            self.specs[setting] = timer.spec
            install_timer(timer, disk_cache=True)

    def spec_of(self, setting: KnobSetting) -> ChipSpec:
        return self.specs[setting]


_GROUPS: dict[tuple[str, tuple[KnobSetting, ...]], _Group] = {}
_GROUPS_LOCK = threading.Lock()  # threads of one executor share the process's groups


def _group(preset: str, grid: tuple[KnobSetting, ...], fresh: bool) -> _Group:
    """The process's group of ``preset`` on ``grid`` (built by the first row that needs it, so the
    rows a process predicts share its timers as a serial run's rows do), or a new one."""
    with _GROUPS_LOCK:
        if fresh:
            return _Group(preset, grid)
        key = (preset, grid)
        if key not in _GROUPS:
            _GROUPS[key] = _Group(preset, grid)
        return _GROUPS[key]


class _RowResult(NamedTuple):
    """What one row's task found: the mapping served, the metrics per setting (NaN where its
    prediction failed), the one-line failure per setting (None where it succeeded) and the progress
    label of each prediction attempted."""

    mapping: str | None
    values: np.ndarray
    failures: list[str | None]
    labels: list[str]


def _predict_settings(plan: RowPlan, preset: str, grid: tuple[KnobSetting, ...],
                      settings: tuple[KnobSetting, ...], mapping: str | None, fresh: bool,
                      progress: Progress | None) -> _RowResult:
    """One task of :func:`run_validation`: ``plan`` at each of ``settings`` in order (timers of
    ``preset`` on ``grid``), the mapping found at the first kept at the others; a failure at the
    first setting stops the row. ``progress`` is called after each prediction (in this process)."""
    g = _group(preset, grid, fresh)
    values = np.full((len(settings), len(_COLS)), np.nan)
    failures: list[str | None] = [None] * len(settings)
    labels: list[str] = []
    for k, setting in enumerate(settings):
        try:
            # The mapping is searched at the preset's own knobs and kept at the other
            # settings: a knob moves the times of a deployment, not which one is served
            # (and a search per setting would multiply the cost by the grid's size).
            mapping, values[k] = _predict_row(plan, g.spec_of(setting), mapping)
        except Exception as exc:  # every failure becomes the row's reason
            failures[k] = _one_line(exc)
            if k == 0:
                break
        finally:
            labels.append(f"row {plan.point.row} {preset} {setting.label}")
            if progress is not None:
                progress(labels[-1])
    return _RowResult(mapping, values, failures, labels)


def _identity(grid: Sequence[KnobSetting], spec: ChipSpec) -> int:
    for i, s in enumerate(grid):
        if knob_spec(spec, s) is spec:
            return i
    raise InvalidArgumentError(f"the knob grid lacks {spec.name}'s own values (0.9, x1, 0.85, x1)")


def run_validation(
    rows: Sequence[int] | None = None,
    *,
    grid: Sequence[KnobSetting] = DEFAULT_GRID,
    calibrate: bool = True,
    progress: Progress | None = None,
    on_plan: Callable[[int], None] | None = None,
    executor: Executor | None = None,
    mtp: Speculation | None = DEFAULT_MTP,
) -> dict[str, Any]:
    """Predict the selected rows (all when None), calibrate and report (see the module docstring).

    Args:
        rows: 1-based CSV rows; grid: the knob settings; calibrate: False predicts at the
            presets' own values only; progress: called after each prediction with a label (with
            an executor, for each prediction of a row as the row's task completes; always in the
            calling thread); on_plan: called once with the number of predictions planned.
        executor: where the rows' predictions run, one task per row with all its knob settings
            (:mod:`jalapeno_emu.parallel`); None: one after the other in this process.
            Calibration runs here, on the gathered predictions.
        mtp: the speculative decoding rows measured with MTP on are predicted with (the data does
            not say how many draft tokens; default :data:`DEFAULT_MTP`); None: without MTP.

    Returns:
        JSON-ready dict: ``rows`` (one record per selected row), ``summary`` (MAPE before and
        after calibration, leave-one-out, calibrated knobs per family), ``grid``, ``wall_s``.
    """
    t0 = time.perf_counter()
    points = load_points()
    chosen = [points[r - 1] for r in rows] if rows else points
    plans = [plan_row(p) for p in chosen]
    plans = [dataclasses.replace(p, speculation=mtp) if p.speculation is not None else p for p in plans]
    grid = list(grid)
    ids = {name: _identity(grid, load_preset(name)) for name in {p.preset for p in plans if p.preset}}
    n_set = len(grid) if calibrate else 1
    on_plan and on_plan(sum(n_set if p.cls == "fit" else 1 for p in plans if p.cls != "not-predicted"))
    P = np.full((len(grid), len(plans), len(_COLS)), np.nan)
    measured = np.array([[p.point.measured().get(c, np.nan) for c in _COLS] for p in plans])
    cls = [p.cls for p in plans]
    reasons = [list(p.reasons) for p in plans]
    mappings: list[str | None] = [None] * len(plans)
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(plans):
        if p.cls != "not-predicted":
            groups.setdefault(p.preset or "", []).append(i)
    with _GROUPS_LOCK:
        _GROUPS.clear()  # a run builds its timers afresh, as it always has in this process
    # A task in this process reports each prediction as it is made; one elsewhere cannot call
    # back, so its labels are reported here as it completes.
    live = progress if executor is None else None
    slots: list[tuple[int, list[int]]] = []  # (row index, grid index of each setting) per task
    tasks = []
    for preset, members in groups.items():
        group_grid = tuple(grid if calibrate else grid[ids[preset]:ids[preset] + 1])
        for i in members:
            order = [ids[preset]] + ([s for s in range(len(grid)) if s != ids[preset]]
                                     if calibrate and cls[i] == "fit" else [])
            slots.append((i, order))
            tasks.append((plans[i], preset, group_grid, tuple(grid[s] for s in order), None, False, live))

    def replay(_j: int, result: _RowResult) -> None:
        if progress is not None and live is None:
            for label in result.labels:
                progress(label)

    ran = ordered_map(_predict_settings, tasks, executor=executor, on_result=replay)
    for (i, order), r in zip(slots, ran, strict=True):
        mappings[i] = r.mapping
        P[order, i] = r.values
        if r.failures[0] is not None:
            cls[i], reasons[i] = "not-predicted", [*reasons[i], r.failures[0]]
    summary, calibrated = _summarise(plans, cls, P, measured, grid, ids, calibrate)
    # The predicted-only rows again at their family's calibrated knobs, each with timers of its own.
    again = [(i, s) for i in _predicted_only(cls)
             if (s := calibrated.get(FAMILIES[plans[i].preset or ""])) is not None
             and s != ids[plans[i].preset or ""]]
    tasks = [(plans[i], plans[i].preset or "", (grid[s],), (grid[s],), mappings[i], True, None)
             for i, s in again]
    for (i, s), r in zip(again, ordered_map(_predict_settings, tasks, executor=executor), strict=True):
        P[s, i] = r.values[0]
        if r.failures[0] is not None:  # reported with the row
            reasons[i].append(f"at the calibrated knobs: {r.failures[0]}")
    summary["mape_predicted_only"] = _mape_block(
        _predicted_only(cls), P, measured, [ids.get(p.preset or "", 0) for p in plans],
        [calibrated.get(FAMILIES.get(p.preset or "", ""), -1) for p in plans])
    records = [_record(i, plans[i], cls[i], reasons[i], mappings[i], P, measured, ids, calibrated, summary)
               for i in range(len(plans))]
    return {"rows": records, "summary": summary, "grid": [s.label for s in grid],
            "wall_s": time.perf_counter() - t0}


def _predicted_only(cls: Sequence[str]) -> list[int]:
    return [i for i, c in enumerate(cls) if c == "predicted-only"]


def _errs(P: np.ndarray, measured: np.ndarray, i: int, s: int) -> np.ndarray:
    return relative_errors(P[s, i], measured[i]) if s >= 0 else np.full(len(_COLS), np.nan)


def _mape_block(idx: Sequence[int], P: np.ndarray, measured: np.ndarray, before: Sequence[int],
                after: Sequence[int]) -> dict[str, Any]:
    b = np.array([_errs(P, measured, i, before[i]) for i in idx]).reshape(-1, len(_COLS))
    a = np.array([_errs(P, measured, i, after[i]) for i in idx]).reshape(-1, len(_COLS))
    return {"rows": len(idx), "before": mape(b), "after": mape(a) if any(x >= 0 for x in after) else None,
            "before_per_metric": dict(zip(_COLS, np.atleast_1d(mape(b, axis=(0,))).tolist(), strict=True))
            if len(idx) else {}}


def _summarise(plans, cls, P, measured, grid, ids, calibrate) -> tuple[dict[str, Any], dict[str, int]]:
    """Per family: calibrated setting, MAPE before/after, LOO; overall fit-row MAPE."""
    fams: dict[str, Any] = {}
    calibrated: dict[str, int] = {}
    loo_all: list[np.ndarray] = []
    before_all, after_all = [], []
    rows_all: list[int] = []  # the fit rows of loo_all, in its order
    for fam in sorted(set(FAMILIES.values())):
        idx = [i for i, p in enumerate(plans) if cls[i] == "fit" and FAMILIES.get(p.preset or "") == fam]
        if not idx:
            continue
        before = np.array([_errs(P, measured, i, ids[plans[i].preset]) for i in idx])
        before_all.append(before)
        entry: dict[str, Any] = {"fit_rows": [plans[i].point.row for i in idx], "mape_before": mape(before)}
        if calibrate:
            s, per_setting = fit_setting(P, measured, idx)
            calibrated[fam] = s
            after = relative_errors(P[s][idx], measured[idx])
            after_all.append(after)
            loo, chosen = leave_one_out(P, measured, idx)
            loo_all.append(loo)
            rows_all.extend(plans[i].point.row for i in idx)
            presets = sorted({plans[i].preset for i in idx})
            entry.update(
                setting=grid[s].as_dict(), setting_label=grid[s].label, mape_after=mape(after),
                loo_mape=mape(loo), loo_settings=[grid[c].label if c >= 0 else None for c in chosen],
                loo_setting_indices=chosen,
                knobs={p: grid[s].values(load_preset(p)) for p in presets},
                mape_per_setting=dict(zip([g.label for g in grid], per_setting.tolist(), strict=True)),
            )
        fams[fam] = entry
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros((0, len(_COLS)))  # noqa: E731
    summary = {
        "metrics": {c: METRICS[c] for c in _COLS},
        "families": fams,
        "mape_fit": {"rows": sum(len(f["fit_rows"]) for f in fams.values()), "before": mape(cat(before_all)),
                     "after": mape(cat(after_all)) if calibrate else None,
                     "loo": mape(cat(loo_all)) if calibrate else None},
        "classes": {c: cls.count(c) for c in ("fit", "predicted-only", "not-predicted")},
        "per_metric": _per_metric(cat(before_all), cat(after_all) if calibrate else None,
                                  cat(loo_all) if calibrate else None, rows_all),
    }
    return summary, calibrated


def _per_metric(before: np.ndarray, after: np.ndarray | None, loo: np.ndarray | None,
                loo_rows: list[int]) -> dict[str, dict[str, Any]]:
    """Per metric over the fit rows: the median absolute error before and after calibration and
    left out, and the row of the worst leave-one-out error (each metric its own figures, not one
    pooled number)."""
    out: dict[str, dict[str, Any]] = {}
    for m, metric in enumerate(_COLS):
        entry: dict[str, Any] = {"field": METRICS[metric], "median_before": mape(before[:, m])}
        if after is not None and loo is not None:
            col = np.abs(loo[:, m])
            valued = np.where(np.isnan(col), -1.0, col)
            worst = int(np.argmax(valued)) if valued.size and valued.max() >= 0 else None
            entry.update(median_after=mape(after[:, m]), median_loo=mape(loo[:, m]),
                         rows=int(np.sum(~np.isnan(loo[:, m]))),
                         worst_loo_row=None if worst is None else loo_rows[worst],
                         worst_loo=None if worst is None else float(loo[worst, m]))
        out[metric] = entry
    return out


def _metric_dict(v: np.ndarray) -> dict[str, float | None]:
    return {c: (None if not math.isfinite(x) else float(x)) if not math.isinf(x) else None
            for c, x in zip(_COLS, v.tolist(), strict=True)}


def _record(i, plan, cls, reasons, mapping, P, measured, ids, calibrated, summary) -> dict[str, Any]:
    p = plan.point
    rec: dict[str, Any] = {
        "row": p.row, "hardware": p.hardware, "model": p.model, "precision": p.precision, "isl": p.isl,
        "osl": p.osl, "concurrency": p.concurrency, "framework": p.framework, "mtp": p.mtp,
        "preset": plan.preset, "config": plan.model, "expert_weight_fmt": plan.expert_weight_fmt,
        "weight_fmt": plan.weight_fmt, "stated_mapping": plan.mapping, "mapping": mapping, "class": cls,
        "stack": plan.stack,
        "mtp_predicted": None if plan.speculation is None else plan.speculation.as_dict(),
        "reasons": reasons, "hardware_note": plan.hardware_note, "format_note": plan.format_note,
        "measured": _metric_dict(measured[i]),
    }
    if cls != "not-predicted" and plan.preset:
        s0 = ids[plan.preset]
        rec["predicted"] = _metric_dict(P[s0, i])
        rec["error"] = _metric_dict(_errs(P, measured, i, s0))
        s = calibrated.get(FAMILIES[plan.preset])
        if s is not None:
            rec["predicted_calibrated"] = _metric_dict(P[s, i])
            rec["error_calibrated"] = _metric_dict(_errs(P, measured, i, s))
        fam = summary["families"].get(FAMILIES[plan.preset], {})
        if cls == "fit" and "loo_settings" in fam:
            k = fam["fit_rows"].index(p.row)
            loo_s = fam["loo_settings"][k]
            rec["loo_setting"] = loo_s
            # this row's error at the knobs fitted without it (NaN with no other row to fit on)
            rec["error_loo"] = _metric_dict(_errs(P, measured, i, fam["loo_setting_indices"][k]))
    return rec
