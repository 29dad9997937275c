"""mla-decode's plan: the checked shape, the split-KV choice, the on-core plan and the
small-scratchpad tiling (``mla_decode`` emits them; ``mla_decode_small`` emits the latter).

Stage: kernels (the MLA family), under ``mla_decode``. Pure functions of the shape, the chip spec
and the budget: nothing here issues instructions. See ``mla_decode``'s docstring for the program
each plan describes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError

from .mla import (
    BLOCK_TOKENS,
    SLACK_BYTES,
    Flash,
    LatentDims,
    aligned,
    check_dims,
    latent_cache_capacity,
    pick_tile,
    softmax_scale_of,
    split_ranges,
)
from .planning import Budget, DoesNotFit, mxu_macs_per_cycle

__all__ = ["MAX_DECODE_BUFFERS", "MAX_DECODE_TILE", "SMALL_HEAD_GROUPS", "SMALL_PV_COLS", "DecodeDims",
           "DecodePlan", "DecodeTiling", "decode_shape", "decode_small_tiling", "decode_splits",
           "decode_v1_plan", "merge_bytes", "plan_mla_decode"]

MAX_DECODE_TILE = 512  # context tokens per tile: big enough to amortise DMA set-up and issue
MAX_DECODE_BUFFERS = 4  # latent cache tiles in flight per core
SMALL_HEAD_GROUPS = (128, 64, 32, 16, 8, 4, 2, 1)  # heads per attention item, largest first
SMALL_PV_COLS = 128  # FP32 columns of PV read back at a time on the small-scratchpad path


# --- shape, splits, plan ----------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeDims(LatentDims):
    """A checked mla-decode shape: ``b`` sequences of ``c`` cached tokens in ``cap`` rows each
    (``span``: c rounded up to 32, the tokens read), ``h`` heads, latent width ``r``, rope ``p``,
    nope ``n``, value head ``v``, softmax ``scale``."""

    b: int
    c: int
    cap: int
    span: int
    h: int
    r: int
    p: int
    n: int
    v: int
    scale: float


def decode_shape(shape: dict[str, Any]) -> DecodeDims:
    """The checked shape; InvalidArgumentError naming the key otherwise."""
    check_dims(shape, None)
    c = shape["context"]
    cap = latent_cache_capacity(c, shape["capacity"])
    span = -(-c // BLOCK_TOKENS) * BLOCK_TOKENS
    return DecodeDims(shape["batch"], c, cap, span, shape["q_heads"], shape["kv_lora_rank"],
                shape["rope_dim"], shape["nope_dim"], shape["v_head_dim"], softmax_scale_of(shape))


def decode_splits(d: DecodeDims, spec: ChipSpec, budget: Budget, requested: int) -> int:
    """Context splits per sequence: shape key ``kv_splits`` when > 0; automatically, when batch
    leaves at least two cores per sequence and one sequence's attention on one core (its
    matrix-unit time at the BF16 rate) outlasts two DMA set-ups (what the exchange of partial
    states adds), as many splits as the cores per sequence allow (at least one 32-token block
    each), else 1.

    (Measured on jalapeno-v1, DeepSeek-R1 dims: more splits cost at most 1 % against the best
    count, and a split program is 2-3 us faster even below the threshold, down to 64 tokens; the
    threshold keeps short contexts, the tiny models' included, on the one-core program, whose
    single softmax the model reference follows bit for bit: see ``mla_decode_reference``.)"""
    blocks = d.span // BLOCK_TOKENS
    if requested:
        if requested > 1 and (requested > blocks or d.b * requested > budget.cores):
            raise InvalidArgumentError(
                f"shape key kv_splits={requested}: each of batch={d.b} sequences split {requested} ways "
                f"needs {d.b * requested} cores (of {budget.cores}) and at least {requested} 32-token "
                f"blocks of context (context={d.c} has {blocks})")
        return requested
    per_seq = budget.cores // d.b
    if per_seq < 2:
        return 1
    seq_s = d.span * d.h * (d.w + d.r) / mxu_macs_per_cycle(spec, "bf16", "bf16") / spec.core.clock_hz
    if seq_s < 2 * spec.dma.setup_latency_s:
        return 1
    return min(per_seq, blocks)


@dataclass(frozen=True)
class DecodePlan:
    """How the on-core mla-decode is cut (see the module docstring).

    Attributes:
        t: context tokens per tile; nbuf: latent cache tiles in flight per attention core.
        splits: context splits per sequence (1: every sequence on one core).
        heads_of: per head core, its heads (absorption and up-projection).
        units: per attention core, its (sequence, first token, end token) attention units.
        qpe_heads: q_pe travels with q_lat from the head cores (split-KV, or q on chip); else
            each attention core loads its sequences' q_pe from HBM.
    """

    t: int
    nbuf: int
    splits: int
    heads_of: tuple[tuple[int, ...], ...]
    units: tuple[tuple[tuple[int, int, int], ...], ...]
    qpe_heads: bool


def merge_bytes(rows: int, splits: int, r: int) -> int:
    """Scratchpad of a head core's split-KV merge: the partial states [splits*rows, R+2] FP32
    and its [splits*rows, 1] and [rows, 1] FP32 columns."""
    return aligned(splits * rows * (r + 2) * 4) + 2 * aligned(splits * rows * 4) + aligned(rows * 4)


def decode_v1_plan(d: DecodeDims, spec: ChipSpec, budget: Budget, splits: int, qpe_heads: bool,
                    kv_tile: int) -> DecodePlan:
    """The on-core plan for ``splits`` splits per sequence; DoesNotFit when not even a 32-token
    tile fits beside the weights and the query/output state."""
    B, H, (R, _, N, V), W, D = d.b, d.h, d.dims[1:], d.w, d.d
    cores = budget.cores
    split = splits > 1
    qpe_heads = qpe_heads or split
    n_head = min(cores, H)
    hpc = -(-H // n_head)  # heads per head core
    heads_of = tuple(tuple(range(c * hpc, min(H, (c + 1) * hpc))) for c in range(-(-H // hpc)))
    if split:
        ranges = split_ranges(d.span, splits)
        units = tuple(((b, lo, hi),) for b in range(B) for lo, hi in ranges)
        bpc, longest, states = 1, max(hi - lo for lo, hi in ranges), 1
    else:
        n_att = min(cores, B)
        units = tuple(tuple((b, 0, d.span) for b in range(B) if b % n_att == a) for a in range(n_att))
        bpc, longest, states = -(-B // n_att), d.span, 2
    qw, lw = (D, W) if qpe_heads else (N, R)  # q rows a head core holds, and its q_lat rows
    sram_fixed = hpc * (N * R + V * R + B * qw + B * lw + B * R + B * V) * 2 \
        + Flash.sram_bytes(H, 0, R, states) + SLACK_BYTES
    if split:  # the merge on the head cores; the query and the partial state on the split cores
        sram_fixed += merge_bytes(hpc * B, splits, R) + H * W * 2 + H * (R + 2) * 4
    else:
        sram_fixed += bpc * H * (W + R) * 2
    acc_fixed = hpc * B * (R + V) * 4 + Flash.acc_bytes(H, 0, R) + SLACK_BYTES
    per_sram = 2 * W * 2 + Flash.sram_bytes(H, 1, R, states) - Flash.sram_bytes(H, 0, R, states)
    cap_s, cap_a = budget.sram_bytes, budget.acc_bytes
    what = (f"q_heads={H}, kv_lora_rank={R}, batch={B} need {sram_fixed:,} B of scratchpad and "
            f"{acc_fixed:,} B of accumulators before any context tile; {spec.name} plans with "
            f"{cap_s:,} B and {cap_a:,} B per core")
    acc_fit = (cap_a - acc_fixed) // (2 * H * 4) // 32 * 32  # scores accumulators, double-buffered
    if acc_fit < 32 or (cap_s - sram_fixed) // per_sram < 32:
        raise DoesNotFit(what)
    T = pick_tile(min(MAX_DECODE_TILE, acc_fit), longest, sram_fixed, per_sram, cap_s, what, kv_tile)
    # Spare scratchpad buys deeper prefetch: a tile's load (set-up + latency + bytes) takes longer
    # than one tile of matrix work, so two buffers would leave the matrix unit waiting.
    nbuf = min(MAX_DECODE_BUFFERS, 2 + (cap_s - sram_fixed - T * per_sram) // (T * W * 2))
    most = max(sum(-(-(hi - lo) // T) for _, lo, hi in us) for us in units)
    return DecodePlan(T, min(nbuf, most), splits, heads_of, units, qpe_heads)


def plan_mla_decode(shape: dict[str, Any], spec: ChipSpec, budget: Budget, *,
                     qpe_heads: bool = False, keep_out: bool = False) -> tuple[DecodeDims, Any]:
    """(shape, plan): split-KV when it pays (``decode_splits``), else a core per sequence,
    else, on scratchpads too small for either, the small-scratchpad tiling (``DecodeTiling``).
    ``qpe_heads``: q is on chip (q_pe then comes with q_lat); ``keep_out``: the output stays on
    chip (the small tiling keeps every output block)."""
    d = decode_shape(shape)
    requested = shape.get("kv_splits", 0)
    splits = decode_splits(d, spec, budget, requested)
    if splits > 1:
        try:
            return d, decode_v1_plan(d, spec, budget, splits, qpe_heads, shape["kv_tile"])
        except DoesNotFit as exc:
            if requested:
                raise DoesNotFit(f"shape key kv_splits={requested}: split-KV needs the on-core tiling, which "
                                 f"does not fit: {exc.message}") from None
    try:
        return d, decode_v1_plan(d, spec, budget, 1, qpe_heads, shape["kv_tile"])
    except DoesNotFit:
        pass
    # Small scratchpads (GPU presets): weights and all heads' output state cannot stay on the
    # core; the phases go through HBM instead.
    if requested > 1:
        raise InvalidArgumentError(f"shape key kv_splits={requested}: split-KV needs the on-core tiling, "
                                   f"which does not fit {spec.name}'s scratchpad (use kv_splits=0 or 1)")
    til = decode_small_tiling(d, spec, budget, shape["kv_tile"], keep_out)
    if til is None:
        what = "shape key kv_tile=" + str(shape["kv_tile"]) if shape["kv_tile"] else "the tiling"
        raise DoesNotFit(
            f"{what} cannot hold this shape: q_heads={d.h}, kv_lora_rank={d.r}, rope_dim={d.p}: one head's "
            f"query [1, {d.w}] and FP32 output state [1, {d.r}] plus two 32-token cache tiles of "
            f"{32 * d.w * 2:,} B need more than the {budget.sram_bytes:,} B of scratchpad / "
            f"{budget.acc_bytes:,} B of accumulators per core {spec.name} plans with")
    return d, til

# --- small scratchpads (GPU presets): phases through HBM ---------------------------------------
@dataclass(frozen=True)
class DecodeTiling:
    """Small-scratchpad mla-decode tiling: ``hg`` heads per attention item, ``t`` context tokens
    per tile on ``nbuf`` buffers; GEMM jobs of ``bm`` sequences, ``rc`` absorbed columns (phase
    1) and ``kp``-wide K panels (phase 3); byte sizes of the per-core regions."""

    hg: int
    t: int
    nbuf: int
    bm: int
    rc: int
    kp: int
    flash_sram: int
    arena_sram: int
    gemm_acc: int


def decode_small_tiling(d: DecodeDims, spec: ChipSpec, budget: Budget, override: int,
                         keep_out: bool = False) -> DecodeTiling | None:
    """The largest head group, then the largest context tile, that fit (None: nothing fits).
    ``keep_out``: every phase-3 output block stays on its core beside the tiling."""
    B, H, span = d.b, d.h, d.span
    R, P, N, V = d.r, d.p, d.n, d.v
    W = R + P
    cap_s, cap_a = budget.sram_bytes, budget.acc_bytes - SLACK_BYTES
    pvc = min(R, SMALL_PV_COLS)

    def gemm(bm: int, rc: int, kp: int) -> tuple[int, int]:
        a = max(bm * N, bm * kp) * 2
        b = max(N * rc, V * kp) * 2
        o = max(bm * rc, bm * V) * 2
        return 2 * (aligned(a) + aligned(b) + aligned(o)), 2 * aligned(max(bm * rc, bm * V) * 4)

    def kept(bm: int) -> int:  # the output blocks one core keeps (phase-3 jobs dealt round robin)
        jobs = H * -(-B // bm)
        return -(-jobs // budget.cores) * aligned(min(bm, B) * V * 2) if keep_out else 0

    gemm_opts = [(bm, rc, kp) for bm in (128, 64, 32, 16, 8) if bm <= max(B, 8)
                 for rc, kp in ((R, R), (R // 2, R // 2), (R // 4, R // 4), (R // 8, R // 8))
                 if rc >= 32 and rc % 32 == 0]
    tiles = [override] if override else list(range(min(MAX_DECODE_TILE, span) // 32 * 32, 0, -32))
    for hg in (g for g in SMALL_HEAD_GROUPS if g <= H):
        for t in tiles:
            fl_s = Flash.sram_bytes(hg, t, R, 1, pvc) + 16 * 64
            fl_a = Flash.acc_bytes(hg, t, R) + 4 * 64
            for nbuf in (4, 3, 2):
                att = 2 * aligned(hg * W * 2) + 2 * aligned(hg * R * 2) + nbuf * aligned(t * W * 2)
                for bm, rc, kp in gemm_opts:
                    g_s, g_a = gemm(bm, rc, kp)
                    if fl_s + max(att, g_s) + kept(bm) <= cap_s and fl_a + g_a <= cap_a:
                        return DecodeTiling(hg, t, nbuf, bm, rc, kp, fl_s, max(att, g_s), g_a)
    return None
