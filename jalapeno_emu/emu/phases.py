"""Phases of a timed program: per builder region (one operator of a fused program), its share of
the critical path, its bytes and FLOPs, and what bounds it.

Stage: emulator output, beside ``timeline.py``. A fused program interleaves its operators'
instructions (the next operator's weights load while the current one computes), so an operator
has no time of its own; what it has is the part of the program's critical path its instructions
lie on. Walking the critical path (``Timeline.pred``) back from an instruction and cutting it at
a start time gives each region the seconds of that window it accounts for; the parts add up to
the window exactly.

The bound of a phase is what its critical-path seconds are spent on: ``hbm`` (HBM transfers
beyond their fixed costs), ``compute`` (matrix and vector work), ``latency`` (fixed costs: DMA
set-up, HBM latency, issue overhead, pipeline fill; on-chip copies), ``synchronisation``
(semaphore latency); ``overlapped`` when none of it is on the critical path (all hidden under
other operators).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from jalapeno_emu.emu.timeline import CATEGORIES, FORMATS, Timeline

__all__ = ["PhaseFigures", "path_steps", "phase_figures", "region_of_instructions", "region_spans",
           "step_cause", "why_of_causes"]

_DMA, _MXU, _VPU, _SYNC, _LINK = (CATEGORIES.index(c) for c in ("dma", "mxu", "vpu", "sync", "link"))


@dataclass(frozen=True)
class PhaseFigures:
    """One region's figures in a window of a timed program.

    Attributes:
        name: the region's name.
        critical_s: seconds of the window's critical path on its instructions.
        by_cause_s: those seconds by cause (hbm, compute, latency, synchronisation).
        bound: the largest cause, or "overlapped" when ``critical_s`` is 0.
        hbm_bytes, flops: HBM bytes and matrix-unit FLOPs of all its instructions.
        flops_by_format: FLOPs per matrix-unit rate ("mxfp4", "mxfp8", "bf16").
        lower_bound_s: its own roofline: bytes at the achievable HBM rate or FLOPs at peak.
        start_s, end_s: first start and last end of its instructions.
        instructions: how many it has.
        cores_used: cores that ran any of its work (transfers, matmuls, vector operations).
        critical_engine: the engine with the largest share of its critical seconds (None when
            none are on the critical path).
    """

    name: str
    critical_s: float
    by_cause_s: dict[str, float]
    bound: str
    hbm_bytes: int
    flops: float
    flops_by_format: dict[str, float]
    lower_bound_s: float
    start_s: float
    end_s: float
    instructions: int
    cores_used: int = 0
    critical_engine: str | None = None

    @property
    def why(self) -> str:
        """One line: its critical seconds by cause (the bound is the largest), where they are spent."""
        return why_of_causes(self.by_cause_s, self.critical_engine)

    def as_dict(self) -> dict[str, Any]:
        """Plain values."""
        return {"name": self.name, "critical_s": self.critical_s, "by_cause_s": dict(self.by_cause_s),
                "bound": self.bound, "why": self.why, "hbm_bytes": self.hbm_bytes, "flops": self.flops,
                "lower_bound_s": self.lower_bound_s, "start_s": self.start_s, "end_s": self.end_s,
                "instructions": self.instructions, "cores_used": self.cores_used,
                "critical_engine": self.critical_engine}


def why_of_causes(by_cause_s: dict[str, float], engine: str | None = None) -> str:
    """"compute 55%, latency 30%, hbm 15% of 12.3 µs on the critical path (most on c3.mxu)" from
    critical seconds by cause: the same figures the bound is the largest of."""
    total = sum(by_cause_s.values())
    if total <= 0:
        return "overlapped: none of its time is on the critical path"
    parts = ", ".join(f"{c} {v / total:.0%}" for c, v in sorted(by_cause_s.items(), key=lambda kv: -kv[1])
                      if v / total >= 0.005)
    where = f" (most on {engine})" if engine else ""
    return f"{parts} of {total * 1e6:.3g} µs on the critical path{where}"


def region_of_instructions(tl: Timeline) -> tuple[list[str], np.ndarray]:
    """(region names, int32[n] index of each instruction's region, -1 outside any) of the
    program's ``regions`` meta (``KernelBuilder.region``)."""
    regions = dict(tl.program.meta).get("regions", ())
    names = [name for name, _ in regions]
    owner = np.full(tl.program.n_instructions, -1, dtype=np.int32)
    for k, (_, ranges) in enumerate(regions):
        for a, b in ranges:
            owner[a:b] = k
    return names, owner


def region_spans(tl: Timeline) -> dict[str, tuple[float, float]]:
    """Region name -> (first start, last end) of its instructions, s (launch excluded)."""
    names, owner = region_of_instructions(tl)
    out = {}
    for k, name in enumerate(names):
        sel = owner == k
        if sel.any():
            out[name] = (float(tl.start_s[sel].min()), float(tl.end_s[sel].max()))
    return out


def path_steps(tl: Timeline, *, end_instruction: int | None = None,
               start_s: float = 0.0) -> list[tuple[int, float]]:
    """The critical path into ``end_instruction`` (default: the instruction that ends last), cut
    at ``start_s``: (instruction index, seconds of the window it accounts for), first to last.

    Each instruction accounts for its end minus the latest end before it on the path (or
    ``start_s``); instructions that add nothing inside the window are left out, so the seconds add
    up to the window exactly.
    """
    n = len(tl.end_s)
    if not n:
        return []
    i = int(np.argmax(tl.end_s)) if end_instruction is None else end_instruction
    path = []
    pred = tl.pred.tolist()
    while i >= 0 and len(path) <= n:
        path.append(i)
        i = pred[i]
    path.reverse()
    out = []
    prev = 0.0
    for i, end in zip(path, tl.end_s[path].tolist(), strict=True):
        lo = max(prev, start_s)
        prev = max(prev, end)
        if end > lo:
            out.append((i, end - lo))
    return out


def step_cause(tl: Timeline, i: int) -> str:
    """What instruction ``i``'s time beyond its fixed costs is spent on: "hbm" (an HBM transfer),
    "compute" (matrix or vector work), "synchronisation" (a semaphore) or "latency" (anything
    else: on-chip copies, links)."""
    c = int(tl.category[i])
    if c == _DMA:
        return "hbm" if tl.hbm[i] else "latency"
    if c in (_MXU, _VPU):
        return "compute"
    return "synchronisation" if c == _SYNC else "latency"


def phase_figures(tl: Timeline, *, end_instruction: int | None = None, start_s: float = 0.0,
                  names: list[str] | None = None) -> list[PhaseFigures]:
    """Per region (or those in ``names``), its figures over the window from ``start_s`` to the end
    of ``end_instruction`` (default: the program's last instruction), s.

    The critical path is followed back from ``end_instruction``; each step of it (an
    instruction's end minus the end of the one before it on the path) is cut to the window and
    counted for the region the instruction belongs to, split into fixed costs and work by the
    instruction's kind. Bytes and FLOPs are every instruction of the region's, wherever it ran.
    """
    all_names, owner = region_of_instructions(tl)
    causes = ("hbm", "compute", "latency", "synchronisation")
    crit = np.zeros((len(all_names) + 1, len(causes)))  # last row: outside any region
    on_engine: dict[tuple[int, int], float] = {}  # (row, engine index) -> critical seconds
    fixed = tl.fixed_s
    for i, step in path_steps(tl, end_instruction=end_instruction, start_s=start_s):
        fix = min(float(fixed[i]), step)
        work = step_cause(tl, i)
        row = owner[i] if owner[i] >= 0 else len(all_names)
        crit[row, causes.index("latency")] += fix
        crit[row, causes.index(work)] += step - fix
        key = (int(row), int(tl.engine_index[i]))
        on_engine[key] = on_engine.get(key, 0.0) + step
    d = tl.spec.derived()
    engine_core = np.array([e.core for e in tl.engines], dtype=np.int64)
    working = tl.category != _SYNC
    lead: dict[int, tuple[float, int]] = {}
    for (row, e), sec in on_engine.items():
        if sec > lead.get(row, (0.0, -1))[0]:
            lead[row] = (sec, e)
    out = []
    for k, name in enumerate(all_names):
        if names is not None and name not in names:
            continue
        sel = owner == k
        fmt = {f: float(tl.flops[sel & (tl.flop_format == j)].sum()) for j, f in enumerate(FORMATS)}
        hbm_bytes = int(tl.bytes[sel & tl.hbm].sum())
        lower = max(hbm_bytes / d["hbm_achievable_bytes_per_s"],
                    sum(fmt[f] / d[f"peak_{f}_flops_per_s"] for f in FORMATS))
        by = {c: float(crit[k, j]) for j, c in enumerate(causes)}
        total = sum(by.values())
        bound = max(by, key=by.get) if total > 0 else "overlapped"
        out.append(PhaseFigures(
            name=name, critical_s=total, by_cause_s=by, bound=bound, hbm_bytes=hbm_bytes,
            flops=float(tl.flops[sel].sum()), flops_by_format=fmt, lower_bound_s=lower,
            start_s=float(tl.start_s[sel].min()) if sel.any() else 0.0,
            end_s=float(tl.end_s[sel].max()) if sel.any() else 0.0, instructions=int(sel.sum()),
            cores_used=len(set(engine_core[tl.engine_index[sel & working]].tolist()) - {-1}),
            critical_engine=str(tl.engines[lead[k][1]]) if k in lead else None))
    return out
