"""The timing pass: how long a Program takes on one die. The single source of truth for time.

Stage: emulator, beside the functional pass; both read the same static ``Program``. The timing
pass never reads data (a Program carries none), so it times full-size kernels: the rack model and
every report get their per-die times from here.

How it works: each engine is an in-order queue with its own clock; an event heap holds the time
each engine can next act. Instructions whose effect others see or that share a resource (DMA
issue, signals, barriers, links) are processed in global time order, ties broken by program
order; matmuls, vector operations and waits touch nothing another engine reads, so an engine runs
through them ahead of the global clock without a heap round trip (a wait that is not yet
satisfied parks the engine until the signal that satisfies it). Every instruction's static cost
(cycles, bytes per HBM pseudo-channel) is computed in bulk beforehand (``costs.py``); the loop
only does the arithmetic that depends on other engines. No per-cycle loops anywhere. All
parameters come from the ``ChipSpec``. The loop runs compiled (``timing_core.py``, numba, over
flat arrays); ``tests/emu/timing_reference.py`` keeps the pure-Python loop it replaced as the
oracle that the compiled one must match bit for bit.

Cost models (times in seconds):

- **DMA** (``dma.load/store/copy/gather``): a descriptor is issued by its queue, pays
  ``dma.setup_latency_s``, then moves its bytes. A queue issues its next descriptor right away
  while fewer than ``dma.max_outstanding_per_queue`` are in flight, so streaming hides setup.
  HBM side: ``hbm_map`` splits the bytes over pseudo-channels; each pseudo-channel serves at
  ``bytes_per_s_per_pseudo_channel * efficiency`` in **FIFO order** (each channel keeps a
  "free at" time; a transfer's share starts when it arrives or when the channel finishes the
  transfers before it). FIFO rather than processor sharing because it is work-conserving, so
  bandwidth, channel utilisation and the end of a stream are the same as under fair sharing,
  while a transfer's end is known the moment it is issued (O(channels) once, instead of
  re-rating every transfer in flight at every arrival and departure); what differs is which of
  two concurrent transfers finishes first: a small transfer queued behind a large one waits for
  it, where under sharing it would finish early (so a kernel should issue first what it needs
  first, as it would on hardware with in-order queues). Core side: all queues of a core share
  ``dma.bytes_per_s_per_core``, also FIFO. The transfer ends when both sides are done, plus
  ``hbm.latency_s`` once. ``dma.copy`` (SRAM to SRAM) uses no HBM: its core port runs at
  min(``dma.bytes_per_s_per_core``, ``sram.bytes_per_cycle * core.clock_hz``).
  ``dma.gather``'s row indices are data, which the timing pass never sees: it assumes rows
  0..n-1 of the source (n = dst.rows) at the source's stride. Each row is its own descriptor;
  the queue keeps up to ``max_outstanding_per_queue`` of them in flight, so a gather of n rows
  pays ``ceil(n / max_outstanding) * (setup + HBM latency)`` of fixed cost.
- **Matrix unit** (``mxu.matmul``): ``issue_overhead + ceil(M/tile_m)*ceil(N/tile_n)*
  ceil(K/tile_k) * tile_m*tile_n*tile_k / macs_per_cycle`` cycles at the MXFP4 rate when both
  operands are fp4, BF16 when either is bf16, MXFP8 otherwise; plus ``pipeline_depth_cycles``
  unless the matmul starts exactly when the previous matmul on that unit ended (back-to-back
  matmuls stream through the pipe). FLOPs are 2*M*N*K.
- **Vector unit**: ``issue_overhead + ceil(elements / rate)`` cycles, elements = the source
  tile's rows*cols (times ceil(log2(k+1)) for top-k, twice for quantize), rate = ``lanes``, or
  ``transcendental_elements_per_cycle`` for exp/rsqrt/sigmoid/silu/recip.
- **Semaphores**: ``sem.signal`` takes effect (adds its count) once every earlier instruction of
  its engine has completed, in-flight DMA transfers included; it takes no engine time of its own,
  and a DMA queue does not stop at it: the queue keeps issuing while the signal is pending (so a
  signal orders nothing on its own queue; a ``sem.wait`` does, as the checker assumes).
  ``sem.wait`` ends ``sync.semaphore_latency_cycles`` after the signal that brought the count to
  its value (at once if that is already past). ``barrier`` releases everyone
  ``sync.barrier_latency_cycles`` after the last of ``count`` engines arrived (each id is used
  once; later arrivals pass). Barriers and waits do not wait for a queue's in-flight DMAs; only
  signals do.
- **Link** (``link.send/recv``): alpha-beta, ``link.latency_s + bytes / link.bytes_per_s_per_direction``
  on the link engine; on one chip a ``link.recv`` ends when the matching ``link.send`` (same
  peer and tag, in order) has delivered (loopback).
- **Probe** (``probe``, a debugging read): zero duration at the moment its engine reaches it;
  it is never another instruction's predecessor, so a program times the same with or without
  probes.
- **Launch**: ``sync.kernel_launch_s`` is added once to the kernel's time (``Timeline.time_s``).

When no event is left and instructions remain, the program deadlocks: ``Deadlock`` names every
blocked engine and what it waits on.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from jalapeno_emu.chip import ChipSpec, load_preset
from jalapeno_emu.emu.costs import StaticCosts
from jalapeno_emu.emu.schedule import deadlock_error
from jalapeno_emu.emu.timeline import Timeline
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.program import Engine, Program

__all__ = ["run_timing"]


def _check_fits(engines: tuple[Engine, ...], spec: ChipSpec, program: Program) -> None:
    """Raise if the program uses a core or DMA queue the chip does not have."""
    for eng in engines:
        if eng.unit == "link":
            continue
        if eng.core >= spec.core.count or (eng.unit == "dma" and eng.queue >= spec.dma.queues_per_core):
            raise InvalidArgumentError(
                f"program {program.name!r} uses engine {eng}, which {spec.name} does not have "
                f"({spec.core.count} cores, {spec.dma.queues_per_core} DMA queues each)",
                hint=f"time it on the chip it was built for ({program.preset!r}) or rebuild it")


def event_loop_args(st: StaticCosts, spec: ChipSpec) -> tuple:
    """The arguments of ``timing_core.event_loop`` for a program's static costs on ``spec``."""
    clock = spec.core.clock_hz
    return (st.kind, st.dur, st.extra, st.a1, st.a2, st.facts.engine_index, len(st.facts.engines),
            len(st.facts.semaphore_ids), len(st.barrier_ids), len(st.link_keys),
            st.split_of, st.split_dt, st.split_dense, st.split_min, st.touched_off, st.touched,
            spec.dma.setup_latency_s, spec.hbm.latency_s, spec.dma.max_outstanding_per_queue,
            spec.matrix.pipeline_depth_cycles / clock, spec.sync.semaphore_latency_cycles / clock,
            spec.sync.barrier_latency_cycles / clock)


