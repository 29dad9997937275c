"""Per-layer and whole-model step times from the emulator's timing pass (timing-only, any size).

Stage: model. Every launch of a plan (``model.plan``) is built and timed by ``run_timing`` on the
chip spec, exactly as ``jalapeno-emu kernel NAME --timing-only`` would; kernels run one after the
other, so a layer's time is the sum of its launches' times (each includes the spec's kernel launch
cost). Identical launches (same kernel, same shape) are timed once per :class:`StepTimer`, so the
36 layers of gpt-oss-120b cost two layer timings (sliding and full attention), and a model's
layers are grouped by identical plans.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from jalapeno_emu.chip import ChipSpec, load_preset
from jalapeno_emu.emu.critical_path import PathRun, critical_path_runs, launched_path_runs
from jalapeno_emu.emu.timeline import Timeline
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.files import atomic_write_json
from jalapeno_emu.kernels.registry import get_kernel

from .config import ModelConfig
from .footprint import Footprint, footprint
from .plan import Launch, Step, head_launches, layer_launches, tail_launches

__all__ = ["KernelTiming", "LayerTiming", "ModelTiming", "StepTimer", "gc_paused", "layer_critical_path",
           "resolve_fusion", "sum_timings", "time_layer", "time_model", "write_layer_trace"]

@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while kernels are built and timed: every full
    collection re-walks all the Programs built so far (hundreds of thousands of frozen objects),
    which costs more than building them; nothing they create is garbage until the step is done."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_FIELDS = ("time_s", "hbm_bytes", "flops", "hbm_utilization", "hbm_utilization_of_achievable",
           "mxu_utilization", "bound", "lower_bound_s", "instructions")


@dataclass(frozen=True)
class KernelTiming:
    """One launch's figures from the timing pass.

    Attributes:
        label, kernel, shape: the launch.
        time_s: launch cost plus makespan, s. hbm_bytes: bytes read and written in HBM.
        flops: matrix-unit FLOPs. hbm_utilization: achieved over peak HBM bandwidth;
        hbm_utilization_of_achievable: over peak times the streaming efficiency.
        mxu_utilization: achieved over peak MXFP4 FLOP/s. bound: hbm / compute / vector /
        latency (what the timeline says limits it). lower_bound_s: max of the bytes (at the
        achievable HBM rate) and FLOPs (at peak) bounds. instructions: the Program's length.
        flops_by_format: FLOPs per matrix-unit rate. why: one line from the same figures as
        bound; critical_engine: the engine with the largest share of its critical path;
        cores_used: cores that ran any of its work.

    In a fused program (``model.fused_timing``) an entry is a *phase*: ``time_s`` is its share of
    the layer's critical path, utilisations are over ``span_s``, ``by_cause_s`` splits its
    critical seconds (hbm, compute, latency, synchronisation), ``bound`` is the largest of them
    (``overlapped``: none on the critical path).
    """

    label: str
    kernel: str
    shape: dict[str, Any]
    time_s: float
    hbm_bytes: int
    flops: float
    hbm_utilization: float
    hbm_utilization_of_achievable: float
    mxu_utilization: float
    bound: str
    lower_bound_s: float
    instructions: int
    flops_by_format: dict[str, float] | None = None
    span_s: float | None = None
    by_cause_s: dict[str, float] | None = None
    why: str = ""
    critical_engine: str | None = None
    cores_used: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON form (the ``kernels`` entries of ``layer --json``); a phase of a fused program also
        has ``span_s`` (first start to last end of its instructions) and ``time_by_cause_s``."""
        out = {"label": self.label, "kernel": self.kernel, "shape": self.shape,
               **{k: getattr(self, k) for k in _FIELDS},
               "why": self.why, "critical_engine": self.critical_engine, "cores_used": self.cores_used}
        if self.span_s is not None:
            out["span_s"] = self.span_s
            out["time_by_cause_s"] = dict(self.by_cause_s or {})
        return out


