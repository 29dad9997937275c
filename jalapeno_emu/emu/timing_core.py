"""The timing pass's event loop, compiled with numba: engines, DMA queues, semaphores, barriers, links.

Stage: emulator, the second half of the timing pass (``costs.py`` prices each instruction,
``timing.py`` documents the cost models and wraps this loop into a ``Timeline``). Everything here
is flat numpy arrays indexed by instruction, engine, semaphore, barrier or link key, so that the
loop compiles to machine code (``numba.njit``, no fastmath: every floating-point operation is the
one the cost model states, in the same order, so the results are exact and reproducible). The
compiled code is cached on disk: in ``NUMBA_CACHE_DIR`` when set, else next to this module, else
(a read-only install) in numba's user cache directory; compiling costs several seconds once,
loading it from the cache a fraction of a second per process. Where nothing is writable it is
compiled in every process that times something.

Data structures, all sized before the loop starts:

- the event heap: a binary heap of (time, seq, engine) with ``seq`` unique, so the order in
  which events pop is fully determined by (time, seq) (``engine >= n_eng`` is a DMA queue's
  pending signal, instruction ``engine - n_eng``, landing);
- per engine: its stream (CSR over instructions in issue order), its position, the instruction
  that last gated it (critical path), the end of its last matmul, and for a DMA queue the
  transfers in flight (at most ``max_outstanding``, kept as small unsorted arrays);
- per semaphore: its count, the history of (count, time, signal) it went through (CSR, one slot
  per signal instruction), and the engines blocked on it (a linked list with their wait values
  and the seq of their wait, woken in (value, seq) order);
- per barrier: the engines that arrived (a linked list over instructions) and the release;
- per link key: the sends so far (CSR, one slot per send) and the receives waiting (a FIFO).
- HBM pseudo-channels: a "free at" time each. ``np.maximum(chan_free, arrive)`` over every
  channel is applied lazily: ``lo`` is the largest ``arrive`` applied so far, and a channel's
  time is ``max(stored, lo)``, materialised when a transfer touches it; since ``lo`` only grows
  and service times are >= 0, this gives exactly the eager values.
"""

from __future__ import annotations

import numpy as np

from jalapeno_emu.compiled import njit_cached
from jalapeno_emu.emu.costs import BARRIER, COPY, HBM, MXU, PROBE, RECV, SEND, SIGNAL, VEC, WAIT

__all__ = ["event_loop"]


@njit_cached
def _push(ht, hs, he, size, t, s, e):
    """Push (t, s, e) onto the heap of ``size`` entries; returns the new size."""
    j = size
    while j > 0:
        parent = (j - 1) >> 1
        pt = ht[parent]
        if pt < t or (pt == t and hs[parent] < s):
            break
        ht[j] = pt
        hs[j] = hs[parent]
        he[j] = he[parent]
        j = parent
    ht[j] = t
    hs[j] = s
    he[j] = e
    return size + 1


@njit_cached
def _pop(ht, hs, he, size):
    """Remove the least (t, s) entry; returns (t, s, e, new size)."""
    t0, s0, e0 = ht[0], hs[0], he[0]
    size -= 1
    if size > 0:
        t, s, e = ht[size], hs[size], he[size]
        j = 0
        while True:
            c = 2 * j + 1
            if c >= size:
                break
            r = c + 1
            if r < size and (ht[r] < ht[c] or (ht[r] == ht[c] and hs[r] < hs[c])):
                c = r
            if t < ht[c] or (t == ht[c] and s < hs[c]):
                break
            ht[j] = ht[c]
            hs[j] = hs[c]
            he[j] = he[c]
            j = c
        ht[j] = t
        hs[j] = s
        he[j] = e
    return t0, s0, e0, size


