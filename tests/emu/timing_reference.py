"""The timing pass's event loop as it was in pure Python, kept as the oracle of the compiled one.

``jalapeno_emu/emu/timing_core.py`` runs this loop compiled with numba; ``test_timing_core.py``
checks that both give bit-identical starts, ends, critical-path predecessors and pipeline fills
(and the same deadlock errors) on every program the test suite builds. Not used by the product.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import defaultdict

import numpy as np

from jalapeno_emu.chip import ChipSpec, load_preset
from jalapeno_emu.emu.costs import BARRIER, COPY, HBM, MXU, PROBE, SEND, SIGNAL, VEC, WAIT, StaticCosts
from jalapeno_emu.emu.schedule import deadlock_error
from jalapeno_emu.emu.timeline import Timeline
from jalapeno_emu.emu.timing import _check_fits, timeline_of
from jalapeno_emu.isa.program import Program

__all__ = ["reference_run_timing"]


def reference_run_timing(program: Program, spec: ChipSpec | str) -> Timeline:
    """``run_timing`` with the event loop in pure Python (the loop before it was compiled)."""
    if isinstance(spec, str):
        spec = load_preset(spec)
    st = StaticCosts(program, spec)
    engines, streams = st.facts.engines, st.facts.streams
    _check_fits(engines, spec, program)
    n = len(program.instructions)
    n_eng = len(engines)
    clock = spec.core.clock_hz
    setup = spec.dma.setup_latency_s
    hbm_lat = spec.hbm.latency_s
    max_out = spec.dma.max_outstanding_per_queue
    fill_s = spec.matrix.pipeline_depth_cycles / clock
    sem_lat = spec.sync.semaphore_latency_cycles / clock
    bar_lat = spec.sync.barrier_latency_cycles / clock

    # The arrays the compiled loop reads, back as the lists and tuples this loop was written for.
    kind, dur, extra, a1, a2 = (x.tolist() for x in (st.kind, st.dur, st.extra, st.a1, st.a2))
    off = st.touched_off
    entries = [(st.split_dt[u], None if st.split_dense[u] else st.touched[off[u]:off[u + 1]],
                float(st.split_min[u])) for u in range(len(st.split_dt))]
    chan: list = [None] * n
    for i in np.flatnonzero(st.split_of >= 0).tolist():
        chan[i] = entries[st.split_of[i]]
    starts = [0.0] * n
    ends = [0.0] * n
    pred = [-1] * n
    fills: list[int] = []  # matmuls that paid the pipeline fill
    head = [0] * n_eng
    gate = [-1] * n_eng  # per engine: the instruction whose end made it ready (critical path)
    outstanding: list[list] = [[] for _ in range(n_eng)]  # DMA queues: heap of (end, index)
    last_mm = [-1.0] * n_eng
    core_free: dict[int, float] = defaultdict(float)
    chan_free = np.zeros(spec.hbm.pseudo_channels, dtype=np.float64)
    floor = 0.0  # no pseudo-channel is free before this time
    np_maximum, np_add, max_reduce, take = np.maximum, np.add, np.maximum.reduce, chan_free.take
    n_sem = len(st.facts.semaphore_ids)  # semaphores are numbered 0..n_sem-1 here
    sem_count = [0] * n_sem
    sem_hist = [([], [], []) for _ in range(n_sem)]  # (counts, times, signal index) per signal
    waiters: list[list] = [[] for _ in range(n_sem)]  # heap of (value, seq, engine, t, index)
    arrived: dict[int, list] = defaultdict(list)  # barrier -> [(engine, t, index)]
    released: dict[int, tuple[float, int]] = {}
    sends: dict = defaultdict(list)  # link key -> [(delivered, index)]
    recvs_done: dict = defaultdict(int)
    recv_waiting: dict = defaultdict(list)
    heappush, heappop = heapq.heappush, heapq.heappop

    # At equal times engines act in the order of their first instruction in the program (so a
    # load issued first also queues first for bandwidth), then in the order they became ready.
    # (Probes are left out of that order, so that adding one changes nothing.)
    heap = [(0.0, next((j for j in streams[e] if kind[j] != PROBE), streams[e][0]), e)
            for e in range(n_eng)]
    heapq.heapify(heap)
    seq = n
    def apply_signal(i: int, t: float, seq: int) -> int:
        """Add signal i's count at time t and wake the waiters it satisfies; returns seq."""
        s = a1[i]
        cnt = sem_count[s] + a2[i]
        sem_count[s] = cnt
        hist = sem_hist[s]
        hist[0].append(cnt)
        hist[1].append(t)
        hist[2].append(i)
        ws = waiters[s]
        while ws and ws[0][0] <= cnt:
            _, _, e2, reach, j = heappop(ws)
            wake = t + sem_lat
            if reach > wake:  # the waiter ran ahead of the clock and got here later
                wake = reach
            starts[j] = reach
            ends[j] = wake
            pred[j] = i
            gate[e2] = j
            head[e2] += 1
            heappush(heap, (wake, seq, e2))
            seq += 1
        return seq

    while heap:
        t, _, e = heappop(heap)
        if e >= n_eng:  # a DMA queue's pending signal lands
            seq = apply_signal(e - n_eng, t, seq)
            continue
        stream = streams[e]
        h = head[e]
        n_stream = len(stream)
        while h < n_stream:
            i = stream[h]
            k = kind[i]
            if k <= VEC:  # matrix or vector unit: busy for its duration
                end = t + dur[i]
                if k == MXU:
                    if t != last_mm[e]:
                        end += fill_s
                        fills.append(i)
                    last_mm[e] = end
                starts[i] = t
                ends[i] = end
                pred[i] = gate[e]
                gate[e] = i
                h += 1
                t = end
                continue
            if k == WAIT:
                s = a1[i]
                if sem_count[s] < a2[i]:  # blocked: the signal that satisfies it wakes us
                    heappush(waiters[s], (a2[i], seq, e, t, i))
                    seq += 1
                    break
                # Every signal at or before the global clock is processed, and this engine's
                # clock t is not behind it, so the history has the earliest time the count
                # reached the value.
                hist = sem_hist[s]
                j = bisect_left(hist[0], a2[i])
                ready = hist[1][j] + sem_lat
                starts[i] = t
                h += 1
                if ready > t:
                    ends[i] = ready
                    pred[i] = hist[2][j]
                    gate[e] = i
                    t = ready
                else:
                    ends[i] = t
                    pred[i] = gate[e]
                continue
            if k == PROBE:  # no time, and no later instruction waits for it (gate unchanged)
                starts[i] = ends[i] = t
                pred[i] = gate[e]
                h += 1
                continue
            if heap and heap[0][0] < t:  # a global action, and someone else acts first
                heappush(heap, (t, seq, e))
                seq += 1
                break
            if k <= COPY:
                out = outstanding[e]
                while out and out[0][0] <= t:
                    heappop(out)
                if len(out) >= max_out:  # queue full: retry when its oldest transfer lands
                    t2, gate[e] = out[0]
                    heappush(heap, (t2, seq, e))
                    seq += 1
                    break
                arrive = t + setup
                c = a1[i]
                end = core_free[c]
                end = (end if end > arrive else arrive) + dur[i]
                core_free[c] = end
                if k == HBM:
                    dt, touched, dt_min = chan[i]
                    # Every channel becomes free no earlier than `arrive`: harmless for channels
                    # this transfer does not touch, since later arrivals come no earlier. `floor`
                    # is a lower bound of every channel's free time, so when the channels are
                    # backlogged (streaming) this step is skipped.
                    if arrive > floor:
                        np_maximum(chan_free, arrive, out=chan_free)
                        floor = arrive
                    np_add(chan_free, dt, out=chan_free)
                    if touched is None:
                        floor += dt_min
                        hf = float(max_reduce(chan_free))
                    else:
                        hf = float(max_reduce(take(touched)))
                    end = (end if end > hf else hf) + hbm_lat + extra[i]
                heappush(out, (end, i))
                starts[i] = t
                ends[i] = end
                pred[i] = gate[e]
                h += 1
                if heap and heap[0][0] <= t:
                    # Other queues issue at this instant too: take turns, one descriptor each,
                    # so the pseudo-channels' FIFOs interleave the queues the way a memory
                    # controller interleaves requests, instead of serving one queue's whole
                    # burst before the next queue's first descriptor.
                    heappush(heap, (t, seq, e))
                    seq += 1
                    break
            elif k == SIGNAL:
                out = outstanding[e]
                starts[i] = t
                pred[i] = gate[e]
                h += 1
                if out:  # a DMA queue: the signal lands when every transfer in flight has
                    while out and out[0][0] <= t:
                        heappop(out)
                if out:
                    # ... but the queue does not stop: it goes on issuing while the signal is
                    # pending, and the count changes at the landing time, in global time order.
                    t2, pred[i] = max(out)
                    ends[i] = t2
                    heappush(heap, (t2, seq, n_eng + i))
                    seq += 1
                    continue
                ends[i] = t
                seq = apply_signal(i, t, seq)
            elif k == BARRIER:
                b = a1[i]
                if b in released:  # arrived after the release: pass at once
                    rel, j = released[b]
                    starts[i] = t
                    if rel > t:
                        pred[i], gate[e], t = j, i, rel
                    else:
                        pred[i] = gate[e]
                    ends[i] = t
                    h += 1
                    continue
                group = arrived[b]
                group.append((e, t, i))
                if len(group) < a2[i]:
                    break
                rel = t + bar_lat
                released[b] = (rel, i)
                head[e] = h  # the loop below advances every member, this engine included
                for e2, reach, j in group:
                    starts[j] = reach
                    ends[j] = rel
                    pred[j] = i if j != i else gate[e]  # the last arrival released everyone
                    gate[e2] = j
                    head[e2] += 1
                    heappush(heap, (rel, seq, e2))
                    seq += 1
                del arrived[b]
                h = -1  # head[e] already advanced
                break
            elif k == SEND:
                end = t + dur[i]
                key = a1[i]
                sends[key].append((end, i))
                starts[i] = t
                ends[i] = end
                pred[i] = gate[e]
                gate[e] = i
                h += 1
                waiting = recv_waiting.get(key)
                if waiting:
                    e2, reach, j = waiting.pop(0)
                    recvs_done[key] += 1
                    starts[j] = reach
                    ends[j] = end if end > reach else reach
                    pred[j] = i
                    gate[e2] = j
                    head[e2] += 1
                    heappush(heap, (ends[j], seq, e2))
                    seq += 1
                t = end
            else:  # RECV
                key = a1[i]
                done = recvs_done[key]
                sent = sends[key]
                if len(sent) <= done:
                    recv_waiting[key].append((e, t, i))
                    break
                recvs_done[key] = done + 1
                delivered, j = sent[done]
                starts[i] = t
                h += 1
                if delivered > t:
                    ends[i] = delivered
                    pred[i] = j
                    gate[e] = i
                    t = delivered
                else:
                    ends[i] = t
                    pred[i] = gate[e]
        if h >= 0:
            head[e] = h

    if any(head[e] < len(streams[e]) for e in range(n_eng)):
        heads = {engines[e]: head[e] for e in range(n_eng)}
        barrier_arrived = {int(st.barrier_ids[b]): {engines[e2] for e2, _, _ in group}
                           for b, group in arrived.items()}
        raise deadlock_error(program, dict(zip(engines, streams, strict=True)), heads,
                        defaultdict(int, zip(st.facts.semaphore_ids.tolist(), sem_count, strict=True)),
                        defaultdict(set, barrier_arrived))

    as_f64 = lambda xs: np.array(xs, dtype=np.float64)  # noqa: E731
    as_i64 = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
    return timeline_of(program, spec, st, as_f64(starts), as_f64(ends), as_i64(pred), as_i64(fills))
