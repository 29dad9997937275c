"""Microbenchmark programs: streams, strided reads, GEMMs and streamed GEMVs, built with the builder.

Stage: kernels for the timing pass. ``jalapeno-emu bench`` and the timing tests time these
programs to check that the cost models deliver the chip's headline figures (HBM bandwidth, MXFP4
FLOP/s) and that overlap, strides and latency show up where they should. They are timing-only
programs: where a benchmark discards its data (the HBM stream), destination buffers are reused
without waiting, which a race checker would rightly flag.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.loops import issue_in_rounds
from jalapeno_emu.isa.program import Program

__all__ = [
    "default_stream_bytes",
    "hbm_stream_program",
    "mxu_program",
    "pipeline_program",
    "single_core_stream_program",
    "streamed_matmul_program",
    "strided_single_channel_program",
]

_GIB = 1 << 30


def default_stream_bytes(spec: ChipSpec) -> int:
    """Bytes ``bench hbm`` streams: 4 GiB (so launch and first-transfer latency are ~1 % of the
    time), at most half of the chip's HBM (``tiny``: 32 MiB)."""
    return min(4 * _GIB, spec.hbm.capacity_bytes // 2)


def _cores(spec: ChipSpec, cores: Sequence[int] | None) -> list[int]:
    out = list(range(spec.core.count)) if cores is None else list(cores)
    if not out:
        raise InvalidArgumentError("cores must name at least one core")
    return out


def hbm_stream_program(spec: ChipSpec, total_bytes: int, *, chunk_bytes: int | None = None,
                       cores: Sequence[int] | None = None, name: str = "hbm_stream") -> Program:
    """Read ``total_bytes`` of HBM into SRAM, one contiguous chunk per ``dma.load``, spread round
    robin over ``cores`` (default: all) and every DMA queue of each.

    Args:
        spec: the chip.
        total_bytes: bytes to read; a multiple of ``chunk_bytes``.
        chunk_bytes: bytes per descriptor (default: 256 KiB, or less so that every queue has a
            buffer in its core's scratchpad).
        cores: the cores that stream.
        name: the program's name.

    Returns:
        A Program of ``total_bytes / chunk_bytes`` loads (each queue reuses one SRAM buffer).
    """
    cores = _cores(spec, cores)
    queues = spec.dma.queues_per_core
    if chunk_bytes is None:
        chunk_bytes = min(256 * 1024, spec.sram.scratchpad_bytes // queues)
    if total_bytes <= 0 or total_bytes % chunk_bytes:
        raise InvalidArgumentError(f"total_bytes={total_bytes} must be a positive multiple of "
                                   f"chunk_bytes={chunk_bytes}")
    kb = KernelBuilder(name, spec)
    n_chunks = total_bytes // chunk_bytes
    src = kb.hbm("src", (n_chunks, chunk_bytes), "u8")
    bufs = {(c, q): kb.sram(c, f"buf{q}", (1, chunk_bytes), "u8") for c in cores for q in range(queues)}
    handles = {c: kb.core(c) for c in cores}
    lanes = [(c, q) for q in range(queues) for c in cores]  # consecutive chunks on different cores

    def load(j: int) -> None:
        c, q = lanes[j % len(lanes)]
        handles[c].dma[q].load(bufs[c, q], src.sub(j, 0, 1, chunk_bytes))

    rounds = n_chunks // len(lanes)  # one hardware loop per queue over the whole rounds
    kb.repeat(rounds, lambda r: [load(r * len(lanes) + k) for k in range(len(lanes))])
    for j in range(rounds * len(lanes), n_chunks):
        load(j)
    return kb.build()


def single_core_stream_program(spec: ChipSpec, total_bytes: int, *, core: int = 0,
                               chunk_bytes: int | None = None) -> Program:
    """``hbm_stream_program`` on one core only (it is capped by ``dma.bytes_per_s_per_core``)."""
    return hbm_stream_program(spec, total_bytes, chunk_bytes=chunk_bytes, cores=[core],
                              name="single_core_stream")


def strided_single_channel_program(spec: ChipSpec, total_bytes: int, *, rows_per_load: int = 256,
                                   cores: Sequence[int] | None = None) -> Program:
    """Read ``total_bytes`` as rows of one interleave granule, ``n_pc`` granules apart, so every
    access lands on pseudo-channel 0: the whole chip gets one pseudo-channel's bandwidth.

    Args:
        spec: the chip.
        total_bytes: bytes to read; a multiple of ``rows_per_load * hbm.interleave_bytes``.
        rows_per_load: rows (granules) per ``dma.load``.
        cores: the cores that read (default: all).
    """
    cores = _cores(spec, cores)
    g = spec.hbm.interleave_bytes
    stride = g * spec.hbm.pseudo_channels
    per_load = rows_per_load * g
    if total_bytes <= 0 or total_bytes % per_load:
        raise InvalidArgumentError(f"total_bytes={total_bytes} must be a positive multiple of "
                                   f"{per_load} (rows_per_load x interleave granule)")
    queues = spec.dma.queues_per_core
    kb = KernelBuilder("strided_single_channel", spec)
    rows = total_bytes // g
    src = kb.hbm("src", (rows, stride), "u8")
    bufs = {(c, q): kb.sram(c, f"buf{q}", (rows_per_load, g), "u8") for c in cores for q in range(queues)}
    handles = {c: kb.core(c) for c in cores}
    lanes = [(c, q) for q in range(queues) for c in cores]
    for j in range(rows // rows_per_load):
        c, q = lanes[j % len(lanes)]
        handles[c].dma[q].load(bufs[c, q], src.sub(j * rows_per_load, 0, rows_per_load, g))
    return kb.build()


_BLOCKS = ((512, 512, 2048), (256, 256, 1024), (128, 256, 512), (128, 128, 256), (128, 128, 128))


def _fit_block(spec: ChipSpec, fmt: str) -> tuple[int, int, int]:
    """The largest (bm, bn, bk) output/contraction block whose operands fit a core's memories."""
    bits = {"fp4": 4, "fp8e4": 8, "fp8e5": 8, "bf16": 16}[fmt]
    scale = 0 if fmt == "bf16" else 1
    for bm, bn, bk in _BLOCKS:
        sram = (bm * bk + bk * bn) * bits // 8 + scale * (bm + bn) * bk // 32
        if bm * bn * 4 <= spec.sram.accumulator_bytes and sram <= spec.sram.scratchpad_bytes:
            return bm, bn, bk
    raise InvalidArgumentError(f"no matmul block fits {spec.name}'s SRAM")


def mxu_program(spec: ChipSpec, m: int = 8192, n: int = 8192, k: int = 8192, *, fmt: str = "fp4",
                block: tuple[int, int, int] | None = None, cores: Sequence[int] | None = None) -> Program:
    """The matmul instructions of an [m, k] x [k, n] GEMM with operands resident in SRAM.

    The output is cut into [bm, bn] blocks dealt round robin to ``cores`` (default: all); each
    block runs ``k / bk`` back-to-back matmuls accumulating into one FP32 block. Every matmul reads
    the same SRAM operand buffers (the data is not the point: this measures the matrix unit).

    Args:
        spec: the chip.
        m, n, k: GEMM shape; multiples of the block.
        fmt: operand dtype ("fp4" = MXFP4, "fp8e4", "fp8e5", "bf16").
        block: (bm, bn, bk); default the largest that fits the core's SRAM and accumulators.
        cores: the cores used.
    """
    cores = _cores(spec, cores)
    bm, bn, bk = block or _fit_block(spec, fmt)
    if m % bm or n % bn or k % bk:
        raise InvalidArgumentError(f"GEMM {m}x{n}x{k} must be a multiple of the block {bm}x{bn}x{bk}")
    kb = KernelBuilder(f"gemm_{fmt}_{m}x{n}x{k}", spec)
    ops = {}
    for c in cores:
        if fmt == "bf16":
            a, b = kb.sram(c, "a", (bm, bk), "bf16"), kb.sram(c, "b", (bk, bn), "bf16")
        else:
            a, b = kb.sram_mx(c, "a", (bm, bk), fmt, axis=1), kb.sram_mx(c, "b", (bk, bn), fmt, axis=0)
        ops[c] = (kb.acc(c, "acc", (bm, bn)), a, b, kb.core(c).mxu)
    for block in range((m // bm) * (n // bn)):
        acc, a, b, mxu = ops[cores[block % len(cores)]]
        for kk in range(k // bk):
            mxu.matmul_mx(acc, a, b, mode="overwrite" if kk == 0 else "accumulate")
    return kb.build()


def streamed_matmul_program(spec: ChipSpec, m: int, k: int, n: int, *, chunk_k: int, nbuf: int = 2,
                            cores: Sequence[int] | None = None, name: str | None = None) -> Program:
    """y[m, n] = x[m, k] @ W[k, n] with MXFP4 weights streamed from HBM through ``nbuf`` SRAM buffers.

    Each core owns ``n / len(cores)`` columns of W. It loads x once (on its last DMA queue, which
    also stores y, so the weight queues start at once), then for every
    ``chunk_k`` rows of W: a DMA queue waits until the matrix unit has freed the buffer (semaphore
    ``freed``), loads the weight codes and scales and signals ``loaded``; the matrix unit waits for
    ``loaded``, multiplies and signals ``freed``. With ``nbuf=2`` loads overlap matmuls (double
    buffering); with ``nbuf=1`` they alternate. At the end the vector unit reads the accumulators
    out as bf16 and a DMA stores y. ``m=1`` is a batch-1 GEMV (decode).

    Args:
        spec: the chip.
        m, k, n: shapes; k a multiple of ``chunk_k`` (a multiple of 32), n of the core count.
        chunk_k: rows of W per buffer.
        nbuf: SRAM weight buffers per core (buffer b uses DMA queue ``b % queues``).
        cores: the cores used (default: all).
        name: the program's name.
    """
    cores = _cores(spec, cores)
    if k % chunk_k or chunk_k % 32 or n % len(cores) or nbuf < 1:
        raise InvalidArgumentError(f"need k % chunk_k == 0, chunk_k % 32 == 0, n % cores == 0, "
                                   f"nbuf >= 1 (k={k}, chunk_k={chunk_k}, n={n}, cores={len(cores)}, "
                                   f"nbuf={nbuf})")
    nc = n // len(cores)
    queues = spec.dma.queues_per_core
    kb = KernelBuilder(name or f"streamed_matmul_{m}x{k}x{n}_buf{nbuf}", spec)
    w = kb.hbm_mx("w", (k, n), "fp4", axis=0)
    x = kb.hbm_mx("x", (m, k), "fp4", axis=1)
    y = kb.hbm("y", (m, n), "bf16")
    for c in cores:
        core = kb.core(c)
        xs = kb.sram_mx(c, "x", (m, k), "fp4", axis=1)
        bufs = [kb.sram_mx(c, f"w{b}", (chunk_k, nc), "fp4", axis=0) for b in range(nbuf)]
        acc = kb.acc(c, "acc", (m, nc))
        ys = kb.sram(c, "y", (m, nc), "bf16")
        x_ready, done, stored = (kb.semaphore(f"c{c}.{s}") for s in ("x_ready", "done", "y_ready"))
        loaded = [kb.semaphore(f"c{c}.loaded{b}") for b in range(nbuf)]
        freed = [kb.semaphore(f"c{c}.freed{b}") for b in range(nbuf)]
        qx = core.dma[queues - 1]  # x and y use the last queue, so they do not delay chunk 0
        qx.load(xs.codes, x.codes)
        qx.load(xs.scales, x.scales)
        qx.signal(x_ready)
        core.mxu.wait(x_ready, 1)

        def chunk(i: int, c: int = c, core=core, bufs=bufs, loaded=loaded, freed=freed, xs=xs,
                  acc=acc) -> None:
            b, use = i % nbuf, i // nbuf
            q = core.dma[b % queues]
            if use:
                q.wait(freed[b], use)  # the matrix unit is done with this buffer's last chunk
            wk = w.sub(i * chunk_k, c * nc, chunk_k, nc)
            q.load(bufs[b].codes, wk.codes)
            q.load(bufs[b].scales, wk.scales)
            q.signal(loaded[b])
            core.mxu.wait(loaded[b], use + 1)
            core.mxu.matmul_mx(acc, xs.sub(0, i * chunk_k, m, chunk_k), bufs[b],
                               mode="overwrite" if i == 0 else "accumulate")
            core.mxu.signal(freed[b])

        _rounds(kb, k // chunk_k, nbuf, chunk)
        core.mxu.signal(done)
        core.vpu.wait(done, 1)
        core.vpu.acc_read(ys, acc)
        core.vpu.signal(stored)
        qx.wait(stored, 1)
        qx.store(y.sub(0, c * nc, m, nc), ys)
    return kb.build()


def pipeline_program(spec: ChipSpec, iterations: int, *, cores: Sequence[int] | None = None,
                     nbuf: int = 2, m: int = 128, k: int = 512, n: int = 512) -> Program:
    """A three-stage pipeline on every core, ``iterations`` times: DMA -> matrix unit -> vector unit.

    Per iteration on each core: a DMA queue waits for a free weight buffer, loads a [k, n] MXFP4
    chunk of W and signals; the matrix unit waits for it and for the vector unit to have drained
    the accumulators, multiplies x[m, k] by it and signals twice (buffer free, result ready); the
    vector unit waits, reads the accumulators out as f32 and applies exp. Twelve instructions per
    iteration per core, every kind of engine and semaphore traffic: the timing pass's speed
    benchmark (``benchmarks/bench_timing.py``) uses it.

    Args:
        spec: the chip.
        iterations: pipeline iterations per core.
        cores: the cores used (default: all).
        nbuf: weight buffers per core (buffer b uses DMA queue ``b % queues``).
        m, k, n: the per-iteration matmul shape.
    """
    cores = _cores(spec, cores)
    queues = spec.dma.queues_per_core
    kb = KernelBuilder(f"pipeline_{iterations}", spec)
    w = kb.hbm_mx("w", (k * iterations, n * len(cores)), "fp4", axis=0)
    for ci, c in enumerate(cores):
        core = kb.core(c)
        x = kb.sram_mx(c, "x", (m, k), "fp4", axis=1)
        bufs = [kb.sram_mx(c, f"w{b}", (k, n), "fp4", axis=0) for b in range(nbuf)]
        acc = kb.acc(c, "acc", (m, n))
        out = kb.sram(c, "out", (m, n), "f32")
        loaded = [kb.semaphore(f"c{c}.loaded{b}") for b in range(nbuf)]
        freed = [kb.semaphore(f"c{c}.freed{b}") for b in range(nbuf)]
        ready, drained = kb.semaphore(f"c{c}.ready"), kb.semaphore(f"c{c}.drained")

        def stage(i: int, ci: int = ci, core=core, x=x, bufs=bufs, acc=acc, out=out, loaded=loaded,
                  freed=freed, ready=ready, drained=drained) -> None:
            b, use = i % nbuf, i // nbuf
            q = core.dma[b % queues]
            if use:
                q.wait(freed[b], use)
            q.load(bufs[b].codes, w.codes.sub(i * k, ci * n, k, n))
            q.signal(loaded[b])
            core.mxu.wait(loaded[b], use + 1)
            if i:
                core.mxu.wait(drained, i)
            core.mxu.matmul_mx(acc, x, bufs[b], mode="overwrite")
            core.mxu.signal(freed[b])
            core.mxu.signal(ready)
            core.vpu.wait(ready, i + 1)
            core.vpu.acc_read(out, acc)
            core.vpu.exp(out, out)
            core.vpu.signal(drained)

        _rounds(kb, iterations, nbuf, stage)
    return kb.build()


def _rounds(kb: KernelBuilder, n: int, nbuf: int, step: Callable[[int], None]) -> None:
    """``step(i)`` for i in range(n): the first round of ``nbuf`` steps as they are (fresh buffers
    wait for nothing), the whole rounds after it as hardware loops (``KernelBuilder.repeat``: one
    round is the same up to affine offsets and counts), the rest as they are."""
    issue_in_rounds(kb, 0, n, nbuf, lambda i, _: i >= nbuf, step)