@njit_cached
def _add_dense(chan_free, split_dt, sp, lo):
    """Every channel: free at max(its time, lo) plus split sp's service time; returns the latest.

    The maximum is exact and order-free, so it is taken over four interleaved accumulators
    (instruction-level parallelism, same result as one pass)."""
    n_pc = chan_free.shape[0]
    for ch in range(n_pc):
        x = chan_free[ch]
        if lo > x:
            x = lo
        chan_free[ch] = x + split_dt[sp, ch]
    h0 = h1 = h2 = h3 = -np.inf
    ch = 0
    while ch + 4 <= n_pc:
        a, b, c, d = chan_free[ch], chan_free[ch + 1], chan_free[ch + 2], chan_free[ch + 3]
        if a > h0:
            h0 = a
        if b > h1:
            h1 = b
        if c > h2:
            h2 = c
        if d > h3:
            h3 = d
        ch += 4
    while ch < n_pc:
        if chan_free[ch] > h0:
            h0 = chan_free[ch]
        ch += 1
    if h1 > h0:
        h0 = h1
    if h3 > h2:
        h2 = h3
    return h0 if h0 > h2 else h2


@njit_cached
def _apply_signal(i, t, seq, hsize, ht, hs, he, a1, a2, sem_count, hist_off, hist_n, hist_cnt, hist_t,
                  hist_i, w_head, w_min, w_next, w_val, w_seq, w_t, w_i, woken, starts, ends, pred, gate,
                  pos, sem_lat):
    """Add signal i's count at time t and wake the waiters it satisfies; returns (seq, heap size)."""
    s = a1[i]
    cnt = sem_count[s] + a2[i]
    sem_count[s] = cnt
    slot = hist_off[s] + hist_n[s]
    hist_cnt[slot] = cnt
    hist_t[slot] = t
    hist_i[slot] = i
    hist_n[s] += 1
    if w_head[s] < 0 or w_min[s] > cnt:
        return seq, hsize
    # Split the waiters into those this count satisfies and the rest (kept in list order).
    n_woken = 0
    new_min = np.iinfo(np.int64).max
    prev = -1
    e2 = w_head[s]
    while e2 >= 0:
        nxt = w_next[e2]
        if w_val[e2] <= cnt:
            woken[n_woken] = e2
            n_woken += 1
            if prev < 0:
                w_head[s] = nxt
            else:
                w_next[prev] = nxt
        else:
            if w_val[e2] < new_min:
                new_min = w_val[e2]
            prev = e2
        e2 = nxt
    w_min[s] = new_min
    # Wake them in (value, seq) order, the order a heap of waiters pops them in.
    for a in range(1, n_woken):
        x = woken[a]
        b = a - 1
        while b >= 0 and (w_val[woken[b]] > w_val[x] or
                          (w_val[woken[b]] == w_val[x] and w_seq[woken[b]] > w_seq[x])):
            woken[b + 1] = woken[b]
            b -= 1
        woken[b + 1] = x
    for a in range(n_woken):
        e2 = woken[a]
        j = w_i[e2]
        reach = w_t[e2]
        wake = t + sem_lat
        if reach > wake:  # the waiter ran ahead of the clock and got here later
            wake = reach
        starts[j] = reach
        ends[j] = wake
        pred[j] = i
        gate[e2] = j
        pos[e2] += 1
        hsize = _push(ht, hs, he, hsize, wake, seq, e2)
        seq += 1
    return seq, hsize


