"""Layer and step times of fused programs (``--fusion layer`` and ``--fusion step``).

Stage: model, beside ``timing.py`` (which times ``--fusion none``: launches back to back). Every
figure comes from the timing pass over one fused Program (``model.fused``); what this module adds
is how a layer's time is read off a program that overlaps layers:

- ``layer``: the layer is its own program (one launch; input from HBM, output to HBM): its time
  is the program's.
- ``step``: a layer's time is the stretch between the end of the previous layer's last operator
  and the end of its own, measured in a program that holds the layers around it (weights of the
  next layer stream during it, as in the whole step). Each operator's entry is its share of that
  stretch's critical path (``emu.phases``), with its bytes and bound.

**A whole step.** A step program grows with the layers (tens of thousands of instructions per
layer); until programs get loops, a step of many layers is timed from two windows: the head and
the first layers (warm-up plus two periods of the layer pattern, e.g. gpt-oss's sliding/full
pair), and the last two layers with the tail. The layers between repeat the last period's
steady-state times: the step is the first window's time to its last layer, plus a steady time
per layer after it, plus the tail's stretch. Models with few layers (and any model with
``whole=True``) are timed as one program; ``tests/model/test_fused_timing.py`` measures the two
against each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.emu.phases import phase_figures, region_of_instructions, why_of_causes
from jalapeno_emu.emu.timeline import Timeline
from jalapeno_emu.emu.timing import run_timing

from .config import ModelConfig
from .footprint import footprint
from .fused import FusedBuild, build_fused, layer_windows
from .plan import Step, layer_launches
from .timing import KernelTiming, LayerTiming, ModelTiming, gc_paused, layer_kind

__all__ = ["WHOLE_STEP_LAYERS", "fused_layer_timing", "fused_model_timing", "sum_groups"]

WHOLE_STEP_LAYERS = 8
"""Models with at most this many layers are timed as one whole-step program."""


def _op_ends(tl: Timeline) -> dict[str, tuple[int, float]]:
    """Region name -> (index of its last-ending instruction, that end time, s)."""
    names, owner = region_of_instructions(tl)
    out = {}
    for k, name in enumerate(names):
        idx = np.flatnonzero(owner == k)
        if len(idx):
            j = int(idx[np.argmax(tl.end_s[idx])])
            out[name] = (j, float(tl.end_s[j]))
    return out


def _kernel_entries(tl: Timeline, fb: FusedBuild, labels: Sequence[str], *, end_instruction: int,
                    start_s: float) -> list[KernelTiming]:
    """Per operator of ``labels``: its share of the window's critical path and its figures."""
    d = tl.spec.derived()
    phases = {p.name: p for p in phase_figures(tl, end_instruction=end_instruction, start_s=start_s,
                                               names=list(labels))}
    out = []
    for label in labels:
        p = phases.get(label)
        if p is None:
            continue
        _, launch = fb.ops.get(label, (None, None))
        span = max(p.end_s - p.start_s, 1e-30)
        out.append(KernelTiming(
            label=label.split(".", 1)[1] if "." in label else label,
            kernel=launch.kernel if launch is not None else "store",
            shape=launch.shape_dict if launch is not None else {},
            time_s=p.critical_s, hbm_bytes=p.hbm_bytes, flops=p.flops,
            hbm_utilization=p.hbm_bytes / span / d["hbm_bytes_per_s"],
            hbm_utilization_of_achievable=p.hbm_bytes / span / d["hbm_achievable_bytes_per_s"],
            mxu_utilization=p.flops / span / d["peak_mxfp4_flops_per_s"],
            bound=p.bound, lower_bound_s=p.lower_bound_s, instructions=p.instructions,
            flops_by_format=p.flops_by_format, span_s=span, by_cause_s=p.by_cause_s,
            why=p.why, critical_engine=p.critical_engine, cores_used=p.cores_used))
    return out


