"""Run a registered kernel: legality and safety checks, timing, optional functional check."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec, load_preset
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.timeline import Timeline
from jalapeno_emu.emu.timing import run_timing

from .base import KernelBuild
from .registry import get_kernel

__all__ = ["KernelReport", "run_kernel"]


@dataclass
class KernelReport:
    """What ``kernel NAME`` reports.

    Attributes:
        name, preset, shape: what ran.
        summary: ``Timeline.summary()`` (time_s, hbm_bytes, flops, hbm_utilization,
            mxu_utilization, bound, ...).
        check: with ``check=True``: max_abs_error, max_rel_error, tolerance, passed (and per
            output the same); None otherwise.
        timeline: the Timeline (for traces).
        build: the KernelBuild.
    """

    name: str
    preset: str
    shape: dict[str, Any]
    summary: dict[str, Any]
    timeline: Timeline
    build: KernelBuild
    check: dict[str, Any] | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The JSON form: the summary's headline fields at top level, plus shape and check."""
        s = self.summary
        out = {
            "kernel": self.name, "preset": self.preset, "shape": self.shape,
            "instructions": s["instructions"], "time_s": s["time_s"], "hbm_bytes": s["hbm_bytes"],
            "flops": s["flops"], "hbm_utilization": s["hbm_utilization"],
            "hbm_utilization_of_achievable": s["hbm_utilization_of_achievable"],
            "mxu_utilization": s["mxu_utilization"],
            "mxu_utilization_of_format_peak": s["mxu_utilization_of_format_peak"], "bound": s["bound"],
            "why": s["why"], "lower_bound_s": s["lower_bound_s"], "critical_engine": s["critical_engine"],
            "cores_used": s["cores_used"], "cores_total": s["cores_total"],
            "critical_fixed_s": s["critical_fixed_s"],
            "critical_fixed_by_kind_s": s["critical_fixed_by_kind_s"],
            "busy_s_by_unit": _busy_by_unit(s["busy_s"]), "notes": self.notes,
        }
        if self.check is not None:
            out.update(self.check)
        return out


def _busy_by_unit(busy_s: dict[str, float]) -> dict[str, float]:
    """Per unit kind (dma, mxu, vpu, link), the busiest engine's busy time, s: what a table can
    show of a per-engine map with hundreds of entries."""
    out: dict[str, float] = {}
    for engine, t in busy_s.items():
        unit = "link" if engine == "link" else engine.split(".", 1)[1].rstrip("0123456789")
        out[unit] = max(out.get(unit, 0.0), t)
    return out


def _compare(got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> dict[str, Any]:
    g = np.asarray(got, np.float64)
    w = np.asarray(want, np.float64)
    if g.shape != w.shape:
        raise ValueError(f"output shape {g.shape} != reference shape {w.shape}")
    err = np.abs(g - w)
    both_nan = np.isnan(g) & np.isnan(w)
    err = np.where(both_nan, 0.0, err)
    rel = np.where(w != 0, err / np.abs(np.where(w != 0, w, 1)), np.where(err == 0, 0.0, np.inf))
    ok = bool(np.all(err <= atol + rtol * np.abs(w)))
    return {"max_abs_error": float(np.nanmax(err)) if err.size else 0.0,
            "max_rel_error": float(np.nanmax(rel)) if rel.size else 0.0, "passed": ok}


def run_kernel(name: str, shape: dict[str, Any] | None = None, *, preset: str | ChipSpec = "tiny",
               check: bool = False, seed: int = 0, safety_checks: bool = True) -> KernelReport:
    """Build, check and time kernel ``name``; with ``check``, run it and compare with the reference.

    Args:
        name: a registered kernel.
        shape: shape keys to override (typed values); the rest take their defaults.
        preset: chip preset name or spec.
        check: also run the functional pass and compare every output with the reference.
        seed: input seed for ``check``.
        safety_checks: run ``check_program`` (races, uninitialised reads, bounds) before timing.
            Turning it off saves most of the time of a full-size timing-only run (the builder
            still checks legality and capacity, and the timing pass still detects deadlocks).

    Raises:
        InvalidArgumentError: unknown kernel or shape key, impossible shape.
        ProgramError subclasses: the built program is illegal (a kernel bug).
    """
    kdef = get_kernel(name)
    spec = load_preset(preset) if isinstance(preset, str) else preset
    full = kdef.shape(shape)
    build = kdef.build(full, spec)
    if safety_checks or check:
        check_program(build.program, spec)
    timeline = run_timing(build.program, spec)
    report = KernelReport(kdef.name, spec.name, full, timeline.summary(), timeline, build,
                          notes=dict(build.notes))
    if check:
        inputs = build.make_inputs(seed)
        from jalapeno_emu.emu.functional import run_functional  # JAX: loaded when a check runs

        result = run_functional(build.program, inputs)
        want = build.reference(inputs)
        per_output = {}
        for out, (dtype, oshape) in build.outputs.items():
            got = result.read(out, dtype, oshape, space="hbm")
            per_output[out] = _compare(got, want[out], build.tolerance.atol, build.tolerance.rtol)
        report.check = {
            "max_abs_error": max(v["max_abs_error"] for v in per_output.values()),
            "max_rel_error": max(v["max_rel_error"] for v in per_output.values()),
            "tolerance": {"atol": build.tolerance.atol, "rtol": build.tolerance.rtol,
                          "why": build.tolerance.why},
            "passed": all(v["passed"] for v in per_output.values()),
            "outputs": per_output,
        }
    return report
