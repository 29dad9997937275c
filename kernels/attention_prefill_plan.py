"""``attention-prefill``'s planner: which key tiles each query tile visits and their mask
patterns (``prefill_tiles``), and the largest query/key tiling, heads per unit and KV slots that
fit a budget (``plan_prefill``, whose small-scratchpad "lean" path slices a KV group's heads).
``kernels/attention.py`` has the design and the emitter that runs a plan."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError

from .attention_decode import check_common
from .attention_engine import _NBUF, _PREFILL_TILES, _fits, _Plan, _sram_left
from .attention_ref import MASK_VALUE
from .planning import Budget, DoesNotFit

__all__ = ["PREFILL_LEAN_SLOTS", "PrefillLayout", "PrefillTiles", "lean_candidates", "plan_prefill",
           "prefill_cap", "prefill_extra_bytes", "prefill_layout", "prefill_tiles", "prefill_valid"]


def prefill_cap(shape: dict[str, Any]) -> int:
    """Cache capacity in tokens: ``capacity``, or prior+seq rounded up to 32 (decode's ``cap``)."""
    seq, prior, capacity = shape["seq"], shape["prior"], shape["capacity"]
    if prior < 0:
        raise InvalidArgumentError(f"shape key prior={prior} must be >= 0 (tokens already in the cache)")
    if capacity == 0:
        return -(-(prior + seq) // 32) * 32
    if capacity % 32 or capacity < prior + seq:
        raise InvalidArgumentError(
            f"shape key capacity={capacity} must be a multiple of 32 and >= prior+seq={prior + seq} "
            "(0: prior+seq rounded up to 32)")
    return capacity


PREFILL_LEAN_SLOTS = (_NBUF, 4, 3, 2)  # KV slots of prefill's lean path, most first
PrefillTiles = dict[int, list[tuple[int, int, int | None]]]  # query tile -> [(k0, n, delta or None)]


def prefill_tiles(seq: int, prior: int, t: int, w: int) -> tuple[PrefillTiles, dict[int, np.ndarray]]:
    """The key tiles each query tile visits, and the mask patterns of the partly visible ones.

    Query tile ``qi`` holds the chunk's tokens qi*t.. (positions prior+qi*t..); key tiles are the
    t-token tiles of absolute positions kj*t.. up to prior+seq rounded up to 32 (keys past that
    are never visible). A key tile is visited when it meets [first visible key, last query] of
    the query tile (the union of its rows' windows, contiguous), so a window skips the prior
    context it does not reach. A partly visible tile adds the [t, t] mask pattern of
    ``delta = qi - kj``: query minus key position is prior + delta*t + row - col, nothing else.
    """
    end = -(-(prior + seq) // 32) * 32
    tiles: PrefillTiles = {}
    patterns: dict[int, np.ndarray] = {}
    for qi in range(-(-seq // t)):
        a, nq = prior + qi * t, min(t, seq - qi * t)  # first query position, query rows
        lo = max(0, a - w + 1) if w else 0
        lst = []
        for kj in range(lo // t, (a + nq - 1) // t + 1):
            k0, nk = kj * t, min(t, end - kj * t)
            delta = None
            if not (k0 + nk - 1 <= a and (not w or k0 >= a + nq - w)):  # not every key visible
                delta = qi - kj
                if delta not in patterns:
                    patterns[delta] = np.where(prefill_valid(prior + delta * t, 0, t, t, w), 0,
                                               MASK_VALUE).astype(np.float32)
            lst.append((k0, nk, delta))
        tiles[qi] = lst
    return tiles, patterns


@dataclass(frozen=True)
class PrefillLayout:
    """Static choices of one attention-prefill instance.

    plan: the engine's sizes (``plan.hpk``: query heads per unit, all of a KV group's or, on
    small scratchpads, a slice of them); cap: cache capacity (tokens); tiles: key tiles per query
    tile; patterns: mask pattern per delta; v_slots: phase-1 V staging buffers per core;
    p1_tokens: tokens per phase-1 chunk.
    """

    plan: _Plan
    cap: int
    tiles: PrefillTiles
    patterns: dict[int, np.ndarray]
    v_slots: int
    p1_tokens: int


def prefill_extra_bytes(hq: int, d: int, t: int, p1_tokens: int, n_patterns: int) -> int:
    """Scratchpad bytes per core besides the engine's buffers: sinks, [t, t] FP32 mask patterns,
    phase-1 buffers (two slots of K^T in/out and V in BF16 and of cos and sin in FP32, two FP32
    temporaries, ``p1_tokens`` wide)."""
    w1 = p1_tokens
    return (4 * hq + n_patterns * 4 * t * t + 2 * (3 * 2 * d * w1 + 2 * 4 * (d // 2) * w1)
            + 2 * 4 * (d // 2) * w1 + 1024)


def lean_candidates(hpk: int, seq: int) -> list[tuple[int, int]]:
    """(query heads per unit, tile tokens) of the small-scratchpad path, best first: a unit's
    heads divide the KV group's ``hpk``; the (unit, KV tile) pairs, each a fixed cost of
    instructions and a KV tile load, scale as 1/(heads * t^2), so the fewest come first."""
    heads = [h for h in range(hpk, 0, -1) if hpk % h == 0]
    ts = [t for t in _PREFILL_TILES if t <= max(32, seq)]
    return sorted(((h, t) for h in heads for t in ts), key=lambda ht: (-ht[0] * ht[1] ** 2, -ht[0]))


def prefill_layout(shape: dict[str, Any], budget: Budget, cap: int, hs: int, t: int, nbuf: int,
                    lean: bool) -> PrefillLayout | None:
    """The layout with ``hs`` query heads and ``t`` tokens per unit, ``nbuf`` KV slots; None
    when it does not fit the scratchpad or the accumulators."""
    bsz, seq, hq, hkv, d = (shape[k] for k in ("batch", "seq", "q_heads", "kv_heads", "head_dim"))
    tiles, patterns = prefill_tiles(seq, shape["prior"], t, shape["window"])
    # The lean path writes the cache in 32-token chunks: its buffers do not grow with t.
    p1 = 32 if lean else t
    chunks = bsz * hkv * -(-seq // p1)
    chunks_per_core = -(-chunks // min(budget.cores, chunks))
    plan = _Plan(hpk=hs, d=d, tk=t, nq_max=t, nbuf=nbuf, kv_dtype="bf16", sinks=shape["sinks"],
                 scale=1 / math.sqrt(d), page_size=0, ring=1 if lean else 2, lean=lean)
    extra = prefill_extra_bytes(hq, d, t, p1, len(patterns))
    if not _fits(plan, budget, extra):
        return None
    # Spare scratchpad stages more of a core's V chunks at once: a slot is free again only when
    # its store has landed, a load-store round trip per reuse.
    spare = _sram_left(plan, budget, extra) // (2 * d * p1)
    return PrefillLayout(plan, cap, tiles, patterns, max(1, min(chunks_per_core, 2 + spare)), p1)


def plan_prefill(shape: dict[str, Any], spec: ChipSpec, budget: Budget | None = None) -> PrefillLayout:
    """The largest query/key tile that fits ``budget`` (default: the stand-alone one), and what
    goes with it; refuses impossible shapes.

    First every head of a KV group per unit (one KV tile load serves them all), the largest
    tile first; when not even 32 tokens of them fit (GPU shared memory), the lean path: fewer
    heads per unit (the group's KV tiles are read once per slice of heads) and leaner buffers.
    """
    check_common(shape)
    seq, hq, hkv, d = (shape[k] for k in ("seq", "q_heads", "kv_heads", "head_dim"))
    if shape["kv_dtype"] != "bf16":
        raise InvalidArgumentError(
            f"shape key kv_dtype={shape['kv_dtype']!r}: prefill reads and writes a BF16 KV cache "
            "(an MXFP8 cache is implemented for decode only)")
    if seq % 32:
        raise InvalidArgumentError(f"shape key seq={seq} must be a multiple of 32: P.V contracts "
                                   "over keys in 32-token matrix-unit blocks (pad the prompt)")
    budget = budget or Budget.of(spec)
    cap, hpk = prefill_cap(shape), hq // hkv
    for t in _PREFILL_TILES:
        if t > max(32, seq):
            continue
        for nbuf in (_NBUF, 2):  # prefill is vector-bound: two KV slots in flight are enough
            lay = prefill_layout(shape, budget, cap, hpk, t, nbuf, lean=False)
            if lay is not None:
                return lay
    for hs, t in lean_candidates(hpk, seq):
        for nbuf in PREFILL_LEAN_SLOTS:
            lay = prefill_layout(shape, budget, cap, hs, t, nbuf, lean=True)
            if lay is not None:
                return lay
    smallest = _Plan(hpk=1, d=d, tk=32, nq_max=32, nbuf=2, kv_dtype="bf16", sinks=shape["sinks"],
                     scale=1.0, page_size=0, ring=1, lean=True)
    n_patterns = len(prefill_tiles(seq, shape["prior"], 32, shape["window"])[1])
    need = budget.sram_bytes - _sram_left(smallest, budget, prefill_extra_bytes(hq, d, 32, 32, n_patterns))
    raise DoesNotFit(
        f"shape key head_dim={d} (q_heads/kv_heads={hpk}, window={shape['window']}): one 32-token "
        f"query tile of a single head needs {need:,} B of scratchpad per core and "
        f"{smallest.acc_bytes():,} B of accumulators; {spec.name} has {spec.sram.scratchpad_bytes:,} B "
        f"({budget.sram_bytes:,} B usable) and {budget.acc_bytes:,} B")


def prefill_valid(q0: int, k0: int, nq: int, nk: int, w: int) -> np.ndarray:
    """bool[nq, nk]: query position q0+i sees key k0+c (causal, within the window)."""
    qp = np.arange(q0, q0 + nq)[:, None]
    kp = np.arange(k0, k0 + nk)[None, :]
    ok = kp <= qp
    if w:
        ok &= kp > qp - w
    return ok