def _figures(time_s: float, hbm: float, flops: float, fmt: dict[str, float], causes: dict[str, float],
             spec: ChipSpec, **extra: Any) -> dict[str, Any]:
    """Totals over ``time_s``: utilisations, the bound with the most critical-path seconds, and
    the roofline of the work (bytes at the achievable HBM rate or FLOPs at peak per format)."""
    d = spec.derived()
    compute = sum(v / d[f"peak_{f}_flops_per_s"] for f, v in fmt.items())
    rate = (lambda x, peak: x / time_s / peak) if time_s else (lambda x, peak: 0.0)
    return {
        "time_s": time_s, "hbm_bytes": hbm, "flops": flops,
        "hbm_utilization": rate(hbm, d["hbm_bytes_per_s"]),
        "hbm_utilization_of_achievable": rate(hbm, d["hbm_achievable_bytes_per_s"]),
        "mxu_utilization": rate(flops, d["peak_mxfp4_flops_per_s"]),
        "bound": max(causes, key=causes.get) if causes else "latency", "time_by_bound_s": causes,
        "why": why_of_causes(causes), "mxu_utilization_of_format_peak": compute / time_s if time_s else 0.0,
        "lower_bound_s": max(hbm / d["hbm_achievable_bytes_per_s"], compute), "flops_by_format": fmt,
        **extra,
    }


def _add(into: dict[str, float], more: dict[str, float] | None) -> None:
    for k, v in (more or {}).items():
        into[k] = into.get(k, 0.0) + v


def _totals(kernels: Sequence[KernelTiming], time_s: float, spec: ChipSpec, *, fusion: str,
            launch_s: float) -> dict[str, Any]:
    """A fused layer's totals: bytes and FLOPs of its operators over ``time_s``."""
    fmt: dict[str, float] = {}
    causes: dict[str, float] = {}
    for k in kernels:
        _add(fmt, k.flops_by_format)
        _add(causes, k.by_cause_s)
    if launch_s:
        _add(causes, {"latency": launch_s})
    return _figures(time_s, sum(k.hbm_bytes for k in kernels), sum(k.flops for k in kernels), fmt, causes,
                    spec, fusion=fusion, launch_s=launch_s)


def fused_layer_timing(cfg: ModelConfig, layer: int, step: Step, spec: ChipSpec, fusion: str) -> LayerTiming:
    """One decoder layer's time under ``fusion`` ("layer" or "step"; see the module docstring)."""
    with gc_paused():
        if fusion == "layer":
            fb = build_fused(cfg, step, spec, layers=[layer], head=False, tail=False,
                             name=f"{cfg.name}_L{layer}_{step.phase}")
            tl = run_timing(fb.program, spec)
            labels = [label for ops in fb.layer_ops.values() for label in ops]
            end = int(np.argmax(tl.end_s))
            kernels = _kernel_entries(tl, fb, labels, end_instruction=end, start_s=0.0)
            totals = _totals(kernels, tl.time_s, spec, fusion=fusion, launch_s=tl.launch_s)
            return LayerTiming(layer=layer, kind=layer_kind(cfg, layer), kernels=tuple(kernels),
                               totals=totals, timelines=(tl,))
        a, b = max(0, layer - 2), min(cfg.layers - 1, layer + 1)
        fb = build_fused(cfg, step, spec, layers=range(a, b + 1), head=a == 0, tail=False,
                         name=f"{cfg.name}_L{a}-{b}_{step.phase}")
        tl = run_timing(fb.program, spec)
    return _window_layer(cfg, fb, tl, layer, spec)