@njit_cached
def event_loop(kind, dur, extra, a1, a2, engine_index, n_eng, n_sem, n_bar, n_link,
               split_of, split_dt, split_dense, split_min, touched_off, touched,
               setup, hbm_lat, max_out, fill_s, sem_lat, bar_lat):
    """Run the event loop of the timing pass (see ``timing.py`` for the cost models).

    Args (arrays indexed by instruction unless said otherwise):
        kind: int8 ``MXU`` ... ``PROBE``; dur, extra: float64, s (``StaticCosts``).
        a1: int64 semaphore number, barrier number, link key number, or the DMA's core.
        a2: int64 signal count, wait value or barrier count.
        engine_index: int32 engine of each instruction (0..n_eng-1); streams are in program order.
        n_eng, n_sem, n_bar, n_link: numbers of engines, semaphores, barriers and link keys.
        split_of: int64 index of each HBM DMA's channel split (-1 for others).
        split_dt: float64[U, n_pc] service time per pseudo-channel of each split, s;
            split_dense: bool[U] every channel touched; split_min: float64[U] least service
            time when dense; touched_off (int64[U+1]) / touched: the channels each split touches.
        setup, hbm_lat, fill_s, sem_lat, bar_lat: s; max_out: DMA descriptors in flight per queue.

    Returns:
        (starts, ends, pred, filled, head, sem_count, arrived): float64[n] starts and ends,
        int64[n] critical-path predecessor, bool[n] matmuls that paid the pipeline fill,
        int64[n_eng] each engine's position in its stream (all at the end unless deadlocked),
        int64[n_sem] semaphore counts, bool[n] barrier arrivals still waiting for a release.
    """
    n = kind.shape[0]
    n_pc = split_dt.shape[1]

    # Streams: instructions of each engine in program order (CSR).
    stream_off = np.zeros(n_eng + 1, dtype=np.int64)
    for i in range(n):
        stream_off[engine_index[i] + 1] += 1
    for e in range(n_eng):
        stream_off[e + 1] += stream_off[e]
    stream_idx = np.empty(n, dtype=np.int64)
    fill = stream_off[:-1].copy()
    for i in range(n):
        e = engine_index[i]
        stream_idx[fill[e]] = i
        fill[e] += 1

    # Static sizes: signals per semaphore (history slots), sends per link key, cores.
    hist_off = np.zeros(n_sem + 1, dtype=np.int64)
    send_off = np.zeros(n_link + 1, dtype=np.int64)
    n_core = 1
    n_signals = 0
    for i in range(n):
        k = kind[i]
        if k == SIGNAL:
            hist_off[a1[i] + 1] += 1
            n_signals += 1
        elif k == SEND:
            send_off[a1[i] + 1] += 1
        elif HBM <= k <= COPY and a1[i] + 1 > n_core:  # a DMA: a1 is its core
            n_core = a1[i] + 1
    for s in range(n_sem):
        hist_off[s + 1] += hist_off[s]
    for s in range(n_link):
        send_off[s + 1] += send_off[s]

    starts = np.zeros(n, dtype=np.float64)
    ends = np.zeros(n, dtype=np.float64)
    pred = np.full(n, -1, dtype=np.int64)
    filled = np.zeros(n, dtype=np.bool_)
    pos = stream_off[:-1].copy()
    gate = np.full(n_eng, -1, dtype=np.int64)
    last_mm = np.full(n_eng, -1.0, dtype=np.float64)
    cap = max(max_out, 1)
    out_end = np.empty((n_eng, cap), dtype=np.float64)  # DMA transfers in flight, per queue
    out_idx = np.empty((n_eng, cap), dtype=np.int64)
    out_n = np.zeros(n_eng, dtype=np.int64)
    core_free = np.zeros(n_core, dtype=np.float64)
    chan_free = np.zeros(n_pc, dtype=np.float64)
    floor = 0.0  # no pseudo-channel is free before this time
    lo = 0.0  # the largest arrival applied to every channel so far (lazily: see the docstring)
    sem_count = np.zeros(n_sem, dtype=np.int64)
    hist_n = np.zeros(n_sem, dtype=np.int64)
    hist_cnt = np.empty(n_signals, dtype=np.int64)
    hist_t = np.empty(n_signals, dtype=np.float64)
    hist_i = np.empty(n_signals, dtype=np.int64)
    w_head = np.full(n_sem, -1, dtype=np.int64)  # engines blocked on each semaphore (linked list)
    w_min = np.zeros(n_sem, dtype=np.int64)
    w_next = np.full(n_eng, -1, dtype=np.int64)
    w_val = np.zeros(n_eng, dtype=np.int64)
    w_seq = np.zeros(n_eng, dtype=np.int64)
    w_t = np.zeros(n_eng, dtype=np.float64)
    w_i = np.zeros(n_eng, dtype=np.int64)
    woken = np.empty(n_eng, dtype=np.int64)
    g_head = np.full(n_bar, -1, dtype=np.int64)  # arrivals at each barrier (linked list)
    g_tail = np.full(n_bar, -1, dtype=np.int64)
    g_len = np.zeros(n_bar, dtype=np.int64)
    g_next = np.full(n, -1, dtype=np.int64)
    arr_t = np.zeros(n, dtype=np.float64)
    arrived = np.zeros(n, dtype=np.bool_)
    released = np.zeros(n_bar, dtype=np.bool_)
    rel_t = np.zeros(n_bar, dtype=np.float64)
    rel_i = np.zeros(n_bar, dtype=np.int64)
    send_n = np.zeros(n_link, dtype=np.int64)  # sends so far per link key
    send_end = np.empty(send_off[n_link], dtype=np.float64)
    send_i = np.empty(send_off[n_link], dtype=np.int64)
    recvs_done = np.zeros(n_link, dtype=np.int64)
    rw_head = np.full(n_link, -1, dtype=np.int64)  # receives waiting per link key (FIFO)
    rw_tail = np.full(n_link, -1, dtype=np.int64)
    rw_next = np.full(n, -1, dtype=np.int64)

    # The event heap. At equal times engines act in the order of their first instruction in the
    # program (probes left out), then in the order they became ready.
    hcap = n_eng + n_signals + 1
    ht = np.empty(hcap, dtype=np.float64)
    hs = np.empty(hcap, dtype=np.int64)
    he = np.empty(hcap, dtype=np.int64)
    hsize = np.int64(0)  # not a literal 0: one compiled _push/_pop, not two
    for e in range(n_eng):
        first = stream_idx[stream_off[e]]
        for p in range(stream_off[e], stream_off[e + 1]):
            if kind[stream_idx[p]] != PROBE:
                first = stream_idx[p]
                break
        hsize = _push(ht, hs, he, hsize, 0.0, first, e)
    seq = n

    while hsize > 0:
        t, _, e, hsize = _pop(ht, hs, he, hsize)
        if e >= n_eng:  # a DMA queue's pending signal lands
            seq, hsize = _apply_signal(e - n_eng, t, seq, hsize, ht, hs, he, a1, a2, sem_count, hist_off,
                                       hist_n, hist_cnt, hist_t, hist_i, w_head, w_min, w_next, w_val,
                                       w_seq, w_t, w_i, woken, starts, ends, pred, gate, pos, sem_lat)
            continue
        p = pos[e]
        p_end = stream_off[e + 1]
        keep = True  # False: a barrier release already advanced pos[e]
        while p < p_end:
            i = stream_idx[p]
            k = kind[i]
            if k <= VEC:  # matrix or vector unit: busy for its duration
                end = t + dur[i]
                if k == MXU:
                    if t != last_mm[e]:
                        end += fill_s
                        filled[i] = True
                    last_mm[e] = end
                starts[i] = t
                ends[i] = end
                pred[i] = gate[e]
                gate[e] = i
                p += 1
                t = end
                continue
            if k == WAIT:
                s = a1[i]
                if sem_count[s] < a2[i]:  # blocked: the signal that satisfies it wakes us
                    w_val[e] = a2[i]
                    w_seq[e] = seq
                    w_t[e] = t
                    w_i[e] = i
                    if w_head[s] < 0 or a2[i] < w_min[s]:
                        w_min[s] = a2[i]
                    w_next[e] = w_head[s]  # list order is irrelevant: woken in (value, seq) order
                    w_head[s] = e
                    seq += 1
                    break
                # Every signal at or before the global clock is processed, and this engine's
                # clock t is not behind it, so the history has the earliest time the count
                # reached the value (bisect_left over the counts).
                lo_j = hist_off[s]
                hi_j = lo_j + hist_n[s]
                v = a2[i]
                while lo_j < hi_j:
                    mid = (lo_j + hi_j) // 2
                    if hist_cnt[mid] < v:
                        lo_j = mid + 1
                    else:
                        hi_j = mid
                ready = hist_t[lo_j] + sem_lat
                starts[i] = t
                p += 1
                if ready > t:
                    ends[i] = ready
                    pred[i] = hist_i[lo_j]
                    gate[e] = i
                    t = ready
                else:
                    ends[i] = t
                    pred[i] = gate[e]
                continue
            if k == PROBE:  # no time, and no later instruction waits for it (gate unchanged)
                starts[i] = t
                ends[i] = t
                pred[i] = gate[e]
                p += 1
                continue
            if hsize > 0 and ht[0] < t:  # a global action, and someone else acts first
                hsize = _push(ht, hs, he, hsize, t, seq, e)
                seq += 1
                break
            if k <= COPY:  # a DMA (kinds up to WAIT, and probes, are handled above)
                m = out_n[e]  # drop the transfers that have landed
                kept = 0
                for a in range(m):
                    if out_end[e, a] > t:
                        out_end[e, kept] = out_end[e, a]
                        out_idx[e, kept] = out_idx[e, a]
                        kept += 1
                out_n[e] = kept
                if kept >= max_out:  # queue full: retry when its oldest transfer lands
                    b = 0
                    for a in range(1, kept):
                        if out_end[e, a] < out_end[e, b] or (out_end[e, a] == out_end[e, b] and
                                                             out_idx[e, a] < out_idx[e, b]):
                            b = a
                    gate[e] = out_idx[e, b]
                    hsize = _push(ht, hs, he, hsize, out_end[e, b], seq, e)
                    seq += 1
                    break
                arrive = t + setup
                c = a1[i]
                end = core_free[c]
                end = (end if end > arrive else arrive) + dur[i]
                core_free[c] = end
                if k == HBM:
                    sp = split_of[i]
                    # Every channel becomes free no earlier than `arrive` (applied lazily through
                    # `lo`); `floor` bounds every channel's free time from below, so when the
                    # channels are backlogged (streaming) this step is skipped.
                    if arrive > floor:
                        lo = arrive
                        floor = arrive
                    if split_dense[sp]:
                        hf = _add_dense(chan_free, split_dt, sp, lo)
                        floor += split_min[sp]
                    else:
                        hf = -np.inf
                        for a in range(touched_off[sp], touched_off[sp + 1]):
                            ch = touched[a]
                            x = chan_free[ch]
                            if lo > x:
                                x = lo
                            x += split_dt[sp, ch]
                            chan_free[ch] = x
                            if x > hf:
                                hf = x
                    end = (end if end > hf else hf) + hbm_lat + extra[i]
                out_end[e, kept] = end
                out_idx[e, kept] = i
                out_n[e] = kept + 1
                starts[i] = t
                ends[i] = end
                pred[i] = gate[e]
                p += 1
                if hsize > 0 and ht[0] <= t:
                    # Other queues issue at this instant too: take turns, one descriptor each.
                    hsize = _push(ht, hs, he, hsize, t, seq, e)
                    seq += 1
                    break
            elif k == SIGNAL:
                starts[i] = t
                pred[i] = gate[e]
                p += 1
                m = out_n[e]
                kept = 0
                for a in range(m):
                    if out_end[e, a] > t:
                        out_end[e, kept] = out_end[e, a]
                        out_idx[e, kept] = out_idx[e, a]
                        kept += 1
                out_n[e] = kept
                if kept > 0:
                    # A DMA queue: the signal lands when every transfer in flight has, but the
                    # queue goes on issuing; the count changes at the landing time.
                    b = 0
                    for a in range(1, kept):
                        if out_end[e, a] > out_end[e, b] or (out_end[e, a] == out_end[e, b] and
                                                             out_idx[e, a] > out_idx[e, b]):
                            b = a
                    t2 = out_end[e, b]
                    pred[i] = out_idx[e, b]
                    ends[i] = t2
                    hsize = _push(ht, hs, he, hsize, t2, seq, n_eng + i)
                    seq += 1
                    continue
                ends[i] = t
                seq, hsize = _apply_signal(i, t, seq, hsize, ht, hs, he, a1, a2, sem_count, hist_off,
                                           hist_n, hist_cnt, hist_t, hist_i, w_head, w_min, w_next, w_val,
                                           w_seq, w_t, w_i, woken, starts, ends, pred, gate, pos, sem_lat)
            elif k == BARRIER:
                b = a1[i]
                if released[b]:  # arrived after the release: pass at once
                    rel = rel_t[b]
                    starts[i] = t
                    if rel > t:
                        pred[i] = rel_i[b]
                        gate[e] = i
                        t = rel
                    else:
                        pred[i] = gate[e]
                    ends[i] = t
                    p += 1
                    continue
                arr_t[i] = t
                arrived[i] = True
                if g_head[b] < 0:
                    g_head[b] = i
                else:
                    g_next[g_tail[b]] = i
                g_tail[b] = i
                g_len[b] += 1
                if g_len[b] < a2[i]:
                    break
                rel = t + bar_lat
                released[b] = True
                rel_t[b] = rel
                rel_i[b] = i
                pos[e] = p  # the loop below advances every member, this engine included
                j = g_head[b]
                while j >= 0:
                    e2 = engine_index[j]
                    starts[j] = arr_t[j]
                    ends[j] = rel
                    pred[j] = i if j != i else gate[e]  # the last arrival released everyone
                    gate[e2] = j
                    pos[e2] += 1
                    hsize = _push(ht, hs, he, hsize, rel, seq, e2)
                    seq += 1
                    arrived[j] = False
                    j = g_next[j]
                keep = False
                break
            elif k == SEND:
                end = t + dur[i]
                key = a1[i]
                slot = send_off[key] + send_n[key]
                send_end[slot] = end
                send_i[slot] = i
                send_n[key] += 1
                starts[i] = t
                ends[i] = end
                pred[i] = gate[e]
                gate[e] = i
                p += 1
                j = rw_head[key]
                if j >= 0:  # the oldest receive waiting for this key gets it
                    rw_head[key] = rw_next[j]
                    if rw_head[key] < 0:
                        rw_tail[key] = -1
                    recvs_done[key] += 1
                    e2 = engine_index[j]
                    reach = arr_t[j]
                    starts[j] = reach
                    ends[j] = end if end > reach else reach
                    pred[j] = i
                    gate[e2] = j
                    pos[e2] += 1
                    hsize = _push(ht, hs, he, hsize, ends[j], seq, e2)
                    seq += 1
                t = end
            elif k == RECV:
                key = a1[i]
                done = recvs_done[key]
                if send_n[key] <= done:
                    arr_t[i] = t
                    rw_next[i] = -1
                    if rw_head[key] < 0:
                        rw_head[key] = i
                    else:
                        rw_next[rw_tail[key]] = i
                    rw_tail[key] = i
                    break
                recvs_done[key] = done + 1
                slot = send_off[key] + done
                delivered = send_end[slot]
                starts[i] = t
                p += 1
                if delivered > t:
                    ends[i] = delivered
                    pred[i] = send_i[slot]
                    gate[e] = i
                    t = delivered
                else:
                    ends[i] = t
                    pred[i] = gate[e]
        if keep:
            pos[e] = p

    head = pos - stream_off[:-1]
    return starts, ends, pred, filled, head, sem_count, arrived