def sum_timings(kernels: Sequence[KernelTiming], spec: ChipSpec) -> dict[str, Any]:
    """Sums over launches run back to back, utilisations over the total time, the bound (the one
    whose kernels take the largest share of the time), the roofline of the work
    (``lower_bound_s``: bytes at the achievable HBM rate or FLOPs at peak, whichever is larger)
    and the launch cost paid (once per launch)."""
    t = sum(k.time_s for k in kernels)
    hbm = sum(k.hbm_bytes for k in kernels)
    flops = sum(k.flops for k in kernels)
    d = spec.derived()
    by_bound: dict[str, float] = {}
    fmt: dict[str, float] = {}
    for k in kernels:
        by_bound[k.bound] = by_bound.get(k.bound, 0.0) + k.time_s
        for f, v in (k.flops_by_format or {}).items():
            fmt[f] = fmt.get(f, 0.0) + v
    compute = sum(v / d[f"peak_{f}_flops_per_s"] for f, v in fmt.items())
    return {
        "time_s": t, "hbm_bytes": hbm, "flops": flops,
        "hbm_utilization": hbm / t / d["hbm_bytes_per_s"] if t else 0.0,
        "hbm_utilization_of_achievable": hbm / t / d["hbm_achievable_bytes_per_s"] if t else 0.0,
        "mxu_utilization": flops / t / d["peak_mxfp4_flops_per_s"] if t else 0.0,
        "bound": max(by_bound, key=by_bound.get) if by_bound else "latency",
        "time_by_bound_s": by_bound,
        "why": _why_of_launches(by_bound, t),
        "mxu_utilization_of_format_peak": compute / t if t else 0.0,
        "lower_bound_s": max(hbm / d["hbm_achievable_bytes_per_s"], compute),
        "flops_by_format": fmt, "fusion": "none",
        "launch_s": spec.sync.kernel_launch_s * len(kernels),
    }


def _why_of_launches(by_bound: dict[str, float], time_s: float) -> str:
    """"latency-bound kernels 60%, hbm 30%, ... of the time": the split the bound is the largest of."""
    if time_s <= 0:
        return "no work"
    parts = ", ".join(f"{b} {v / time_s:.0%}" for b, v in sorted(by_bound.items(), key=lambda kv: -kv[1]))
    return f"launches by what bounds each: {parts} of {time_s * 1e6:.3g} µs"


@dataclass(frozen=True)
class LayerTiming:
    """One decoder layer (or the head/tail group) of one step.

    Attributes:
        layer: the layer index (-1: embedding, ``layers``: final norm and logits).
        kind: a short description (``sliding-128 moe``, ``mla dense``, ``head``, ``tail``).
        kernels: its launches, in order.
        totals: ``time_s``, ``hbm_bytes``, ``flops``, ``hbm_utilization``,
            ``hbm_utilization_of_achievable``, ``mxu_utilization``, ``bound``, ``time_by_bound_s``.
        timelines: per launch, the Timeline (for traces and critical paths).
        window: (last instruction, start s) of the layer's stretch of ``timelines[0]`` when that
            is a program of several layers (step fusion); None: each timeline is the layer's whole.
    """

    layer: int
    kind: str
    kernels: tuple[KernelTiming, ...]
    totals: dict[str, Any]
    timelines: tuple[Timeline, ...] = field(repr=False, compare=False, default=())
    window: tuple[int, float] | None = field(repr=False, compare=False, default=None)

    @property
    def time_s(self) -> float:
        """The layer's time, s."""
        return self.totals["time_s"]

    def as_dict(self) -> dict[str, Any]:
        """JSON form: the totals at top level plus ``kernels``."""
        return {"layer": self.layer, "kind": self.kind, **self.totals,
                "kernels": [k.as_dict() for k in self.kernels]}


