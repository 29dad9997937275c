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
    # Engines by position (lists, not dicts keyed by Engine): a fused step visits its hundreds of
    # engines once a pass, and hashing them was most of the walk's time.
    stream_of = [streams[e] for e in engines]
    turn = list(range(len(engines)))
    rng = None
    if seed is not None:
        import random

        rng = random.Random(seed)
    heads = [0] * len(engines)
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
            rng.shuffle(turn)  # (the same permutations as shuffling the engines themselves)
        for k in turn:
            stream = stream_of[k]
            head, end = heads[k], len(stream)
            steps = 0
            while head < end and (rng is None or steps < rng.randint(1, 3)):
                steps += 1
                idx = stream[head]
                ins = instrs[idx]
                mn = ins.mnemonic
                if mn == "sem.wait" and sem_count[ins.arg("sem")] < ins.arg("value"):
                    break
                if mn == "barrier":
                    bid = ins.arg("id")
                    barrier_arrived[bid].add(engines[k])
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
                head += 1
                remaining -= 1
                progress = True
            heads[k] = head
    if remaining:
        raise deadlock_error(program, streams, dict(zip(engines, heads, strict=True)), sem_count,
                             barrier_arrived)
    return order


def deadlock_error(program, streams, heads, sem_count, barrier_arrived) -> Deadlock:
    """The Deadlock blaming the wait that can never be met, then naming every blocked engine.

    The headline is a ``sem.wait`` whose value exceeds its semaphore's count plus every signal that
    other engines still have to send (its own engine's later signals come after it), a
    ``barrier`` that fewer engines can still reach than it needs, or a ``link.recv`` whose send no
    other engine still has; with no such wait, engines wait for each other in a cycle, and the
    headline is that cycle. Blocked engines that wait only because of it (victims) are listed
    below the headline. The error's instruction, engine and source are the headline wait's.

    Args: the program, its streams (engine -> indices), each engine's next position, the semaphore
    counts reached, and barrier id -> engines that arrived (the scheduler's and timing pass's state).
    """
    names = dict(program.semaphores)
    instrs = program.instructions
    # What the blocked engines still have to do: signals per semaphore, sends per (peer, tag) and
    # barrier arrivals, per engine.
    signals_left: dict[int, dict] = defaultdict(lambda: defaultdict(int))
    sends_left: dict[tuple[int, int], dict] = defaultdict(lambda: defaultdict(int))
    barrier_left: dict[int, set] = defaultdict(set)
    blocked = []
    for eng, stream in sorted(streams.items()):
        if heads[eng] >= len(stream):
            continue
        blocked.append((eng, stream[heads[eng]]))
        for j in stream[heads[eng]:]:
            ins = instrs[j]
            if ins.mnemonic == "sem.signal":
                signals_left[ins.arg("sem")][eng] += ins.arg("count")
            elif ins.mnemonic == "link.send":
                sends_left[link_key(ins)][eng] += 1
            elif ins.mnemonic == "barrier":
                barrier_left[ins.arg("id")].add(eng)

    def where(eng, idx: int) -> str:
        src = instrs[idx].source
        return f"{eng} #{idx}" + (f" ({src})" if src else "")

    lines, hopeless, deps = [], [], {}
    for eng, idx in blocked:
        ins = instrs[idx]
        if ins.mnemonic == "sem.wait":
            sem, value = ins.arg("sem"), ins.arg("value")
            who = f"semaphore {sem}" + (f" ({names[sem]})" if sem in names else "")
            others = {e: c for e, c in signals_left[sem].items() if e != eng}
            own = signals_left[sem].get(eng, 0)
            reach = sem_count[sem] + sum(others.values())
            what = f"waits for {who} >= {value}"
            lines.append(f"{where(eng, idx)} {what} (count {sem_count[sem]}, {sum(others.values())} more "
                         "can only come from blocked engines"
                         + (f", {own} from its own signals after the wait" if own else "") + ")")
            if reach < value:
                more = sum(others.values())
                hopeless.append((idx, eng, f"{where(eng, idx)} {what}, which can never be met: its count "
                                 f"is {sem_count[sem]}, and "
                                 + (f"other engines signal it only {more} more" if more else
                                    "no other engine signals it again")
                                 + (f" (the {own} its own engine signals later come only after the wait)"
                                    if own else "")))
            deps[eng] = (idx, what, sorted(others))
        elif ins.mnemonic == "barrier":
            bid, count = ins.arg("id"), ins.arg("count")
            arrived = set(barrier_arrived[bid])
            coming = barrier_left[bid] - arrived
            what = f"waits at barrier {bid} for {count} engines"
            lines.append(f"{where(eng, idx)} waits at barrier {bid} ({len(arrived)} of {count} engines "
                         "arrived)")
            if len(arrived) + len(coming) < count:
                hopeless.append((idx, eng, f"{where(eng, idx)} {what}, which can never be met: "
                                 f"{len(arrived)} arrived and only {len(coming)} more ever reach it"))
            deps[eng] = (idx, what, sorted(coming))
        else:
            key = link_key(ins)
            others = sorted(e for e in sends_left[key] if e != eng)
            what = f"waits for link.send peer={key[0]} tag={key[1]}"
            lines.append(f"{where(eng, idx)} {what}")
            if not others:
                hopeless.append((idx, eng, f"{where(eng, idx)} {what}, which no other engine still "
                                 "sends"))
            deps[eng] = (idx, what, others)
    if hopeless:
        idx, eng, headline = min(hopeless, key=lambda h: h[0])
        hint = ("the wait asks for more than the rest of the program can give: lower its value or "
                "add the missing signal, barrier arrival or link.send")
    elif blocked:
        # Every blocked engine waits for another blocked one: follow the first of each until an
        # engine repeats; that loop is the deadlock, the rest wait on it.
        path, seen, eng = [], {}, blocked[0][0]
        while eng not in seen:
            seen[eng] = len(path)
            path.append(eng)
            eng = deps[eng][2][0]
        cycle = path[seen[eng]:]
        start = min(range(len(cycle)), key=lambda k: deps[cycle[k]][0])
        cycle = cycle[start:] + cycle[:start]
        parts = [f"{where(e, deps[e][0])} {deps[e][1]}, which only {nxt} can still satisfy"
                 for e, nxt in zip(cycle, cycle[1:] + cycle[:1], strict=True)]
        eng, idx = cycle[0], deps[cycle[0]][0]
        headline = "engines wait for each other in a cycle: " + "; ".join(parts) + ", after its own wait"
        hint = "every sem.wait needs signals that are not themselves behind the wait"
    else:  # pragma: no cover - called only when instructions remain
        idx, eng, headline, hint = None, None, "nothing is blocked", None
    first = instrs[idx] if idx is not None else None
    return Deadlock(
        f"no engine can make progress: {headline}. Blocked: " + "; ".join(lines),
        index=idx,
        engine=str(first.engine) if first else None,
        source=first.source if first else None,
        hint=hint,
    )
