"""A legal sequential order of a Program's instructions, honouring semaphores, barriers and links.

Stage: emulator. The functional pass executes instructions in this order, and the checker walks
it; for a race-free program every legal order gives the same results. A program with no legal
complete order deadlocks: ``Deadlock`` says which engine waits on what, and what could still
signal it.
"""

from __future__ import annotations

from collections import defaultdict

from jalapeno_emu.errors import Deadlock
from jalapeno_emu.isa.program import Instruction, Program

__all__ = ["deadlock_error", "link_key", "sequential_order"]


def link_key(ins: Instruction) -> tuple[int, int]:
    """(peer, tag) that pairs a ``link.send`` with its ``link.recv`` on a single chip."""
    return ins.arg("peer"), ins.arg("tag")


def sequential_order(program: Program, *, seed: int | None = None) -> list[int]:
    """Instruction indices in an order every engine could have run them.

    Engines run in issue order; ``sem.wait`` blocks until enough ``sem.signal`` counts have
    executed; ``barrier`` blocks until ``count`` engines reached it; ``link.recv`` blocks until the
    matching ``link.send`` ran. By default the lowest-numbered runnable engine always goes first,
    so the order is deterministic; with ``seed`` the engines take turns one instruction at a time
    in a seeded random order, giving another legal interleaving (a race-free program must give
    the same results under every one).

    Raises:
        Deadlock: no engine can make progress while instructions remain.
    """
    streams = program.streams()
    engines = sorted(streams)
    rng = None
    if seed is not None:
        import random

        rng = random.Random(seed)
    heads = dict.fromkeys(engines, 0)
    sem_count: dict[int, int] = defaultdict(int)
    barrier_arrived: dict[int, set] = defaultdict(set)
    barrier_released: set[int] = set()
    sends_done: dict[tuple[int, int], int] = defaultdict(int)
    recvs_done: dict[tuple[int, int], int] = defaultdict(int)
    order: list[int] = []
    remaining = len(program.instructions)
    instrs = program.instructions
    progress = True
    while remaining and progress:
        progress = False
        if rng is not None:
            rng.shuffle(engines)
        for eng in engines:
            stream = streams[eng]
            steps = 0
            while heads[eng] < len(stream) and (rng is None or steps < rng.randint(1, 3)):
                steps += 1
                idx = stream[heads[eng]]
                ins = instrs[idx]
                mn = ins.mnemonic
                if mn == "sem.wait" and sem_count[ins.arg("sem")] < ins.arg("value"):
                    break
                if mn == "barrier":
                    bid = ins.arg("id")
                    barrier_arrived[bid].add(eng)
                    if len(barrier_arrived[bid]) >= ins.arg("count"):
                        barrier_released.add(bid)
                    if bid not in barrier_released:
                        break
                if mn == "link.recv":
                    key = link_key(ins)
                    if sends_done[key] <= recvs_done[key]:
                        break
                    recvs_done[key] += 1
                if mn == "sem.signal":
                    sem_count[ins.arg("sem")] += ins.arg("count")
                elif mn == "link.send":
                    sends_done[link_key(ins)] += 1
                order.append(idx)
                heads[eng] += 1
                remaining -= 1
                progress = True
    if remaining:
        raise deadlock_error(program, streams, heads, sem_count, barrier_arrived)
    return order


def deadlock_error(program, streams, heads, sem_count, barrier_arrived) -> Deadlock:
    """The Deadlock naming every blocked engine, what it waits on, and what could still signal it.

    Args: the program, its streams (engine -> indices), each engine's next position, the semaphore
    counts reached, and barrier id -> engines that arrived (the scheduler's and timing pass's state).
    """
    names = dict(program.semaphores)
    waits = []
    first_idx = None
    for eng, stream in sorted(streams.items()):
        if heads[eng] >= len(stream):
            continue
        idx = stream[heads[eng]]
        ins = program.instructions[idx]
        first_idx = idx if first_idx is None else first_idx
        if ins.mnemonic == "sem.wait":
            sem = ins.arg("sem")
            pending = sum(
                program.instructions[j].arg("count")
                for e2, s2 in streams.items() for j in s2[heads[e2]:]
                if program.instructions[j].mnemonic == "sem.signal"
                and program.instructions[j].arg("sem") == sem
            )
            who = f"semaphore {sem}" + (f" ({names[sem]})" if sem in names else "")
            waits.append(f"{eng} #{idx} waits for {who} >= {ins.arg('value')} (count "
                         f"{sem_count[sem]}, {pending} more can only come from blocked engines)")
        elif ins.mnemonic == "barrier":
            bid = ins.arg("id")
            waits.append(f"{eng} #{idx} waits at barrier {bid} ({len(barrier_arrived[bid])} of "
                         f"{ins.arg('count')} engines arrived)")
        else:
            waits.append(f"{eng} #{idx} waits for link.send peer={ins.arg('peer')} "
                         f"tag={ins.arg('tag')}")
    first = program.instructions[first_idx] if first_idx is not None else None
    return Deadlock(
        "no engine can make progress: " + "; ".join(waits),
        index=first_idx,
        engine=str(first.engine) if first else None,
        source=first.source if first else None,
        hint="every sem.wait needs signals that are not themselves behind the wait",
    )