def run_timing(program: Program, spec: ChipSpec | str) -> Timeline:
    """Time ``program`` on the chip ``spec`` (timing only: no data is read or allocated).

    Args:
        program: a recorded kernel (builder or assembler); any size, since nothing is allocated.
        spec: the chip (a ChipSpec, or a preset name); every cost parameter comes from it (see
            the module docstring).

    Returns:
        A ``Timeline``: per-instruction start/end in seconds from the kernel's start, per-engine
        busy time, bytes per HBM pseudo-channel, FLOPs per format and ``summary()``.

    Raises:
        Deadlock: engines wait on semaphores, barriers or link receives that can never happen;
            the message names each blocked engine and what it waits for.
        InvalidArgumentError: the program uses a core or DMA queue the chip does not have.

    >>> from jalapeno_emu.chip import load_preset
    >>> from jalapeno_emu.isa.builder import KernelBuilder
    >>> kb = KernelBuilder("copy", chip="tiny")
    >>> x, buf = kb.hbm("x", (64, 256), "f32"), kb.sram(0, "buf", (64, 256), "f32")
    >>> _ = kb.core(0).dma[0].load(buf, x)
    >>> tl = run_timing(kb.build(), load_preset("tiny"))
    >>> round(tl.summary()["time_s"] * 1e6, 2)  # launch 2 us + setup 1 us + 64 KiB + HBM 0.5 us
    4.05
    """
    if isinstance(spec, str):
        spec = load_preset(spec)
    st = StaticCosts(program, spec)
    engines, streams = st.facts.engines, st.facts.streams
    _check_fits(engines, spec, program)
    n_eng = len(engines)
    from jalapeno_emu.emu.timing_core import event_loop  # here: numba loads when something is timed

    starts, ends, pred, filled, head, sem_count, arrived = event_loop(*event_loop_args(st, spec))

    if any(head[e] < len(streams[e]) for e in range(n_eng)):
        heads = {engines[e]: int(head[e]) for e in range(n_eng)}
        barrier_arrived: defaultdict = defaultdict(set)
        for i in np.flatnonzero(arrived).tolist():
            barrier_arrived[int(st.barrier_ids[st.a1[i]])].add(engines[st.facts.engine_index[i]])
        raise deadlock_error(program, dict(zip(engines, streams, strict=True)), heads,
                             defaultdict(int, zip(st.facts.semaphore_ids.tolist(), sem_count.tolist(),
                                                  strict=True)),
                             barrier_arrived)

    return timeline_of(program, spec, st, starts, ends, pred, filled)


def timeline_of(program: Program, spec: ChipSpec, st: StaticCosts, starts: np.ndarray, ends: np.ndarray,
                pred: np.ndarray, filled: np.ndarray) -> Timeline:
    """The Timeline of an event loop's result: per-instruction ``starts``/``ends`` (s) and critical
    predecessors ``pred`` (-1: none), and the matmuls that paid the pipeline fill (``filled``,
    instruction indices), with the static costs ``st`` (the compiled loop and the test oracle
    both end here)."""
    fixed = st.fixed
    fixed[filled] += spec.matrix.pipeline_depth_cycles / spec.core.clock_hz
    return Timeline(
        program=program,
        spec=spec,
        engines=st.facts.engines,
        start_s=starts,
        end_s=ends,
        engine_index=st.facts.engine_index,
        category=st.category,
        bytes=st.nbytes,
        hbm=st.hbm,
        flops=st.flops,
        flop_format=st.fmt,
        fixed_s=fixed,
        work_s=st.work,
        core_dma_s=st.core_dma,
        pred=pred,
        hbm_bytes_per_channel=st.channel_bytes,
        launch_s=spec.sync.kernel_launch_s,
    )
