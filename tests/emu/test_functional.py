"""The functional pass against pure-JAX / mx references, on tiny shapes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jalapeno_emu import mx
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.errors import Deadlock, OutOfBounds
from jalapeno_emu.isa.builder import KernelBuilder
from tests.emu.programs import build_gemm, matmul_tile_program, vector_program


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize(("af", "bf", "fa", "fb"), [("fp4", "fp4", "e2m1", "e2m1"),
                                                    ("fp8e4", "fp4", "e4m3", "e2m1"),
                                                    ("fp8e5", "fp8e4", "e5m2", "e4m3")])
def test_matmul_tile_is_bit_exact_with_mx_matmul(af, bf, fa, fb):
    rng = np.random.default_rng(1)
    a = mx.quantize(rng.standard_normal((32, 128)).astype(np.float32), fa, axis=1)
    b = mx.quantize(rng.standard_normal((128, 64)).astype(np.float32), fb, axis=0)
    out = run_functional(matmul_tile_program(a_fmt=af, b_fmt=bf), {"A": a, "B": b}).read("C")
    assert np.array_equal(_bits(out), _bits(mx.matmul(a, b)))


@pytest.mark.parametrize("double", [False, True])
def test_multicore_gemm_with_k_chunks_is_bit_exact(double):
    m, n, k = 256, 128, 1024  # two cores, two K chunks accumulate in order
    rng = np.random.default_rng(2)
    a = mx.quantize(rng.standard_normal((m, k)).astype(np.float32), axis=1)
    b = mx.quantize(rng.standard_normal((k, n)).astype(np.float32), axis=0)
    out = run_functional(build_gemm(m, n, k, double_buffer=double), {"A": a, "B": b}).read("C")
    assert np.array_equal(_bits(out), _bits(mx.matmul(a, b)))


def test_bf16_matmul_sums_each_block_in_order():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((32, 64)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((64, 32)).astype(ml_dtypes.bfloat16)
    out = run_functional(matmul_tile_program(m=32, k=64, n=32, a_fmt="bf16", b_fmt="bf16"),
                         {"A": a, "B": b}).read("C")
    af, bf = a.astype(np.float32), b.astype(np.float32)
    want = np.zeros((32, 32), np.float32)
    for j in range(2):
        blk = np.zeros((32, 32), np.float32)
        for kk in range(32 * j, 32 * j + 32):
            blk = blk + np.outer(af[:, kk], bf[kk])
        want = want + blk
    assert np.array_equal(_bits(out), _bits(want))


_UNARY_REF = {
    "exp": jnp.exp, "rsqrt": jax.lax.rsqrt, "sigmoid": jax.nn.sigmoid,
    "silu": lambda x: x * jax.nn.sigmoid(x), "neg": jnp.negative, "abs": jnp.abs,
    "recip": lambda x: 1 / x, "square": jnp.square, "copy": lambda x: x,
}


@pytest.mark.parametrize("op", sorted(_UNARY_REF))
def test_unary_vector_ops(op):
    rng = np.random.default_rng(4)
    x = np.abs(rng.standard_normal((8, 64))).astype(np.float32) + 0.1
    out = run_functional(vector_program(op), {"X": x, "Y": x}).read("Z")
    np.testing.assert_array_equal(out, np.asarray(_UNARY_REF[op](jnp.asarray(x))))


@pytest.mark.parametrize("op", ["add", "sub", "mul", "max", "min", "clamp", "scale",
                                "reduce_max", "reduce_sum", "topk"])
def test_other_vector_ops(op):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    y = rng.standard_normal((8, 64)).astype(np.float32)
    res = run_functional(vector_program(op), {"X": x, "Y": y})
    out = res.read("Z")
    want = {
        "add": x + y, "sub": x - y, "mul": x * y, "max": np.maximum(x, y), "min": np.minimum(x, y),
        "clamp": np.clip(x, -0.5, 0.75), "scale": x * np.float32(0.125),
        "reduce_max": x.max(1, keepdims=True),
        "reduce_sum": np.cumsum(x, axis=1, dtype=np.float32)[:, -1:],
        "topk": -np.sort(-x, axis=1)[:, :4],
    }[op]
    np.testing.assert_array_equal(out, want)
    if op == "topk":
        np.testing.assert_array_equal(res.read("ZI"), np.argsort(-x, axis=1, kind="stable")[:, :4])


def test_bf16_output_rounds_to_nearest_even():
    # The vector unit's copy casts: f32 in, bf16 out, rounded on the chip (inputs are never
    # converted on the way in, so the f32 values reach it unrounded).
    kb = KernelBuilder("cast", chip="tiny")
    x_h, z_h = kb.hbm("X", (8, 64), "f32"), kb.hbm("Z", (8, 64), "bf16")
    x, z = kb.sram(0, "x", (8, 64), "f32"), kb.sram(0, "z", (8, 64), "bf16")
    s1, s2 = kb.semaphore("in"), kb.semaphore("out")
    c0 = kb.core(0)
    c0.dma[0].load(x, x_h)
    c0.dma[0].signal(s1)
    c0.vpu.wait(s1, 1)
    c0.vpu.copy(z, x)
    c0.vpu.signal(s2)
    c0.dma[1].wait(s2, 1)
    c0.dma[1].store(z_h, z)
    x = np.array([[1 + 2.0**-8, 1 + 3 * 2.0**-8] * 32] * 8, np.float32)  # ties in bf16
    out = run_functional(kb.build(), {"X": x}).read("Z")
    assert out.dtype == ml_dtypes.bfloat16
    assert float(out[0, 0]) == 1.0 and float(out[0, 1]) == 1 + 2**-6


def test_quantize_instruction_matches_mx_quantize():
    kb = KernelBuilder("q", chip="tiny")
    x_h = kb.hbm("X", (4, 64), "f32")
    q_h = kb.hbm_mx("Q", (4, 64), "fp4", axis=1)
    x = kb.sram(0, "x", (4, 64), "f32")
    q = kb.sram_mx(0, "q", (4, 64), "fp4", 1)
    s1, s2 = kb.semaphore("in"), kb.semaphore("out")
    c0 = kb.core(0)
    c0.dma[0].load(x, x_h)
    c0.dma[0].signal(s1)
    c0.vpu.wait(s1, 1)
    c0.vpu.quantize(q.codes, q.scales, x, scale_mode="rceil")
    c0.vpu.signal(s2)
    c0.dma[1].wait(s2, 1)
    c0.dma[1].store(q_h.codes, q.codes)
    c0.dma[1].store(q_h.scales, q.scales)
    xv = np.random.default_rng(6).standard_normal((4, 64)).astype(np.float32) * 3
    res = run_functional(kb.build(), {"X": xv})
    want = mx.quantize(xv, "e2m1", scale_mode="rceil")
    np.testing.assert_array_equal(res.read("Q"), np.asarray(want.codes))
    np.testing.assert_array_equal(res.read("Q.scales"), np.asarray(want.scales))


def test_gather_picks_rows_and_rejects_bad_indices():
    kb = KernelBuilder("g", chip="tiny")
    table = kb.hbm("T", (16, 32), "f32")
    ids_h = kb.hbm("I", (4, 1), "i32")
    out_h = kb.hbm("O", (4, 32), "f32")
    ids = kb.sram(0, "ids", (4, 1), "i32")
    out = kb.sram(0, "out", (4, 32), "f32")
    s1, s2 = kb.semaphore("ids"), kb.semaphore("rows")
    c0 = kb.core(0)
    c0.dma[0].load(ids, ids_h)
    c0.dma[0].signal(s1)
    c0.dma[1].wait(s1, 1)
    c0.dma[1].gather(out, table, ids)
    c0.dma[1].signal(s2)
    c0.dma[2].wait(s2, 1)
    c0.dma[2].store(out_h, out)
    prog = kb.build()
    t = np.arange(16 * 32, dtype=np.float32).reshape(16, 32)
    got = run_functional(prog, {"T": t, "I": np.array([[3], [0], [15], [3]], np.int32)}).read("O")
    np.testing.assert_array_equal(got, t[[3, 0, 15, 3]])
    with pytest.raises(OutOfBounds, match="gather index outside"):
        run_functional(prog, {"T": t, "I": np.array([[3], [16], [0], [0]], np.int32)})


def test_debug_mode_poisons_fresh_memory_with_nan():
    # Nothing writes B: in debug mode the product is NaN, in normal mode it is zero.
    rng = np.random.default_rng(7)
    a = mx.quantize(rng.standard_normal((32, 128)).astype(np.float32), axis=1)
    prog = matmul_tile_program()
    assert np.isnan(run_functional(prog, {"A": a}, debug=True).read("C")).all()
    assert (run_functional(prog, {"A": a}).read("C") == 0).all()


def test_deadlocked_program_raises_instead_of_hanging():
    with pytest.raises(Deadlock, match="waits for semaphore 0"):
        run_functional(matmul_tile_program(wait_value=2))


def test_whole_program_compilation_gives_the_same_bytes():
    rng = np.random.default_rng(9)
    a = mx.quantize(rng.standard_normal((256, 1024)).astype(np.float32), axis=1)
    b = mx.quantize(rng.standard_normal((1024, 128)).astype(np.float32), axis=0)
    prog = build_gemm(256, 128, 1024)
    per_instr = run_functional(prog, {"A": a, "B": b})
    whole = run_functional(prog, {"A": a, "B": b}, compile="program")
    assert {k: v.tobytes() for k, v in whole.buffers.items()} == \
        {k: v.tobytes() for k, v in per_instr.buffers.items()}


def test_whole_program_mode_reports_data_dependent_errors_too():
    kb = KernelBuilder("g", chip="tiny")
    table, ids_h = kb.hbm("T", (16, 32), "f32"), kb.hbm("I", (4, 1), "i32")
    ids, out = kb.sram(0, "ids", (4, 1), "i32"), kb.sram(0, "out", (4, 32), "f32")
    s1 = kb.semaphore("ids")
    c0 = kb.core(0)
    c0.dma[0].load(ids, ids_h)
    c0.dma[0].signal(s1)
    c0.dma[1].wait(s1, 1)
    c0.dma[1].gather(out, table, ids)
    bad = {"T": np.zeros((16, 32), np.float32), "I": np.array([[3], [16], [0], [0]], np.int32)}
    with pytest.raises(OutOfBounds, match="gather index outside"):
        run_functional(kb.build(), bad, compile="program")


def test_buffers_come_back_at_their_own_size_and_cores_share_compiled_functions():
    """Backing arrays are rounded up (so nearby sizes and every core share compiled functions);
    what a run returns is each buffer at its allocation's size, with the same values."""
    from jalapeno_emu.emu import functional

    kb = KernelBuilder("two_cores", chip="tiny")
    x = kb.hbm("x", (3, 40), "f32")  # 480 B: backed by 512
    y = kb.hbm("y", (3, 40), "f32")
    bufs = [kb.sram(c, "v", (3, 40), "f32") for c in (0, 1)]
    kb.sram(1, "pad", (5, 8), "f32")  # core 1's scratchpad reaches further than core 0's
    for c, v in enumerate(bufs):
        core, s = kb.core(c), kb.semaphore(f"s{c}")
        core.dma[0].load(v, x)
        core.dma[0].signal(s)
        core.vpu.wait(s, 1)
        core.vpu.exp(v, v)
    done = kb.semaphore("done")
    kb.core(1).vpu.signal(done)
    kb.core(1).dma[1].wait(done, 1)
    kb.core(1).dma[1].store(y, bufs[1])
    prog = kb.build()
    data = np.arange(120, dtype=np.float32).reshape(3, 40) / 50
    result = run_functional(prog, {"x": data})
    layout = functional.MemoryLayout.of(prog)
    assert {k: v.size for k, v in result.buffers.items()} == layout.sizes
    # the two cores' touched runs (480 B each, from a multiple of 64 B) packed: 1 KiB; core 1's
    # pad is allocated but untouched, so not backed, and reads as memory's first value
    assert layout.backing["hbm:x"] == 512 and layout.backing["sram"] == 1024
    assert layout.locate(bufs[1]) == ("sram", 512)
    assert not result.read("pad", core=1).any()
    assert run_functional(prog, {"x": data}, debug=True).read_bytes("pad", core=1).tolist() == [0xFF] * 160
    np.testing.assert_allclose(result.read("y"), np.exp(data), rtol=1e-6)  # (XLA's exp: 1 ulp)
    _, plan = functional._plan(prog)
    exps = [fn for idx, fn, _, _ in plan if prog.instructions[idx].mnemonic == "vec.unary"]
    assert len(exps) == 2 and exps[0] is exps[1]  # one signature for both cores


