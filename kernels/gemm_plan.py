"""The ``gemm`` kernel's planner: how an output is cut into blocks, dealt to cores and streamed
in K chunks within a scratchpad and accumulator budget (``plan_gemm``), and the limits it plans
with. ``kernels/gemm.py`` has the design and the emitter that issues a plan."""

from __future__ import annotations

from dataclasses import dataclass

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.table import DTYPES

from .planning import Budget, DoesNotFit

__all__ = ["ACT_FMTS", "BROADCAST_MIN_BYTES", "WEIGHT_FMTS", "GemmPlan", "check_gemm_shape", "k_chunks",
           "operand_bytes", "plan_gemm"]

WEIGHT_FMTS = ("fp4", "fp8e4", "bf16")
ACT_FMTS = ("bf16", "fp8e4", "fp4")
COL_GRANULE = 64  # output columns per slice step: an fp4 row piece of 32 B is one HBM4 burst
MAX_ROWS = 512  # rows of an output block: 4 matrix-unit tiles
MAX_COLS = 2048  # columns of an output block (SRAM: W chunk rows x Nb)
MAX_CHUNK = 512  # K elements per streamed chunk: short start-up, few descriptors
EPILOGUE_BYTES = 256 * 1024  # FP32 scratch for the bias add, processed in row slabs
BROADCAST_MIN_BYTES = 256 * 1024  # x panels this big (or 1/16 of SRAM) are loaded once and relayed
DECODE_RELAY_GROUP = 16  # decode: cores that copy x from one core's SRAM instead of reading HBM
TAIL_SPLITS = 2  # the last block's last chunk is halved, then its second half again


@dataclass(frozen=True)
class GemmPlan:
    """How a gemm is cut: block sizes, items per core, K chunk, buffer counts.

    Attributes:
        mb, nb: output block rows and columns; kc: K elements per full chunk.
        items: per core, its (m0, rows, n0, cols) output blocks.
        slots: SRAM buffers for the streamed chunks; accs: accumulator buffers (1 or 2).
        slab: rows per epilogue step (bias add through FP32 scratch).
        x_resident: x's row block [mb, k] is loaded into SRAM whole (once per core when there is
            one row block, else whenever a core's row block changes) instead of streamed in K
            chunks beside W.
        load_queues: DMA queues streaming chunks (all of them when every core has one block,
            else all but the last, which stores).
        w_scales_resident: W's E8M0 scales for the core's whole K range come in once, first
            (one block per core): streamed with each chunk they queue behind other cores' codes
            on shared pseudo-channels and hold up every chunk's signal.
        x_relay: decode (one row block, a small x): 1 if every core reads x from HBM, else the
            size of the groups of cores in which one core reads it and the others copy it from
            its SRAM (only when each core streams W for long enough to hide the extra copy).
    """

    mb: int
    nb: int
    kc: int
    items: tuple[tuple[tuple[int, int, int, int], ...], ...]
    slots: int
    accs: int
    slab: int
    x_resident: bool
    load_queues: int
    w_scales_resident: bool
    x_relay: int = 1