def _window_layer(cfg: ModelConfig, fb: FusedBuild, tl: Timeline, layer: int, spec: ChipSpec) -> LayerTiming:
    """Layer ``layer``'s stretch of a step-fused program: from the end of the layer (or head)
    before it to the end of its own last operator."""
    ends = _op_ends(tl)
    end_i, end_t = ends[fb.layer_ops[layer][-1]]
    prev = layer - 1 if layer - 1 in fb.layer_ops else -1
    start = ends[fb.layer_ops[prev][-1]][1] if prev in fb.layer_ops else 0.0
    kernels = _kernel_entries(tl, fb, fb.layer_ops[layer], end_instruction=end_i, start_s=start)
    totals = _totals(kernels, end_t - start, spec, fusion="step", launch_s=0.0)
    return LayerTiming(layer=layer, kind=layer_kind(cfg, layer), kernels=tuple(kernels), totals=totals,
                       timelines=(tl,), window=(end_i, start))


def _group_stretch(cfg: ModelConfig, fb: FusedBuild, tl: Timeline, group: int, kind: str, spec: ChipSpec,
                   start: float, end_i: int, end_t: float) -> LayerTiming:
    kernels = _kernel_entries(tl, fb, fb.layer_ops[group], end_instruction=end_i, start_s=start)
    launch = tl.launch_s if group == -1 else 0.0
    totals = _totals(kernels, end_t - start + launch, spec, fusion="step", launch_s=launch)
    return LayerTiming(layer=group if group >= 0 else -1, kind=kind, kernels=tuple(kernels), totals=totals,
                       timelines=(tl,), window=(end_i, start))


def fused_model_timing(cfg: ModelConfig, step: Step, spec: ChipSpec, fusion: str, *,
                       whole: bool | None = None) -> ModelTiming:
    """A whole step under ``fusion`` ("layer" or "step"; see the module docstring).

    Args:
        whole: time the step as one program whatever its size (default: only models of at most
            ``WHOLE_STEP_LAYERS`` layers; others from two windows).
    """
    n = cfg.layers
    plans: dict[tuple, list[int]] = {}
    for i in range(n):
        plans.setdefault(layer_launches(cfg, i, step), []).append(i)
    fp = footprint(cfg, spec, batch=step.batch, tokens=step.positions)
    if fusion == "layer":
        with gc_paused():
            groups = tuple((tuple(idx), fused_layer_timing(cfg, idx[0], step, spec, "layer"))
                           for idx in plans.values())
            head_fb = build_fused(cfg, step, spec, layers=[], head=True, tail=False, name=f"{cfg.name}_head")
            tail_fb = build_fused(cfg, step, spec, layers=[], head=False, tail=True, name=f"{cfg.name}_tail")
            head_tl, tail_tl = run_timing(head_fb.program, spec), run_timing(tail_fb.program, spec)
        head = _whole_group(head_fb, head_tl, -1, "head", spec)
        tail = _whole_group(tail_fb, tail_tl, n, "tail", spec)
        layer_s = sum(lt.time_s * len(idx) for idx, lt in groups)
        every = [head, *(lt for idx, lt in groups for _ in idx), tail]
        totals = sum_groups(every, head.time_s + layer_s + tail.time_s, spec, fusion)
        return ModelTiming(model=cfg.name, preset=spec.name, step=step, head=head, tail=tail, groups=groups,
                           totals=totals, footprint=fp, distinct_launches=len(plans) + 2)
    whole = n <= WHOLE_STEP_LAYERS if whole is None else whole
    keys = [layer_launches(cfg, i, step) for i in range(n)]
    warm, period = layer_windows(keys)
    w = min(n, warm + 2 * period)
    if whole or w >= n - 1:
        with gc_paused():
            fb = build_fused(cfg, step, spec, name=f"{cfg.name}_{step.phase}_step")
            tl = run_timing(fb.program, spec)
        per_layer, head, tail = _stretches(cfg, fb, tl, range(n), spec, with_tail=True)
        total = tl.time_s
    else:
        with gc_paused():
            first = build_fused(cfg, step, spec, layers=range(w), head=True, tail=False,
                                name=f"{cfg.name}_{step.phase}_L0-{w - 1}")
            t1 = run_timing(first.program, spec)
            per_first, head, _ = _stretches(cfg, first, t1, range(w), spec, with_tail=False)
            del first
            last = build_fused(cfg, step, spec, layers=range(n - 2, n), head=False, tail=True,
                               name=f"{cfg.name}_{step.phase}_L{n - 2}-{n - 1}")
            t2 = run_timing(last.program, spec)
            _, _, tail = _stretches(cfg, last, t2, range(n - 2, n), spec, with_tail=True)
            del last, t1, t2  # freed now, not walked by the collector's first pass after the pause
        steady = {keys[j]: per_first[j] for j in range(w - period, w)}
        per_layer = dict(per_first)
        for i in range(w, n):
            per_layer[i] = steady[keys[i]]
        total = head.time_s + sum(per_layer[i].time_s for i in range(n)) + tail.time_s
    groups = []
    for idx in plans.values():
        members = [per_layer[i] for i in idx]
        rep = members[-1]
        mean = sum(m.time_s for m in members) / len(members)
        totals = dict(rep.totals, time_s=mean)
        groups.append((tuple(idx), LayerTiming(layer=idx[0], kind=rep.kind, kernels=rep.kernels,
                                               totals=totals, timelines=rep.timelines)))
    every = [head, *(per_layer[i] for i in range(n)), tail]
    totals = sum_groups(every, total, spec, "step")
    return ModelTiming(model=cfg.name, preset=spec.name, step=step, head=head, tail=tail,
                       groups=tuple(groups), totals=totals, footprint=fp, distinct_launches=len(plans) + 2)


