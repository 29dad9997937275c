"""Hardware loops from a loop body issued as Python: the steps between two iterations, checked.

Stage: ISA, under the builder (``KernelBuilder.repeat``). A kernel writes a loop body once, as a
function of the iteration index that issues instructions on any engines; the builder issues it for
a few iterations and this module turns them into one ``Loop`` per engine: it splits each
iteration's instructions by engine, finds each operand's step (the difference between two
consecutive iterations: a tile's offset, an integer operand) and checks that another iteration
is exactly what the steps predict. A body whose iterations differ in anything but affine
operands (another instruction, another tile shape, a float) is refused with the first
difference, so a loop never stands for instructions other than the ones the body would issue.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.program import Engine, Instruction, Loop, Tile

__all__ = ["LOOP_MIN_ROUNDS", "by_engine", "issue_in_rounds", "loops_from_iterations"]


def by_engine(instructions: Sequence[Instruction]) -> dict[Engine, list[Instruction]]:
    """The instructions of each engine, in issue order; engines in order of first use."""
    out: dict[Engine, list[Instruction]] = {}
    for ins in instructions:
        out.setdefault(ins.engine, []).append(ins)
    return out


def _where(ins: Instruction, position: int, engine: Engine) -> str:
    at = f" ({ins.source})" if ins.source else ""
    return f"{ins.mnemonic} #{position} of the body on {engine}{at}"


def _steps(a: Instruction, b: Instruction, position: int, engine: Engine) -> tuple[tuple[str, int], ...]:
    """(operand, step) of each operand that differs from ``a`` to ``b``, the next iteration."""
    if a.mnemonic != b.mnemonic or a.source != b.source or len(a.args) != len(b.args):
        raise InvalidArgumentError(
            f"loop body is not the same in every iteration: {_where(a, position, engine)} is "
            f"followed by {b.mnemonic}{f' ({b.source})' if b.source else ''} in the next one",
            hint="a repeated body issues the same instructions in every iteration; branch outside it")
    steps = []
    for (name, x), (name_b, y) in zip(a.args, b.args, strict=True):
        if name != name_b:
            raise InvalidArgumentError(f"loop body: operands of {_where(a, position, engine)} differ "
                                       f"in order ({name!r}, then {name_b!r})")
        if x == y and type(x) is type(y):
            continue
        if type(x) is Tile and type(y) is Tile and (x.space, x.core, x.dtype, x.rows, x.cols, x.stride) == \
                (y.space, y.core, y.dtype, y.rows, y.cols, y.stride):
            steps.append((name, y.offset - x.offset))
        elif type(x) is int and type(y) is int:
            steps.append((name, y - x))
        else:
            raise InvalidArgumentError(
                f"loop body: operand {name!r} of {_where(a, position, engine)} is {x} in one "
                f"iteration and {y} in the next; only tile offsets and integers may change, by the "
                "same step every iteration",
                hint="issue the differing part outside the loop, or make it a function of the index")
    return tuple(steps)


def loops_from_iterations(first: Sequence[Instruction], second: Sequence[Instruction],
                          last: Sequence[Instruction] | None, count: int, *,
                          first_index: int = 0) -> list[Loop]:
    """One Loop per engine for ``count`` iterations, from its first two and its last.

    Args:
        first, second: the instructions of the loop's iterations 0 and 1, as issued (any
            engines, interleaved).
        last: those of iteration ``count - 1``, or None when ``count`` is 2 (nothing to check).
        count: iterations, at least 2.
        first_index: the index the caller gives the loop's iteration 0 (messages only).

    Returns:
        A Loop per engine, in order of the engines' first use in ``first``.

    Raises:
        InvalidArgumentError: the iterations issue different instructions or engines, an operand
            changes in a way that is not a step (a shape, a float, an enum), or the last iteration
            is not what the steps predict (a step that is not constant).
    """
    a, b = by_engine(first), by_engine(second)
    if list(a) != list(b):
        raise InvalidArgumentError(
            f"loop body issues to engines {[str(e) for e in a]} in one iteration and "
            f"{[str(e) for e in b]} in the next; every iteration must use the same engines")
    loops = []
    for engine, body in a.items():
        nxt = b[engine]
        if len(body) != len(nxt):
            raise InvalidArgumentError(
                f"loop body issues {len(body)} instructions to {engine} in one iteration and "
                f"{len(nxt)} in the next", hint="a repeated body issues the same instructions every time")
        steps = tuple(_steps(x, y, k, engine) for k, (x, y) in enumerate(zip(body, nxt, strict=True)))
        loops.append(Loop(engine, tuple(body), count, steps))
    if last is not None:
        shown = count - 1 + first_index  # the last iteration as the caller counts
        got_by_engine = by_engine(last)
        if set(got_by_engine) != set(a):
            raise InvalidArgumentError(
                f"loop body issues to engines {sorted(str(e) for e in got_by_engine)} in iteration "
                f"{shown} and {sorted(str(e) for e in a)} in the first ones")
        for loop in loops:
            want, got = loop.iteration(count - 1), got_by_engine[loop.engine]
            if len(want) != len(got):
                raise InvalidArgumentError(f"loop body issues {len(got)} instructions to {loop.engine} "
                                           f"in iteration {shown} and {len(want)} in the first ones")
            for w, g in zip(want, got, strict=True):
                if w != g:
                    raise InvalidArgumentError(
                        f"loop body is not affine in the index: iteration {shown} issues "
                        f"{g.mnemonic} on {g.engine}{f' ({g.source})' if g.source else ''} with "
                        f"{dict(g.args)}, where the steps of the first iterations give {dict(w.args)}",
                        hint="every changing operand must change by the same amount each iteration")
    return loops


LOOP_MIN_ROUNDS = 4
"""Whole rounds below which steady steps are issued as they are: ``repeat`` unrolls three
iterations or fewer anyway, and a loop still costs four issued iterations to find and check."""


def issue_in_rounds(kb: Any, start: int, stop: int, period: int, steady: Callable[[int, int], bool],
                    issue: Callable[[int], object], min_rounds: int = LOOP_MIN_ROUNDS) -> None:
    """``issue(i)`` for i in range(start, stop), in order, runs of steady steps as hardware loops.

    A run is the steps from some i on for which ``steady(step, i)`` holds: each issues what step
    i does up to affine operands (tile offsets, semaphore counts), and whatever a step uses (its
    buffers, queues, parities) comes round again every ``period`` steps. A run of at least
    ``min_rounds`` whole rounds of ``period`` steps goes out through ``kb.repeat`` (one loop per
    engine ``issue`` uses); the steps after its last whole round, and runs too short for a loop,
    are issued as they are (a shorter run from a later step of the same run is shorter still).

    Args:
        kb: the KernelBuilder.
        start, stop: the steps.
        period: steps per round.
        steady: ``steady(step, first)``: step belongs to the run that starts at ``first``.
        issue: issues one step on the builder.
        min_rounds: the fewest whole rounds worth a loop.
    """
    i = start
    while i < stop:
        run = 0
        while i + run < stop and steady(i + run, i):
            run += 1
        rounds = run // period
        if rounds >= min_rounds:
            kb.repeat(rounds, lambda r, i0=i: [issue(i0 + r * period + b) for b in range(period)])
            i += rounds * period
            continue
        for k in range(i, i + max(1, run)):
            issue(k)
        i += max(1, run)
