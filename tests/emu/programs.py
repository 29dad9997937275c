"""Small programs shared by the emulator tests, built with the kernel builder."""

from __future__ import annotations

import sys
from pathlib import Path

from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.program import Program

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gemm_from_scratch import build_gemm

__all__ = ["build_gemm", "matmul_tile_program", "vector_program"]


def matmul_tile_program(m: int = 32, k: int = 128, n: int = 64, *, race: bool = False,
                        uninit: bool = False, wait_value: int = 1, a_fmt: str = "fp4",
                        b_fmt: str = "fp4") -> Program:
    """Load A and B, one matmul, read out, store C, ordered by semaphores (or broken on purpose).

    race: drop the matrix unit's wait for the loads. uninit: accumulate into fresh accumulators.
    wait_value: the value the matrix unit waits for (2 deadlocks).
    """
    kb = KernelBuilder("tile", chip="tiny")
    a_h = kb.hbm_mx("A", (m, k), a_fmt, axis=1) if a_fmt != "bf16" else kb.hbm("A", (m, k), "bf16")
    b_h = kb.hbm_mx("B", (k, n), b_fmt, axis=0) if b_fmt != "bf16" else kb.hbm("B", (k, n), "bf16")
    c_h = kb.hbm("C", (m, n), "f32")
    a = kb.sram_mx(0, "a", (m, k), a_fmt, 1) if a_fmt != "bf16" else kb.sram(0, "a", (m, k), "bf16")
    b = kb.sram_mx(0, "b", (k, n), b_fmt, 0) if b_fmt != "bf16" else kb.sram(0, "b", (k, n), "bf16")
    acc = kb.acc(0, "acc", (m, n))
    c = kb.sram(0, "c", (m, n), "f32")
    loaded, done, read = kb.semaphore("loaded"), kb.semaphore("done"), kb.semaphore("read")
    c0 = kb.core(0)
    for src, dst in ((a_h, a), (b_h, b)):
        if hasattr(src, "codes"):
            c0.dma[0].load(dst.codes, src.codes)
            c0.dma[0].load(dst.scales, src.scales)
        else:
            c0.dma[0].load(dst, src)
    c0.dma[0].signal(loaded)
    if not race:
        c0.mxu.wait(loaded, wait_value)
    c0.mxu.matmul_mx(acc, a, b, mode="accumulate" if uninit else "overwrite")
    c0.mxu.signal(done)
    c0.vpu.wait(done, 1)
    c0.vpu.acc_read(c, acc)
    c0.vpu.signal(read)
    c0.dma[1].wait(read, 1)
    c0.dma[1].store(c_h, c)
    return kb.build()


def vector_program(op: str, rows: int = 8, cols: int = 64, dtype: str = "f32") -> Program:
    """Load X (and Y), apply one vector op, store Z. ``op`` names a builder method."""
    kb = KernelBuilder(f"vec_{op}", chip="tiny")
    x_h, y_h = kb.hbm("X", (rows, cols), dtype), kb.hbm("Y", (rows, cols), dtype)
    out_cols = {"reduce_max": 1, "reduce_sum": 1, "topk": 4}.get(op, cols)
    z_h = kb.hbm("Z", (rows, out_cols), dtype)
    x, y = kb.sram(0, "x", (rows, cols), dtype), kb.sram(0, "y", (rows, cols), dtype)
    z = kb.sram(0, "z", (rows, out_cols), dtype)
    zi = kb.sram(0, "zi", (rows, out_cols), "i32")
    zi_h = kb.hbm("ZI", (rows, out_cols), "i32")
    s1, s2 = kb.semaphore("in"), kb.semaphore("out")
    c0 = kb.core(0)
    c0.dma[0].load(x, x_h)
    c0.dma[0].load(y, y_h)
    c0.dma[0].signal(s1)
    v = c0.vpu
    v.wait(s1, 1)
    if op in ("add", "sub", "mul", "max", "min"):
        getattr(v, op)(z, x, y)
    elif op == "reduce_max":
        v.reduce("max", z, x)
    elif op == "reduce_sum":
        v.reduce("sum", z, x)
    elif op == "clamp":
        v.clamp(z, x, -0.5, 0.75)
    elif op == "scale":
        v.scale(z, x, 0.125)
    elif op == "topk":
        v.topk(z, zi, x)
    else:
        getattr(v, op)(z, x)
    v.signal(s2)
    c0.dma[1].wait(s2, 1)
    c0.dma[1].store(z_h, z)
    if op == "topk":
        c0.dma[1].store(zi_h, zi)
    return kb.build()
