"""The critical path of a timed program, as runs a reader can follow: what waited on what.

Stage: emulator output, beside ``phases.py``. ``phases.phase_figures`` says how many seconds of
the critical path each operator accounts for; this says in what order: the path (``Timeline.pred``
followed back from an instruction) with consecutive instructions of one operator, engine and
mnemonic merged into a run, each with the seconds it adds, when it ran and the kernel line that
issued its first instruction. ``layer --path`` and ``kernel --path`` print it; it is how a
kernel's gap to its roofline is traced to a DMA set-up, a late signal or a busy matrix unit
(``docs/fusion.md`` reads such paths).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from jalapeno_emu.emu.phases import path_steps, region_of_instructions, step_cause
from jalapeno_emu.emu.timeline import Timeline

__all__ = ["PathRun", "critical_path_runs", "launched_path_runs"]


@dataclass(frozen=True)
class PathRun:
    """Consecutive instructions on the critical path with one operator, engine and mnemonic.

    Attributes:
        operator: the builder region (an operator of a fused program) they belong to, or
            ``label`` for instructions outside every region (a stand-alone kernel).
        engine: the engine they ran on ("c3.dma0").
        mnemonic: their mnemonic.
        count: how many instructions.
        critical_s: seconds of the window the run accounts for (the runs add up to the window).
        fixed_s: of those, fixed costs (DMA set-up, HBM latency, issue overhead, pipeline fill).
        cause: what the rest is spent on: "hbm", "compute", "latency" or "synchronisation"
            (``phases.step_cause`` of its first instruction).
        start_s, end_s: the first instruction's start and the last one's end, s from the program's
            start (launch excluded).
        source: "file:line" that issued the first instruction.
    """

    operator: str
    engine: str
    mnemonic: str
    count: int
    critical_s: float
    fixed_s: float
    cause: str
    start_s: float
    end_s: float
    source: str

    def as_dict(self) -> dict[str, Any]:
        """Plain values."""
        return {"operator": self.operator, "engine": self.engine, "mnemonic": self.mnemonic,
                "count": self.count, "critical_s": self.critical_s, "fixed_s": self.fixed_s,
                "cause": self.cause, "start_s": self.start_s, "end_s": self.end_s, "source": self.source}


def critical_path_runs(tl: Timeline, *, end_instruction: int | None = None, start_s: float = 0.0,
                       label: str = "") -> list[PathRun]:
    """The critical path into ``end_instruction`` (default: the instruction that ends last), cut at
    ``start_s`` (s), as runs, first to last (see the module docstring).

    Args:
        tl: a timed program.
        end_instruction: the instruction the path ends at (an operator's last, for its layer's
            stretch of a fused step).
        start_s: where the window starts; what the path spends before it is left out.
        label: the operator name of instructions outside every builder region.

    Returns:
        Runs whose ``critical_s`` add up to the window (end of ``end_instruction`` - ``start_s``).
    """
    names, owner = region_of_instructions(tl)
    instructions = tl.program.instructions
    fixed = tl.fixed_s
    runs: list[PathRun] = []
    for i, step in path_steps(tl, end_instruction=end_instruction, start_s=start_s):
        ins = instructions[i]
        operator = names[owner[i]] if owner[i] >= 0 else label
        engine = str(tl.engines[tl.engine_index[i]])
        fix = min(float(fixed[i]), step)
        last = runs[-1] if runs else None
        same = last is not None and (last.operator, last.engine, last.mnemonic) == (operator, engine,
                                                                                    ins.mnemonic)
        if same:
            runs[-1] = PathRun(operator, engine, ins.mnemonic, last.count + 1, last.critical_s + step,
                               last.fixed_s + fix, last.cause, last.start_s, float(tl.end_s[i]), last.source)
        else:
            runs.append(PathRun(operator, engine, ins.mnemonic, 1, step, fix, step_cause(tl, i),
                                float(tl.start_s[i]), float(tl.end_s[i]), ins.source))
    return runs


def launched_path_runs(tl: Timeline, *, label: str = "", at_s: float = 0.0) -> list[PathRun]:
    """A whole program's path with its launch first: a run ``launch`` on engine ``host`` for
    ``tl.launch_s``, then :func:`critical_path_runs` (``label`` for instructions outside every
    region) after it; times from ``at_s``, so the runs add up to ``tl.time_s``."""
    launch = PathRun(label or "launch", "host", "launch", 1, tl.launch_s, tl.launch_s, "latency", at_s,
                     at_s + tl.launch_s, "")
    shift = at_s + tl.launch_s
    return [launch] + [replace(r, start_s=r.start_s + shift, end_s=r.end_s + shift)
                       for r in critical_path_runs(tl, label=label)]
