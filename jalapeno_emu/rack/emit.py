"""One chip's view of a collective, written into a kernel as ``link.send``/``link.recv`` instructions.

Stage: rack, feeding the emulator. :func:`emit_collective` appends a stepwise collective (see
``collectives.py``) to a :class:`~jalapeno_emu.isa.builder.KernelBuilder` program as the chip of
position ``rank`` sees it, so the timing pass puts the link traffic on the same timeline as the
kernel's compute and HBM transfers.

How a step is written. The emulator runs one chip and its link engine is a loopback: a
``link.recv`` pairs with this chip's own ``link.send`` of the same (peer, tag) (``emu/schedule.py``).
In a collective every chip does its step at the same time, and the chip's ports are full duplex,
so what this chip's ports are busy with in step s is ``max(bytes out, bytes in)``. Each step is
therefore one send of that many bytes and its loopback receive, both naming the step's peer
(the chip sent to, or in a receive-only step the chip received from) and the tag ``tag + s``. The
timing pass charges the send ``LinkSpec.message_s(bytes) = alpha + bytes * beta``, exactly the
per-step cost ``collectives.py`` uses, and the link engine's in-order queue makes each step wait
for the previous one's data, as the algorithm does. So the emitted program's link time equals
the collective's alpha-beta time whenever this chip is (one of) the busiest in every step, which
holds for every uniform collective, and is a lower bound otherwise (a chip that is not the
busiest finishes its part early; the collective's time is set by the busiest).

Data: the bytes move through two staging buffers in HBM, ``<name>.send`` and ``<name>.recv``; the
data is this chip's own (loopback), so the program times the collective but does not compute
its result, and the reduction arithmetic of all_reduce/reduce_scatter is not emitted (schedule
it on the vector units if it matters). Direct algorithms (one_shot, two_shot, direct) post all
messages at once with overlapping latencies, which one in-order link queue cannot express: they
are rejected.

Ordering with the rest of the kernel: ``after`` makes the link engine wait on a semaphore first
(e.g. the signal of the DMA or vector op that produced the data); the returned ``done`` semaphore
is signalled once when the last step has landed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder, Semaphore
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import Space
from jalapeno_emu.rack.collectives import (
    ALGORITHMS,
    DIRECT_ALGORITHMS,
    CollectiveTime,
    byte_matrix,
    chip_ids,
    collective,
    schedule,
)

__all__ = ["EmittedCollective", "LinkStep", "emit_collective"]


@dataclass(frozen=True)
class LinkStep:
    """One step of the collective as the emitting chip sees it (chip ids, not positions).

    Attributes:
        step: the step number s (the instructions carry tag ``tag + s``).
        send_to: the chip this chip sends to, or None.
        send_bytes: bytes it sends.
        recv_from: the chip it receives from, or None.
        recv_bytes: bytes it receives.
        port_bytes: ``max(send_bytes, recv_bytes)``: the bytes of the emitted send/recv pair.
    """

    step: int
    send_to: int | None
    send_bytes: int
    recv_from: int | None
    recv_bytes: int
    port_bytes: int


@dataclass(frozen=True)
class EmittedCollective:
    """What :func:`emit_collective` wrote.

    Attributes:
        timing: the alpha-beta price of the whole collective (all chips), from ``collectives.py``.
        steps: this chip's steps that move bytes, in order.
        done: semaphore signalled (count 1) on the link engine after the last step landed.
    """

    timing: CollectiveTime
    steps: tuple[LinkStep, ...]
    done: Semaphore


def _rank(rank: Any, p: int, op: str) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < p:
        raise InvalidArgumentError(f"{op}: rank={rank!r} must be a chip position in [0, {p})")
    return rank


def _chip_steps(op: str, algorithm: str, ids: tuple[int, ...], payload: Any,
                rank: int) -> tuple[LinkStep, ...]:
    sch = schedule(op, algorithm, len(ids), payload)
    steps = []
    for s in range(sch.send_to.shape[0]):
        to, frm = int(sch.send_to[s, rank]), int(sch.recv_from[s, rank])
        out, inn = int(sch.send_bytes[s, rank]), int(sch.recv_bytes[s, rank])
        if max(out, inn) == 0:
            continue
        steps.append(LinkStep(step=s, send_to=ids[to] if to >= 0 else None, send_bytes=out,
                              recv_from=ids[frm] if frm >= 0 else None, recv_bytes=inn,
                              port_bytes=max(out, inn)))
    return tuple(steps)


def emit_collective(kb: KernelBuilder, op: str, chips: int | Sequence[int], nbytes: Any, *,
                    rank: int, algorithm: str, after: Semaphore | None = None, after_value: int = 1,
                    name: str = "collective", tag: int = 0) -> EmittedCollective:
    """Append chip ``rank``'s part of a stepwise collective to ``kb`` as link sends and receives.

    Args:
        kb: the kernel being built; its chip spec prices the collective.
        op: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"all_to_all"``.
        chips: a count p, or the participating chip ids (the peers the instructions name).
        nbytes: bytes per chip as in ``collectives.collective``, or the [src, dst] byte matrix of
            an all_to_all (int[p, p]).
        rank: this chip's position in ``chips`` (0..p-1).
        algorithm: a stepwise algorithm: ring, recursive_doubling, rabenseifner (all_reduce),
            recursive_halving (reduce_scatter) or pairwise (all_to_all).
        after: if given, the link engine first waits until this semaphore reaches ``after_value``.
        name: prefix of the staging buffers and of the ``done`` semaphore.
        tag: the first step's link tag (step s uses ``tag + s``).

    Returns:
        An :class:`EmittedCollective`: the collective's alpha-beta time, this chip's steps and
        the ``done`` semaphore.

    Raises:
        InvalidArgumentError: a direct algorithm, a rank outside the chips, or any bad argument
            ``collectives.collective`` rejects (zero chips, negative bytes, a matrix of the
            wrong shape), before anything is emitted.
    """
    if op in ALGORITHMS and algorithm in DIRECT_ALGORITHMS:
        raise InvalidArgumentError(
            f"{op}: algorithm={algorithm!r} posts every message at once with overlapping latencies, "
            f"which one in-order link engine cannot express",
            hint=f"emit a stepwise algorithm or price it with collectives.{op}")
    timing = collective(op, chips, nbytes, kb.chip, algorithm)  # validates everything
    ids = chip_ids(chips, kb.chip, op)
    rank = _rank(rank, len(ids), op)
    payload = byte_matrix(nbytes, len(ids), op) if op == "all_to_all" else nbytes
    steps = _chip_steps(op, algorithm, ids, payload, rank)
    if after is not None:
        kb.link.wait(after, after_value)
    largest = max((s.port_bytes for s in steps), default=0)
    if largest:
        send_buf = kb.hbm(f"{name}.send", (1, largest), "u8")
        recv_buf = kb.hbm(f"{name}.recv", (1, largest), "u8")
    for s in steps:
        peer = s.send_to if s.send_to is not None else s.recv_from
        kb.link.send(Tile(Space.HBM, 0, send_buf.offset, "u8", 1, s.port_bytes), peer, tag + s.step)
        kb.link.recv(Tile(Space.HBM, 0, recv_buf.offset, "u8", 1, s.port_bytes), peer, tag + s.step)
    done = kb.semaphore(f"{name}.done")
    kb.link.signal(done, 1)
    return EmittedCollective(timing=timing, steps=steps, done=done)