def operand_bytes(fmt: str, rows: int, cols: int, blocked_axis: int) -> int:
    """SRAM/HBM bytes of an operand tile with its E8M0 scales (MX formats)."""
    codes = rows * DTYPES[fmt].row_bytes(cols)
    if fmt == "bf16":
        return codes
    return codes + (rows * cols // 32)


def check_gemm_shape(m: int, n: int, k: int, weight_fmt: str, act_fmt: str,
                     names: dict[str, str]) -> None:
    """Refuse a shape the kernel cannot take, naming the key as the caller spells it (``names``:
    gemm's m/n/k, or logits' tokens/vocab/hidden)."""
    for key, v in (("m", m), ("n", n), ("k", k)):
        if not isinstance(v, int) or v < 1:
            raise InvalidArgumentError(f"shape key {names[key]}={v!r} must be an int >= 1")
    if k % 32:
        raise InvalidArgumentError(f"shape key {names['k']}={k} must be a multiple of 32 "
                                   "(MX blocks and matrix-unit steps run along K in 32s)")
    if weight_fmt not in WEIGHT_FMTS:
        raise InvalidArgumentError(f"shape key weight_fmt={weight_fmt!r} is not one of {list(WEIGHT_FMTS)}")
    if act_fmt not in ACT_FMTS:
        raise InvalidArgumentError(f"shape key act_fmt={act_fmt!r} is not one of {list(ACT_FMTS)}")
    if weight_fmt == "fp4" and n % 2:
        raise InvalidArgumentError(f"shape key {names['n']}={n} must be even with fp4 weights "
                                   "(two codes per byte along a row)")


def k_chunks(k: int, kc: int, tail: bool) -> list[tuple[int, int]]:
    """(k0, width) chunks over [0, k); with ``tail`` the last chunk is halved ``TAIL_SPLITS`` times
    (each time its second half; never below 32): 512 -> 256, 128, 128."""
    widths = [kc] * (k // kc) + ([k % kc] if k % kc else [])
    if tail:
        for _ in range(TAIL_SPLITS):
            last = widths[-1]
            if last < 64:
                break
            half = (last // 64) * 32
            widths[-1:] = [last - half, half]
    out, k0 = [], 0
    for w in widths:
        out.append((k0, w))
        k0 += w
    return out


def _rotate(run: list[tuple[int, int, int, int]], mb: int) -> list[tuple[int, int, int, int]]:
    """``run`` rotated by its row block index mod its length (when all of it is in one row block)."""
    if not run or any(it[0] != run[0][0] for it in run):
        return run
    r = (run[0][0] // mb) % len(run)
    return run[r:] + run[:r]


def plan_gemm(m: int, n: int, k: int, weight_fmt: str, act_fmt: str, bias: bool,
              spec: ChipSpec, budget: Budget | None = None) -> GemmPlan:
    """Choose block sizes for ``spec`` within ``budget`` (default: the stand-alone one; see the
    module docstring); DoesNotFit if none fit."""
    budget = budget or Budget.of(spec)
    cores = budget.cores
    acc_cap, sram_cap = budget.acc_bytes, budget.sram_bytes
    g = COL_GRANULE
    mb = min(m, MAX_ROWS, acc_cap // (4 * g))
    if mb < 1:
        raise InvalidArgumentError(f"{spec.name}'s accumulator memory ({acc_cap} B) cannot hold one "
                                   f"{g}-column FP32 row")
    nb_max = min(MAX_COLS, acc_cap // (mb * 4) // g * g)
    m_blocks = -(-m // mb)
    n_slices = -(-n // g)
    while True:
        nb_count = -(-n // nb_max)
        total = m_blocks * nb_count
        want = max(cores, -(-total // cores) * cores)  # at least one block per core, balanced
        nb_count = min(n_slices, max(nb_count, -(-want // m_blocks)))
        nb = min(nb_max, -(-(-(-n // nb_count)) // g) * g)  # noqa: B002 (ceil of a ceil)
        nb_count = -(-n // nb)
        items_all = [(mi * mb, min(mb, m - mi * mb), nj * nb, min(nb, n - nj * nb))
                     for mi in range(m_blocks) for nj in range(nb_count)]
        # Contiguous runs of blocks per core: neighbours share their row block of x.
        # A run within one row block starts at block (row block index) mod (run length), so that
        # at any time the cores work on (load W for, store y of) different column blocks.
        runs = [items_all[c * len(items_all) // cores:(c + 1) * len(items_all) // cores]
                for c in range(cores)]
        per_core = tuple(tuple(_rotate(run, mb)) for run in runs)
        most = max(len(p) for p in per_core)
        queues = spec.dma.queues_per_core
        load_queues = queues if most == 1 or queues == 1 else queues - 1
        slab = max(1, min(mb, min(EPILOGUE_BYTES, sram_cap // 16) // (nb * 4))) if bias else 0
        fixed = mb * nb * 2 + (slab * nb * 4 + most * nb * 2 if bias else 0)
        # x's row block stays in SRAM for all of K. Streamed in K chunks, every core would read
        # the same narrow column range of x at the same time: [rows, kc] pieces at a row stride
        # of k/2 bytes sit on a few pseudo-channels, which then bound the whole GEMM. Loaded
        # whole (split over the load queues), the panel spreads over every channel.
        x_bytes = operand_bytes(act_fmt, mb, k, 1)
        x_resident = x_bytes <= sram_cap // 3
        if x_resident:
            fixed += x_bytes
        w_scales_resident = weight_fmt != "bf16" and most == 1 and (k // 32) * nb <= sram_cap // 8
        if w_scales_resident:
            fixed += (k // 32) * nb
        best = None  # (kc, slots): the longest chunk first, then the most slots
        for slots in (2 * load_queues, load_queues, 2):
            kc = min(MAX_CHUNK, k)
            while kc >= 32 and fixed + slots * ((0 if x_resident else operand_bytes(act_fmt, mb, kc, 1))
                                                + (kc * DTYPES[weight_fmt].row_bytes(nb)
                                                   if w_scales_resident
                                                   else operand_bytes(weight_fmt, kc, nb, 0))) > sram_cap:
                kc -= 32
            if kc >= 32 and (best is None or kc > best[0]):
                best = (kc, slots)
        if best is not None:
            kc, slots = best
            break
        if nb_max <= g:
            raise DoesNotFit(
                f"shape (m={m}, k={k}) does not fit: one {mb} x {g} output block with two 32-deep "
                f"chunks needs more than {spec.name}'s {spec.sram.scratchpad_bytes:,} B of scratchpad")
        nb_max = max(g, nb_max // 2 // g * g)
    accs = 2 if 2 * mb * nb * 4 <= acc_cap else 1
    return GemmPlan(mb, nb, kc, per_core, slots, accs, slab, x_resident, load_queues,
                    w_scales_resident, _x_relay(m_blocks, most, x_resident, mb, k, nb, act_fmt,
                                                weight_fmt, spec))


def _x_relay(m_blocks: int, most: int, x_resident: bool, mb: int, k: int, nb: int, act_fmt: str,
             weight_fmt: str, spec: ChipSpec) -> int:
    """Group size for relaying a decode x panel between cores (1: every core reads it from HBM).

    x is a few KB on a few pseudo-channels: 64 cores reading it put 64 x 256 B on each of them,
    which then serve their share of W 0.4 us after every other channel (jalapeno-v1). Read by one
    core per group and copied to the others, the channels stay balanced, but the copy costs the
    others one more DMA set-up before their first matmul: worth it when each core streams W for
    at least two set-ups (at its share of achievable HBM bandwidth).
    """
    small = operand_bytes(act_fmt, mb, k, 1) < min(BROADCAST_MIN_BYTES, spec.sram.scratchpad_bytes // 16)
    if m_blocks != 1 or most != 1 or not x_resident or not small:
        return 1
    w_bytes = operand_bytes(weight_fmt, k, nb, 0)
    share_s = w_bytes * spec.core.count / spec.derived()["hbm_achievable_bytes_per_s"]
    return min(DECODE_RELAY_GROUP, spec.core.count) if share_s >= 2 * spec.dma.setup_latency_s else 1
