"""Vector clocks of the checker's ordering model: which instruction happens before which.

Stage: emulator, under ``check`` (the ordering model is in its module docstring, the same one the
timing pass implements). ``Clocks`` walks a program in a legal order and gives each instruction
its vector clock; ``later_signals`` finds, per ``sem.wait``, the signals that can only come after
it (they cannot help satisfy it), as a fixed point of walks.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Mapping

from jalapeno_emu.emu.schedule import link_key
from jalapeno_emu.isa.program import Engine, Instruction, Program

__all__ = ["Clocks", "later_signals"]


class Clocks:
    """Vector clocks implementing the ordering model in ``check``'s module docstring.

    Args:
        sem_signals: per semaphore, each engine's signal count over the whole program.
        later: per ``sem.wait`` (its instruction index), the signal counts on its semaphore, per
            signalling engine, known to happen after the wait (:func:`later_signals`); they
            cannot help satisfy it.
    """

    def __init__(self, sem_signals: Mapping[int, Mapping[Engine, int]],
                 later: Mapping[int, Mapping[Engine, int]]) -> None:
        self.engine_vc: dict[Engine, dict[Engine, int]] = defaultdict(dict)
        self.counter: dict[Engine, int] = defaultdict(int)
        # Per semaphore, per signalling engine: its cumulative counts (increasing) and the clock
        # of each of its signals, so a wait finds the signal it needs by bisection instead of
        # scanning every signal so far (which made the walk quadratic in the program).
        self.signal_vcs: dict[int, dict[Engine, tuple[list[int], list[dict]]]] = defaultdict(dict)
        self.sends: dict[tuple[int, int], deque[dict]] = defaultdict(deque)
        self.cumulative: dict[tuple[int, Engine], int] = {}  # (sem, engine) -> its signals so far
        self.pending_barrier: dict[int, list[tuple[Engine, dict]]] = defaultdict(list)
        self.sem_signals = sem_signals
        self.sem_totals = {sem: sum(per_engine.values()) for sem, per_engine in sem_signals.items()}
        self.later = later
        # What later_signals needs once the walk is over: every signal's (sem, engine, count,
        # clock) and every wait's (index, sem, engine, id).
        self.signals: list[tuple[int, Engine, int, dict]] = []
        self.waits: list[tuple[int, int, Engine, int]] = []

    def _record_signal(self, ins: Instruction, eng: Engine, vc: dict) -> None:
        sem, count = ins.arg("sem"), ins.arg("count")
        cum = self.cumulative[(sem, eng)] = self.cumulative.get((sem, eng), 0) + count
        cums, vcs = self.signal_vcs[sem].setdefault(eng, ([], []))
        cums.append(cum)
        vcs.append(dict(vc))
        self.signals.append((sem, eng, count, vcs[-1]))

    @staticmethod
    def join(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            if out.get(k, 0) < v:
                out[k] = v
        return out

    def step(self, idx: int, ins: Instruction) -> tuple[Engine, int, dict]:
        """(engine, id, vector clock) of instruction ``idx``'s memory accesses; call in a legal order.

        The clock returned is shared with the walk's own state: read it, do not change it.
        """
        eng = ins.engine
        self.counter[eng] += 1
        my_id = self.counter[eng]
        mn = ins.mnemonic
        if eng.unit == "dma":
            # A DMA queue's own progress never advances its clock component: only a signal, which
            # takes effect once every earlier transfer has completed, vouches for them.
            vc = self.engine_vc[eng]
            if mn == "sem.signal":
                sig_vc = dict(vc)
                sig_vc[eng] = my_id
                self._record_signal(ins, eng, sig_vc)
                return eng, my_id, vc
            if mn not in ("sem.wait", "barrier"):
                return eng, my_id, vc
            vc = dict(vc)
        else:
            vc = dict(self.engine_vc[eng])
            vc[eng] = my_id
        if mn == "sem.wait":
            self.waits.append((idx, ins.arg("sem"), eng, my_id))
            vc = self._wait_join(vc, idx, ins.arg("sem"), ins.arg("value"))
        elif mn == "link.recv":
            sends = self.sends[link_key(ins)]
            if sends:
                vc = self.join(vc, sends.popleft())
        self.engine_vc[eng] = vc
        if mn == "sem.signal":
            self._record_signal(ins, eng, vc)
        elif mn == "link.send":
            self.sends[link_key(ins)].append(dict(vc))
        elif mn == "barrier":
            self._arrive(ins.arg("id"), ins.arg("count"), eng, vc)
        return eng, my_id, vc

    def _wait_join(self, vc: dict, idx: int, sem: int, need: int) -> dict:
        """``vc`` joined with the clocks of the signals wait ``idx`` (sem >= need) is known to follow."""
        later = self.later.get(idx, {})
        per_engine = self.sem_signals.get(sem, {})
        # Everything signalled on sem except what is known to come after this wait.
        possible = self.sem_totals.get(sem, 0) - sum(later.values())
        for sig_eng, (cums, vcs) in self.signal_vcs[sem].items():
            # Only the first signal of sig_eng that every schedule needs is known to precede
            # the wait; later ones from that engine may come after it. The others can
            # contribute at most what they signal short of their signals after the wait.
            others = possible - (per_engine.get(sig_eng, 0) - later.get(sig_eng, 0))
            need_here = need - others
            if need_here > 0:
                k = bisect.bisect_left(cums, need_here)  # its first signal reaching that
                if k < len(cums):
                    vc = self.join(vc, vcs[k])
        return vc

    def _arrive(self, bid: int, count: int, eng: Engine, vc: dict) -> None:
        """One engine reaches barrier ``bid``; the last of ``count`` joins every participant's clock."""
        pending = self.pending_barrier[bid]
        pending.append((eng, vc))
        if len(pending) >= count:
            joined: dict = {}
            for _, v in pending:
                joined = self.join(joined, v)
            for e, _ in pending:
                self.engine_vc[e] = self.join(self.engine_vc[e], joined)

    def signals_after_waits(self) -> dict[int, dict[Engine, int]]:
        """Per wait seen so far (instruction index): signal counts on its semaphore, per signalling
        engine, whose clocks show them after the wait.

        A signal follows wait #w of engine E when its clock's E component is at least w: it comes
        after an instruction of E issued at or after the wait (for a DMA queue, a signal of the
        queue issued after the wait, which the queue cannot reach before the wait is satisfied).
        """
        groups: dict[tuple[int, Engine], list[tuple[int, int]]] = defaultdict(list)
        for idx, sem, eng, my_id in self.waits:
            groups[(sem, eng)].append((my_id, idx))
        by_sem: dict[int, list[tuple[Engine, int, dict]]] = defaultdict(list)
        for sem, eng, count, vc in self.signals:
            by_sem[sem].append((eng, count, vc))
        out: dict[int, dict[Engine, int]] = {}
        for (sem, weng), waits in groups.items():
            waits.sort()
            ids = [my_id for my_id, _ in waits]
            # A signal whose clock shows weng at c follows the waits with id <= c, a prefix of the
            # sorted waits: add its count over that prefix with a difference array per engine.
            diff: dict[Engine, list[int]] = {}
            for sig_eng, count, vc in by_sem[sem]:
                k = bisect.bisect_right(ids, vc.get(weng, 0))
                if k:
                    d = diff.setdefault(sig_eng, [0] * (len(waits) + 1))
                    d[0] += count
                    d[k] -= count
            for sig_eng, d in diff.items():
                running = 0
                for i, (_, idx) in enumerate(waits):
                    running += d[i]
                    if running:
                        out.setdefault(idx, {})[sig_eng] = running
        return out


def later_signals(program: Program, order: list[int], sem_signals: Mapping[int, Mapping[Engine, int]],
                   max_rounds: int = 8, clocks: type[Clocks] | None = None) -> dict[int, dict[Engine, int]]:
    """Per wait: the signals on its semaphore, per engine, known to happen after it.

    Knowing more of them orders more (fewer signals remain to satisfy a wait, so more are
    required before it), which in turn puts more signals after other waits: iterate the clocks
    from "none known" to a fixed point. Every round only adds orderings that hold in every
    schedule, so stopping after ``max_rounds`` (rare: one round per link of a chain of waits on
    reused semaphores) is safe: it can only report a race that more rounds would have cleared.

    ``clocks``: the clock class (default :class:`Clocks`; the tests pass a scanning one to check
    this one against).
    """
    if not any(ins.mnemonic == "sem.wait" for ins in program.instructions):
        return {}
    make = clocks or Clocks
    later: dict[int, dict[Engine, int]] = {}
    for _ in range(max_rounds):
        vc = make(sem_signals, later)
        for idx in order:
            vc.step(idx, program.instructions[idx])
        found = vc.signals_after_waits()
        if found == later:
            break
        later = found
    return later