def _whole_group(fb: FusedBuild, tl: Timeline, layer: int, kind: str, spec: ChipSpec) -> LayerTiming:
    labels = [label for ops in fb.layer_ops.values() for label in ops]
    kernels = _kernel_entries(tl, fb, labels, end_instruction=int(np.argmax(tl.end_s)), start_s=0.0)
    totals = _totals(kernels, tl.time_s, spec, fusion="layer", launch_s=tl.launch_s)
    return LayerTiming(layer=layer, kind=kind, kernels=tuple(kernels), totals=totals, timelines=(tl,))


def _stretches(cfg: ModelConfig, fb: FusedBuild, tl: Timeline, layers: Sequence[int], spec: ChipSpec, *,
               with_tail: bool) -> tuple[dict[int, LayerTiming], LayerTiming | None, LayerTiming | None]:
    """Each layer's (and the head's, the tail's) stretch of a step-fused program."""
    ends = _op_ends(tl)
    out: dict[int, LayerTiming] = {}
    head = None
    start = 0.0
    if fb.head:
        hi, ht = ends[fb.layer_ops[-1][-1]]
        head = _group_stretch(cfg, fb, tl, -1, "head", spec, 0.0, hi, ht)
        start = ht
    else:
        prev = layers[0] - 1
        start = 0.0 if prev not in fb.layer_ops else ends[fb.layer_ops[prev][-1]][1]
    for i in layers:
        ei, et = ends[fb.layer_ops[i][-1]]
        out[i] = _group_stretch(cfg, fb, tl, i, layer_kind(cfg, i), spec, start, ei, et)
        start = et
    tail = None
    if with_tail:
        ti, tt = ends[fb.layer_ops[cfg.layers][-1]]
        tail = _group_stretch(cfg, fb, tl, cfg.layers, "tail", spec, start, ti, tt)
    return out, head, tail


def sum_groups(groups: Sequence[LayerTiming], time_s: float, spec: ChipSpec, fusion: str) -> dict[str, Any]:
    """A step's totals from its groups (head, each layer, tail) over ``time_s``."""
    fmt: dict[str, float] = {}
    causes: dict[str, float] = {}
    for g in groups:
        _add(fmt, g.totals.get("flops_by_format"))
        _add(causes, g.totals.get("time_by_bound_s"))
    hbm, flops = sum(g.totals["hbm_bytes"] for g in groups), sum(g.totals["flops"] for g in groups)
    return _figures(time_s, hbm, flops, fmt, causes, spec, fusion=fusion)