class StepTimer:
    """Times launches on one chip spec, each distinct (kernel, shape) once.

    Args:
        spec: the chip (a preset name or a ChipSpec).
        safety_checks: also run ``check_program`` (races, bounds) on each distinct launch; off by
            default for full-size timing (the builder still checks legality and capacity, and the
            timing pass detects deadlocks). The kernels' own tests run the checks.
    """

    def __init__(self, spec: ChipSpec | str, *, safety_checks: bool = False) -> None:
        self.spec = load_preset(spec) if isinstance(spec, str) else spec
        self.safety_checks = safety_checks
        self._cache: dict[tuple[str, tuple], tuple[dict[str, Any], Timeline]] = {}

    @property
    def distinct_launches(self) -> int:
        """How many distinct launches were built and timed so far."""
        return len(self._cache)

    def time_launch(self, launch: Launch, builds: Mapping[tuple[str, tuple], Any] | None = None
                    ) -> tuple[KernelTiming, Timeline]:
        """Time one launch (cached by kernel and shape).

        ``builds``: (kernel, shape) -> a ``KernelBuild`` of that launch already made on this
        timer's spec (a functional run's), used instead of building it again.
        """
        key = (launch.kernel, launch.shape)
        hit = self._cache.get(key)
        if hit is None:
            build = builds.get(key) if builds is not None else None
            if build is None:
                build = get_kernel(launch.kernel).build(launch.shape_dict, self.spec)
            if self.safety_checks:
                from jalapeno_emu.emu.check import check_program

                check_program(build.program, self.spec)
            timeline = run_timing(build.program, self.spec)
            hit = (timeline.summary(), timeline)
            self._cache[key] = hit
        s, timeline = hit
        return KernelTiming(label=launch.label, kernel=launch.kernel, shape=launch.shape_dict,
                            **{k: s[k] for k in _FIELDS}, flops_by_format=s["flops_by_format"],
                            why=s["why"], critical_engine=s["critical_engine"],
                            cores_used=s["cores_used"]), timeline

    def time_launches(self, launches: Iterable[Launch], *, layer: int, kind: str,
                      builds: Mapping[tuple[str, tuple], Any] | None = None) -> LayerTiming:
        """Time launches run back to back as one group (``builds``: see ``time_launch``)."""
        with gc_paused():
            timed = [self.time_launch(x, builds) for x in launches]
        kernels = tuple(k for k, _ in timed)
        return LayerTiming(layer=layer, kind=kind, kernels=kernels, totals=sum_timings(kernels, self.spec),
                           timelines=tuple(t for _, t in timed))


def layer_kind(cfg: ModelConfig, layer: int) -> str:
    """``full``/``sliding-W`` or ``mla``, then ``moe``/``dense``: what makes layers differ."""
    if cfg.attention == "mla":
        attn = "mla"
    else:
        attn = f"sliding-{cfg.window(layer)}" if cfg.window(layer) else "full"
    return f"{attn} {'moe' if cfg.is_moe(layer) else 'dense'}"


def resolve_fusion(fusion: str | None, spec: ChipSpec) -> str:
    """``fusion``, or the preset's default (``software.fusion``) when None; checked."""
    from .fused import check_fusion

    return check_fusion(spec.software.fusion if fusion is None else fusion)


def time_layer(cfg: ModelConfig, layer: int, step: Step, spec: ChipSpec | str = "jalapeno-v1", *,
               timer: StepTimer | None = None, fusion: str | None = None,
               disk_cache: bool | str | os.PathLike[str] = False) -> LayerTiming:
    """Time decoder layer ``layer`` of ``cfg`` for ``step`` on ``spec`` (timing-only).

    Args:
        fusion: "none" (its launches back to back), "layer" (one fused program for the layer)
            or "step" (its stretch of a step-fused program); None: the preset's default
            (``software.fusion``). See ``model.fused``.
        disk_cache: keep a fused layer's timing on disk between processes (``model.timing_cache``;
            True: under ``cache_root()``, a path: under that directory); a result read from it
            has no Timelines (traces need ``disk_cache=False``). Unfused layers use ``timer``.

    Returns:
        LayerTiming with per-launch (or per-phase) figures and totals (``lower_bound_s``, ``fusion``).
    """
    timer = timer or StepTimer(spec)
    fusion = resolve_fusion(fusion, timer.spec)
    cfg.window(layer)  # a layer that does not exist is refused by name, whatever the fusion
    if fusion != "none":
        from .fused_timing import fused_layer_timing
        from .timing_cache import cached_timing

        return cached_timing(("layer", cfg, layer, step, fusion), timer.spec,
                             lambda: fused_layer_timing(cfg, layer, step, timer.spec, fusion), disk_cache)
    return timer.time_launches(layer_launches(cfg, layer, step), layer=layer, kind=layer_kind(cfg, layer))


