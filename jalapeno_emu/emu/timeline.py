"""``Timeline``: what the timing pass says each engine did, and the summary people read.

Stage: emulator output (after ``timing.run_timing``), before reports and traces. Times are seconds
from the kernel's start (its first instruction may begin at 0); the kernel-launch cost
(``spec.sync.kernel_launch_s``) is added once to ``time_s`` and reported as ``launch_s``.

The ``bound`` of a kernel (``summary()["bound"]``) follows one rule, checked in this order:

1. ``memory_bound_s`` = the busier of (a) the busiest HBM pseudo-channel's bytes over its
   achievable rate (``bytes_per_s_per_pseudo_channel * efficiency``; a perfectly spread stream
   gives total bytes / (peak * efficiency)) and (b) the busiest core's DMA bytes over
   ``dma.bytes_per_s_per_core``. ``compute_bound_s`` = the busiest compute unit's (matrix or
   vector) pure work time (tile steps or element passes, without issue overhead or pipeline
   fill). If the larger of the two is at least 70 % of ``time_s``, the bound is "hbm" or
   "compute" accordingly: the kernel runs near the speed of its busiest resource.
2. Otherwise the critical path (the chain of instructions, each waiting on the one before it,
   that ends last) is split into fixed costs (launch, DMA setup, HBM latency, gather rounds,
   issue overheads, pipeline fill, link latency) and the rest. If fixed costs are at least half
   of ``time_s`` the bound is "latency" (the kernel is too small to amortise them).
3. Otherwise "synchronisation": the time goes to work the program's semaphores and barriers
   serialise (engines wait on each other instead of overlapping), e.g. a single-buffered loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.files import atomic_write_json
from jalapeno_emu.isa.program import Engine, Program

__all__ = ["BOUND_THRESHOLD", "CATEGORIES", "LATENCY_THRESHOLD", "Timeline"]

BOUND_THRESHOLD = 0.7
"""A kernel is HBM- or compute-bound when that lower bound is at least this fraction of its time."""

LATENCY_THRESHOLD = 0.5
"""Otherwise it is latency-bound when fixed costs on its critical path are at least this fraction."""

CATEGORIES = ("dma", "mxu", "vpu", "sync", "link")
"""Values of ``Timeline.category`` (an index into this tuple): which cost model timed an instruction."""

FORMATS = ("mxfp4", "mxfp8", "bf16")


@dataclass(frozen=True, eq=False)
class Timeline:
    """Per-instruction times and per-resource totals of one timed Program.

    Attributes:
        program: the Program that was timed.
        spec: the chip it was timed on.
        engines: every engine with instructions, sorted; ``engine_index`` points into it.
        start_s: float64[n] start of each instruction, s (DMA: when its queue issued it).
        end_s: float64[n] end of each instruction, s (DMA: when the last byte landed).
        engine_index: int32[n] engine of each instruction.
        category: int8[n] index into ``CATEGORIES``.
        bytes: int64[n] bytes each DMA or link instruction moved (0 for others).
        hbm: bool[n] True for DMAs that touch HBM.
        flops: float64[n] FLOPs of each matmul (2*M*N*K).
        flop_format: int8[n] index into ("mxfp4", "mxfp8", "bf16") for matmuls, -1 otherwise.
        fixed_s: float64[n] fixed cost in each instruction's time, s (DMA: setup + HBM latency
            + gather rounds; compute: issue overhead, plus pipeline fill where it was paid;
            link: latency).
        work_s: float64[n] pure work time of compute instructions, s (tile steps, element passes).
        core_dma_s: float64[n] time the instruction needs on its core's DMA port, s.
        pred: int64[n] the instruction whose completion let this one start or end (-1: none).
        hbm_bytes_per_channel: int64[n_pc] bytes each HBM pseudo-channel served.
        launch_s: kernel launch cost added once to ``time_s``, s.
    """

    program: Program
    spec: ChipSpec
    engines: tuple[Engine, ...]
    start_s: np.ndarray
    end_s: np.ndarray
    engine_index: np.ndarray
    category: np.ndarray
    bytes: np.ndarray
    hbm: np.ndarray
    flops: np.ndarray
    flop_format: np.ndarray
    fixed_s: np.ndarray
    work_s: np.ndarray
    core_dma_s: np.ndarray
    pred: np.ndarray
    hbm_bytes_per_channel: np.ndarray
    launch_s: float
    _cache: dict = field(default_factory=dict, repr=False)

    # --- totals ---------------------------------------------------------------------------
    @property
    def makespan_s(self) -> float:
        """Seconds from the kernel's start to the end of its last instruction (launch excluded)."""
        return float(self.end_s.max()) if len(self.end_s) else 0.0

    @property
    def time_s(self) -> float:
        """Kernel time in seconds: launch plus makespan."""
        return self.launch_s + self.makespan_s

    @property
    def hbm_bytes(self) -> int:
        """Bytes moved to or from HBM."""
        return int(self.hbm_bytes_per_channel.sum())

    def flops_by_format(self) -> dict[str, float]:
        """Matrix-unit FLOPs per operand format ("mxfp4", "mxfp8", "bf16")."""
        return {f: float(self.flops[self.flop_format == k].sum()) for k, f in enumerate(FORMATS)}

    def busy_s(self) -> dict[str, float]:
        """Seconds each engine had work in progress (DMA transfers in flight, matmuls, vector
        operations, link transfers; waiting at a semaphore or barrier is not work), by engine name."""
        if "busy" not in self._cache:
            out = {}
            work = np.flatnonzero(self.category != CATEGORIES.index("sync"))
            order = work[np.argsort(self.engine_index[work], kind="stable")]  # streams, in order
            bounds = np.searchsorted(self.engine_index[order], np.arange(len(self.engines) + 1))
            for k, eng in enumerate(self.engines):
                idx = order[bounds[k]:bounds[k + 1]]
                s, e = self.start_s[idx], self.end_s[idx]
                # Starts are non-decreasing within an engine: the union of intervals is the sum of
                # each interval's part past the latest end before it.
                prev = np.maximum.accumulate(np.concatenate(([0.0], e[:-1])))
                out[str(eng)] = float(np.maximum(e - np.maximum(s, prev), 0.0).sum())
            self._cache["busy"] = out
        return self._cache["busy"]

    def channel_utilization(self) -> np.ndarray:
        """float64[n_pc]: each pseudo-channel's achieved bytes/s over its peak, over ``time_s``."""
        peak = self.spec.hbm.bytes_per_s_per_pseudo_channel
        return self.hbm_bytes_per_channel / (peak * self.time_s) if self.time_s else \
            np.zeros(len(self.hbm_bytes_per_channel))

    # --- bounds ---------------------------------------------------------------------------
    def lower_bound_s(self) -> float:
        """max(HBM bytes / achievable HBM B/s, sum over formats of FLOPs / peak FLOP/s of that
        format), s: the roofline of this program's work.

        No schedule on this chip can beat it: every pseudo-channel serves at most its achievable
        rate (peak x ``hbm.efficiency``: refresh and turnarounds are not schedulable away) and
        every matrix unit at most its peak rate for the operand format.
        """
        d = self.spec.derived()
        flops = self.flops_by_format()
        compute = sum(flops[f] / d[f"peak_{f}_flops_per_s"] for f in FORMATS)
        return max(self.hbm_bytes / d["hbm_achievable_bytes_per_s"], compute)

    def memory_bound_s(self) -> float:
        """Busiest pseudo-channel at its achievable rate, or busiest core DMA port, s."""
        h = self.spec.hbm
        chan = float(self.hbm_bytes_per_channel.max()) / (h.bytes_per_s_per_pseudo_channel * h.efficiency) \
            if len(self.hbm_bytes_per_channel) else 0.0
        dma = self.category == 0
        if not dma.any():
            return chan
        cores = np.array([e.core for e in self.engines])[self.engine_index[dma]]
        per_core = np.bincount(cores, weights=self.core_dma_s[dma])
        return max(chan, float(per_core.max()))

    def compute_bound_s(self) -> float:
        """The busiest matrix or vector unit's pure work time, s."""
        comp = (self.category == 1) | (self.category == 2)
        if not comp.any():
            return 0.0
        return float(np.bincount(self.engine_index[comp], weights=self.work_s[comp]).max())

    def critical_path(self) -> np.ndarray:
        """int64 indices of the critical path, first to last: from the instruction that ends last,
        following ``pred`` back to one that waited on nothing."""
        if "path" not in self._cache:
            path = []
            i = int(np.argmax(self.end_s)) if len(self.end_s) else -1
            pred = self.pred.tolist()
            while i >= 0 and len(path) <= len(pred):  # (the bound only guards against a bug)
                path.append(i)
                i = pred[i]
            self._cache["path"] = np.array(path[::-1], dtype=np.int64)
        return self._cache["path"]

    def critical_fixed_s(self) -> float:
        """Launch plus the fixed costs (``fixed_s``) of the critical path's instructions, s, where
        each counts at most the time its step adds to the path."""
        path = self.critical_path()
        if not len(path):
            return self.launch_s
        ends = self.end_s[path]
        before = np.concatenate(([0.0], ends[:-1]))
        step = np.maximum(ends - before, 0.0)
        return self.launch_s + float(np.minimum(self.fixed_s[path], step).sum())

    def bound(self) -> str:
        """"compute", "hbm", "latency" or "synchronisation", by the rule in the module docstring."""
        t = self.time_s
        if t <= 0:
            return "latency"
        mem, comp = self.memory_bound_s(), self.compute_bound_s()
        if max(mem, comp) >= BOUND_THRESHOLD * t:
            return "hbm" if mem >= comp else "compute"
        if self.critical_fixed_s() >= LATENCY_THRESHOLD * t:
            return "latency"
        return "synchronisation"

    # --- explanations ---------------------------------------------------------------------
    def mxu_utilization_of_format_peak(self) -> float:
        """Fraction of the time the chip's matrix units would need for these FLOPs at the peak of
        the format each matmul used (BF16 work at the BF16 peak, not the MXFP4 one)."""
        t = self.time_s
        if t <= 0:
            return 0.0
        d = self.spec.derived()
        flops = self.flops_by_format()
        return sum(flops[f] / d[f"peak_{f}_flops_per_s"] for f in FORMATS) / t

    def cores_used(self) -> int:
        """Cores that ran any work (a transfer, a matmul or a vector operation)."""
        work = self.category != CATEGORIES.index("sync")
        cores = {e.core for e in (self.engines[i] for i in np.unique(self.engine_index[work]))
                 if e.core >= 0}
        return len(cores)

    def _path_steps(self) -> tuple[np.ndarray, np.ndarray]:
        """(critical path indices, the time each one adds to the path, s)."""
        path = self.critical_path()
        ends = self.end_s[path]
        before = np.concatenate(([0.0], ends[:-1]))
        return path, np.maximum(ends - before, 0.0)

    def critical_path_by_engine_s(self) -> dict[str, float]:
        """Seconds of the critical path each engine's instructions account for, largest first."""
        path, step = self._path_steps()
        out: dict[str, float] = {}
        for i, dt in zip(path.tolist(), step.tolist(), strict=True):
            name = str(self.engines[self.engine_index[i]])
            out[name] = out.get(name, 0.0) + dt
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def critical_fixed_by_kind_s(self) -> dict[str, float]:
        """``critical_fixed_s`` split by what the fixed costs are: ``launch``, ``dma_setup``,
        ``hbm_latency`` (with gather rounds), ``issue`` (compute issue overhead and pipeline fill),
        ``link_latency``, each counted at most the time its step adds to the path, s."""
        path, step = self._path_steps()
        fixed = np.minimum(self.fixed_s[path], step)
        cat = self.category[path]
        setup = self.spec.dma.setup_latency_s
        dma = cat == CATEGORIES.index("dma")
        dma_setup = np.minimum(fixed[dma], setup)
        return {
            "launch": self.launch_s,
            "dma_setup": float(dma_setup.sum()),
            "hbm_latency": float((fixed[dma] - dma_setup).sum()),
            "issue": float(fixed[(cat == CATEGORIES.index("mxu")) | (cat == CATEGORIES.index("vpu"))].sum()),
            "link_latency": float(fixed[cat == CATEGORIES.index("link")].sum()),
        }

    def why(self) -> str:
        """One line saying what bounds the program, from the same figures as :meth:`bound`."""
        t = self.time_s
        if t <= 0:
            return "no work"
        bound = self.bound()
        n = self.spec.core.count
        used = self.cores_used()
        cores = f"{used} of {n} cores ran work"
        if bound == "hbm":
            mem = self.memory_bound_s()
            ideal = self.hbm_bytes / self.spec.derived()["hbm_achievable_bytes_per_s"]
            spread = "" if mem <= 1.05 * ideal else \
                f"; the busiest channel or core port carries {mem / ideal:.2g}x its even share"
            return (f"HBM-bound: the busiest HBM channel or core DMA port is busy {mem / t:.0%} of the "
                    f"time{spread}; {cores}")
        if bound == "compute":
            comp = self.compute_bound_s()
            kinds = (CATEGORIES.index("mxu"), CATEGORIES.index("vpu"))
            work = np.isin(self.category, kinds)
            per_engine = np.bincount(self.engine_index[work], weights=self.work_s[work],
                                     minlength=len(self.engines))
            busiest = self.engines[int(np.argmax(per_engine))]
            fmt = self.flops_by_format()
            used_fmt = [f for f in FORMATS if fmt[f] > 0]
            what = f" ({'/'.join(used_fmt)} matmuls)" if busiest.unit == "mxu" and used_fmt else ""
            return (f"compute-bound: {busiest}{what} works {comp / t:.0%} of the time; {cores}; "
                    f"matrix units at {self.mxu_utilization_of_format_peak():.1%} of the chip's peak "
                    "for the formats used")
        fixed = self.critical_fixed_by_kind_s()
        parts = ", ".join(f"{k.replace('_', ' ')} {v * 1e6:.3g} µs" for k, v in
                          sorted(fixed.items(), key=lambda kv: -kv[1]) if v > 0)
        if bound == "latency":
            return (f"latency-bound: fixed costs make {self.critical_fixed_s() / t:.0%} of the critical "
                    f"path ({parts}); {cores}")
        lead = next(iter(self.critical_path_by_engine_s().items()), ("none", 0.0))
        return (f"synchronisation-bound: no resource is busy {BOUND_THRESHOLD:.0%} of the time (HBM "
                f"channels and DMA ports {self.memory_bound_s() / t:.0%}, busiest compute unit "
                f"{self.compute_bound_s() / t:.0%}) and fixed costs are {self.critical_fixed_s() / t:.0%} "
                f"of the critical path: the rest is engines waiting for each other (the largest share "
                f"of the path, {lead[1] / t:.0%}, on {lead[0]}); {cores}")

    # --- summary --------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The numbers a report prints, as plain Python values.

        Returns:
            ``time_s`` (launch + makespan, s), ``launch_s``, ``makespan_s``, ``cycles`` (time_s at
            the core clock), ``instructions``, ``hbm_bytes``, ``hbm_bytes_per_s``,
            ``hbm_utilization`` (achieved B/s over peak), ``hbm_utilization_of_achievable`` (over
            peak * efficiency), ``channel_utilization`` {min, mean, max} (each pseudo-channel's
            B/s over its peak), ``flops``, ``flops_by_format``, ``flops_per_s``,
            ``mxu_utilization`` (achieved FLOP/s over the chip's peak MXFP4 FLOP/s),
            ``mxu_utilization_used_cores`` (over the peak of the cores that ran a matmul),
            ``mxu_utilization_of_format_peak`` (over the peak of the formats used),
            ``bound``, ``why`` (one line from the same figures), ``lower_bound_s``,
            ``memory_bound_s``, ``compute_bound_s``, ``critical_fixed_s`` and
            ``critical_fixed_by_kind_s`` (launch, DMA set-up, HBM latency, issue, link latency),
            ``critical_path_by_engine_s``, ``critical_engine`` (the engine with the largest
            share of the critical path), ``cores_used`` / ``cores_total`` and ``busy_s`` per
            engine.
        """
        d = self.spec.derived()
        t = self.time_s
        hbm = self.hbm_bytes
        flops = float(self.flops.sum())
        chan = self.channel_utilization()
        cores = np.array([e.core for e in self.engines], dtype=np.int64)
        mm_cores = np.unique(cores[self.engine_index[self.flops > 0]])
        peak4 = d["peak_mxfp4_flops_per_s"]
        used_peak = peak4 * len(mm_cores) / self.spec.core.count
        rate = flops / t if t else 0.0
        path_engines = self.critical_path_by_engine_s()
        return {
            "time_s": t,
            "launch_s": self.launch_s,
            "makespan_s": self.makespan_s,
            "cycles": t * self.spec.core.clock_hz,
            "instructions": len(self.start_s),
            "hbm_bytes": hbm,
            "hbm_bytes_per_s": hbm / t if t else 0.0,
            "hbm_utilization": hbm / t / d["hbm_bytes_per_s"] if t else 0.0,
            "hbm_utilization_of_achievable": hbm / t / d["hbm_achievable_bytes_per_s"] if t else 0.0,
            "channel_utilization": {"min": float(chan.min()), "mean": float(chan.mean()),
                                    "max": float(chan.max())},
            "flops": flops,
            "flops_by_format": self.flops_by_format(),
            "flops_per_s": rate,
            "mxu_utilization": rate / peak4,
            "mxu_utilization_used_cores": rate / used_peak if used_peak else 0.0,
            "mxu_utilization_of_format_peak": self.mxu_utilization_of_format_peak(),
            "bound": self.bound(),
            "why": self.why(),
            "lower_bound_s": self.lower_bound_s(),
            "memory_bound_s": self.memory_bound_s(),
            "compute_bound_s": self.compute_bound_s(),
            "critical_fixed_s": self.critical_fixed_s(),
            "critical_fixed_by_kind_s": self.critical_fixed_by_kind_s(),
            "critical_path_by_engine_s": path_engines,
            "critical_engine": next(iter(path_engines), None),
            "cores_used": self.cores_used(),
            "cores_total": self.spec.core.count,
            "busy_s": self.busy_s(),
        }

    # --- trace ----------------------------------------------------------------------------
    def hbm_bandwidth_series(self, bins: int = 512) -> tuple[np.ndarray, np.ndarray]:
        """(bin start times s, float64 HBM B/s in each bin) over the makespan.

        Each HBM transfer's bytes are spread evenly from its issue to its end; the cumulative
        byte count is piecewise linear, so it is evaluated at the bin edges in one pass.
        """
        sel = self.hbm & (self.bytes > 0)
        span = self.makespan_s
        edges = np.linspace(0.0, span, bins + 1) if span > 0 else np.zeros(2)
        if not sel.any() or span <= 0:
            return edges[:-1], np.zeros(len(edges) - 1)
        a, e, b = self.start_s[sel], self.end_s[sel], self.bytes[sel].astype(np.float64)
        rate = b / np.maximum(e - a, 1e-30)
        knots = np.concatenate((a, e))
        slope_delta = np.concatenate((rate, -rate))
        order = np.argsort(knots, kind="stable")
        knots, slope = knots[order], np.cumsum(slope_delta[order])
        cum = np.concatenate(([0.0], np.cumsum(slope[:-1] * np.diff(knots))))
        at_edges = np.interp(edges, knots, cum, left=0.0, right=float(b.sum()))
        return edges[:-1], np.diff(at_edges) / np.diff(edges)

    def to_chrome_trace(self, *, chip: int = 0, counter_bins: int = 512) -> dict[str, Any]:
        """The timeline as Chrome/Perfetto trace JSON (``{"traceEvents": [...]}``), times in µs.

        One process per chip (``pid = chip``); one thread per engine, named like ``c0.dma1``.
        Transfers a DMA queue keeps in flight together overlap, and a thread's slices must nest,
        so a queue's overlapping transfers go to extra lanes named ``c0.dma1 +1``, ``+2``, ...
        sorted right under it. Each instruction is one "X" event named by its mnemonic, with args
        ``index``, ``engine``, ``bytes``, ``flops`` and ``source``. A counter track "HBM
        bandwidth" (GB/s, ``counter_bins`` samples) follows the chip's HBM traffic.
        """
        ins = self.program.instructions
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": chip, "args": {"name": f"chip {chip} "
                                                                      f"({self.program.name})"}}]
        start_us, end_us = self.start_s * 1e6, self.end_s * 1e6
        tid = 0
        order = np.argsort(self.engine_index, kind="stable")
        bounds = np.searchsorted(self.engine_index[order], np.arange(len(self.engines) + 1))
        for k, eng in enumerate(self.engines):
            idx = order[bounds[k]:bounds[k + 1]].tolist()
            lanes_end: list[float] = []  # per lane, when its last slice ends
            lane_tid: list[int] = []
            for i in idx:
                s = float(start_us[i])
                lane = next((n for n, le in enumerate(lanes_end) if le <= s), None)
                if lane is None:
                    lane = len(lanes_end)
                    lanes_end.append(0.0)
                    lane_tid.append(tid)
                    name = str(eng) if lane == 0 else f"{eng} +{lane}"
                    events.append({"name": "thread_name", "ph": "M", "pid": chip, "tid": tid,
                                   "args": {"name": name}})
                    events.append({"name": "thread_sort_index", "ph": "M", "pid": chip, "tid": tid,
                                   "args": {"sort_index": tid}})
                    tid += 1
                lanes_end[lane] = float(end_us[i])
                events.append({
                    "name": ins[i].mnemonic, "ph": "X", "pid": chip, "tid": lane_tid[lane],
                    "ts": s, "dur": float(end_us[i]) - s,
                    "args": {"index": i, "engine": str(eng), "bytes": int(self.bytes[i]),
                             "flops": float(self.flops[i]), "source": ins[i].source},
                })
        if counter_bins and self.hbm.any():
            times, bw = self.hbm_bandwidth_series(counter_bins)
            events.extend({"name": "HBM bandwidth", "ph": "C", "pid": chip, "ts": float(ts * 1e6),
                           "args": {"GB/s": float(v / 1e9)}} for ts, v in zip(times, bw, strict=True))
        return {"traceEvents": events, "displayTimeUnit": "ns",
                "otherData": {"program": self.program.name, "chip": self.spec.name,
                              "launch_us": self.launch_s * 1e6}}

    def write_chrome_trace(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        """Write ``to_chrome_trace(**kwargs)`` to ``path`` atomically (temp file, then os.replace),
        so a reader never sees half a trace."""
        atomic_write_json(path, self.to_chrome_trace(**kwargs))