def test_a_program_hashes_once_and_again_where_it_is_unpickled():
    import pickle

    prog = matmul_tile_program()
    h = hash(prog)
    assert hash(prog) == h and prog.__dict__["_hash"] == h
    copy = pickle.loads(pickle.dumps(prog))
    assert "_hash" not in copy.__dict__  # a string's hash differs between processes
    assert copy == prog and hash(copy) == h


def test_only_the_memory_instructions_touch_is_backed():
    """A tile at the top of each 8 MiB scratchpad of 64 cores backs a few KiB, not 512 MiB; the
    buffers come back at their full size with the values in place, and a tile the program never
    touches has no backing to locate."""
    from jalapeno_emu.emu import functional
    from jalapeno_emu.isa.program import Tile
    from jalapeno_emu.isa.table import Space

    kb = KernelBuilder("top_of_scratchpad", chip="jalapeno-v1")
    x = kb.hbm("x", (64, 16), "f32")
    y = kb.hbm("y", (64, 16), "f32")
    for c in range(64):
        kb.sram(c, "pad", (6 << 12, 256), "u8")  # 6 MiB allocated, never touched
        v = kb.sram(c, "v", (1, 16), "f32")
        core, s = kb.core(c), kb.semaphore(f"s{c}")
        core.dma[0].load(v, x.sub(c, 0, 1, 16))
        core.dma[0].signal(s)
        core.dma[1].wait(s, 1)
        core.dma[1].store(y.sub(c, 0, 1, 16), v)
    prog = kb.build()
    layout = functional.MemoryLayout.of(prog)
    assert layout.backing["sram"] == 64 * 64
    assert layout.sizes["sram:63"] > 6 << 20
    data = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    result = run_functional(prog, {"x": data})
    assert np.array_equal(result.read("y"), data)
    assert np.array_equal(result.read("v", core=17).reshape(-1), data[17])
    with pytest.raises(OutOfBounds, match="not in memory the program"):
        layout.locate(Tile(Space.SRAM, 5, 0, "u8", 1, 64, 64))  # core 5's pad