@dataclass(frozen=True)
class ModelTiming:
    """A whole step: embedding, every layer, final norm and logits.

    Attributes:
        model, preset, step: what was timed.
        head, tail: embedding; final norm + logits.
        groups: (layer indices, LayerTiming of the first of them) per distinct layer plan, in
            order of first appearance (layers of identical shape are timed once).
        totals: over the whole step (head + every layer + tail).
        footprint: weights and KV cache against the die's HBM.
        distinct_launches: kernels actually built and timed.
    """

    model: str
    preset: str
    step: Step
    head: LayerTiming
    tail: LayerTiming
    groups: tuple[tuple[tuple[int, ...], LayerTiming], ...]
    totals: dict[str, Any]
    footprint: Footprint
    distinct_launches: int

    def as_dict(self) -> dict[str, Any]:
        """JSON form. ``time_s`` is the step time when the model fits one die; when it does not,
        ``time_s`` is null and ``time_s_unconstrained`` gives the sum as if HBM were unlimited."""
        fits = self.footprint.fits
        totals = dict(self.totals)
        totals["time_s_unconstrained"] = totals["time_s"]
        if not fits:
            totals["time_s"] = None
        return {
            "model": self.model, "preset": self.preset, "phase": self.step.phase, "batch": self.step.batch,
            "fusion": totals.get("fusion", "none"),
            "context": self.step.context if self.step.phase == "decode" else None,
            "seq": self.step.seq if self.step.phase == "prefill" else None,
            "prior": self.step.prior if self.step.phase == "prefill" else None,
            **totals, "fits_one_die": fits, "footprint": self.footprint.as_dict(),
            "layers": [{"layers": list(idx), "count": len(idx), "time_s_each": lt.time_s,
                        "time_s_total": lt.time_s * len(idx), **lt.as_dict()} for idx, lt in self.groups],
            "head": self.head.as_dict(), "tail": self.tail.as_dict(),
            "distinct_launches": self.distinct_launches,
        }


def time_model(cfg: ModelConfig, step: Step, spec: ChipSpec | str = "jalapeno-v1", *,
               timer: StepTimer | None = None, fusion: str | None = None,
               disk_cache: bool | str | os.PathLike[str] = False) -> ModelTiming:
    """Time one whole step of ``cfg`` (timing-only): embedding, all layers, final norm, logits.

    With ``fusion`` "none", layers with identical launch plans are timed once and the step is the
    sum of its launches; "layer" and "step" time fused programs (``model.fused_timing``); None:
    the preset's default. The footprint says whether weights and the KV cache (``step.batch``
    sequences of ``step.positions`` tokens) fit the die's HBM. ``disk_cache`` keeps a fused
    step's timing on disk between processes, as :func:`time_layer` does.
    """
    timer = timer or StepTimer(spec)
    fusion = resolve_fusion(fusion, timer.spec)
    if fusion != "none":
        from .fused_timing import fused_model_timing
        from .timing_cache import cached_timing

        return cached_timing(_model_question(cfg, step, fusion), timer.spec,
                             lambda: fused_model_timing(cfg, step, timer.spec, fusion), disk_cache)
    plans: dict[tuple[Launch, ...], list[int]] = {}
    for layer in range(cfg.layers):
        plans.setdefault(layer_launches(cfg, layer, step), []).append(layer)
    with gc_paused():
        groups = tuple((tuple(idx), timer.time_launches(plan, layer=idx[0], kind=layer_kind(cfg, idx[0])))
                       for plan, idx in plans.items())
        head = timer.time_launches(head_launches(cfg, step), layer=-1, kind="head")
        tail = timer.time_launches(tail_launches(cfg, step), layer=cfg.layers, kind="tail")
    layers = [k for idx, lt in groups for _ in idx for k in lt.kernels]
    every = [*head.kernels, *layers, *tail.kernels]
    totals = sum_timings(every, timer.spec)
    fp = footprint(cfg, timer.spec, batch=step.batch, tokens=step.positions)
    return ModelTiming(model=cfg.name, preset=timer.spec.name, step=step, head=head, tail=tail, groups=groups,
                       totals=totals, footprint=fp, distinct_launches=timer.distinct_launches)


def _model_question(cfg: ModelConfig, step: Step, fusion: str) -> tuple:
    """What :func:`time_model` asks ``model.timing_cache`` for a fused step."""
    return ("model", cfg, step, fusion)


def model_timing_on_disk(cfg: ModelConfig, step: Step, spec: ChipSpec | str = "jalapeno-v1", *,
                         fusion: str | None = None) -> bool:
    """Whether :func:`time_model` with ``disk_cache=True`` would read this step's timing from
    disk rather than build it (always False for unfused steps, which the cache does not keep)."""
    from .timing_cache import is_cached

    spec = load_preset(spec) if isinstance(spec, str) else spec
    fusion = resolve_fusion(fusion, spec)
    return fusion != "none" and is_cached(_model_question(cfg, step, fusion), spec)


def layer_critical_path(lt: LayerTiming) -> list[PathRun]:
    """The critical path of layer timing ``lt`` (computed here, so it has its Timelines: not one
    read from the disk cache), as runs (``emu.critical_path``), first to last; times in s from the
    layer's start.

    Step fusion: the path into the layer's last operator in the program of the layers around it,
    cut where the layer before it ends. Layer fusion: the program's whole path. No fusion: each
    launch's path after its launch cost (a run ``launch`` on engine ``host``), back to back.

    Raises:
        InvalidArgumentError: ``lt`` has no Timelines (it was read from the disk cache).
    """
    if not lt.timelines:
        raise InvalidArgumentError("this layer timing was read from the disk cache and keeps no "
                                   "Timelines: time it afresh (disk_cache=False, --no-cache)")
    if lt.window is not None:
        end_i, start = lt.window
        return [replace(r, start_s=r.start_s - start, end_s=r.end_s - start)
                for r in critical_path_runs(lt.timelines[0], end_instruction=end_i, start_s=start)]
    if lt.totals.get("fusion") == "layer":  # one program for the whole layer
        return launched_path_runs(lt.timelines[0])
    runs = []
    t0 = 0.0
    for k, tl in zip(lt.kernels, lt.timelines, strict=True):
        runs += launched_path_runs(tl, label=k.label, at_s=t0)
        t0 += k.time_s
    return runs


def write_layer_trace(layers: Sequence[LayerTiming], path: str | os.PathLike[str]) -> None:
    """Chrome/Perfetto trace of launches run back to back: one process per launch (its engines
    as threads, times shifted to when the launch starts) and a ``launches`` process with one
    slice per kernel. Written atomically."""
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0,
                                     "args": {"name": "launches"}},
                                    {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0,
                                     "args": {"name": "kernels"}}]
    t0_us = 0.0
    pid = 1
    for lt in layers:
        for k, tl in zip(lt.kernels, lt.timelines, strict=True):
            name = f"L{lt.layer} {k.label} ({k.kernel})"
            events.append({"name": name, "ph": "X", "pid": 0, "tid": 0, "ts": t0_us, "dur": k.time_s * 1e6,
                           "args": {"bound": k.bound, "hbm_bytes": k.hbm_bytes, "flops": k.flops}})
            trace = tl.to_chrome_trace(chip=pid, counter_bins=64)
            shift = t0_us + tl.launch_s * 1e6
            for ev in trace["traceEvents"]:
                ev = dict(ev)
                if ev.get("ph") == "M" and ev["name"] == "process_name":
                    ev["args"] = {"name": name}
                if "ts" in ev:
                    ev["ts"] = ev["ts"] + shift
                events.append(ev)
            t0_us += k.time_s * 1e6
            pid += 1
    atomic_write_json(path, {"traceEvents": events, "displayTimeUnit": "ns"})
