"""mla-decode / mla-prefill: reference agreement, absorbed == naive math, shape refusals, full-size timing.

Also the one instruction the family added, ``mxu.matmul_t`` (a @ b^T), against numpy.
"""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.kernels import get_kernel, run_kernel
from jalapeno_emu.kernels.mla import mla_decode_reference, yarn_softmax_scale
from jalapeno_emu.mx import quantize

DEEPSEEK = {"q_heads": 128, "kv_lora_rank": 512, "rope_dim": 64, "nope_dim": 128, "v_head_dim": 128}


def test_matmul_t_is_a_times_b_transposed_bf16_and_mx():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 64)).astype(np.float32)
    b = rng.standard_normal((16, 64)).astype(np.float32)
    kb = KernelBuilder("mmt", chip="tiny")
    a_h, b_h = kb.hbm("a", (8, 64), "bf16"), kb.hbm("b", (16, 64), "bf16")
    bq_h = kb.hbm_mx("bq", (16, 64), "fp8e4", axis=1)  # blocked along K = its columns
    aq_h = kb.hbm_mx("aq", (8, 64), "fp8e4", axis=1)
    out_h, outq_h = kb.hbm("out", (8, 16), "f32"), kb.hbm("outq", (8, 16), "f32")
    c = kb.core(0)
    a_s, b_s = kb.sram(0, "a", (8, 64), "bf16"), kb.sram(0, "b", (16, 64), "bf16")
    aq_s, bq_s = kb.sram_mx(0, "aq", (8, 64), "fp8e4"), kb.sram_mx(0, "bq", (16, 64), "fp8e4")
    acc, accq = kb.acc(0, "acc", (8, 16)), kb.acc(0, "accq", (8, 16))
    o, oq = kb.sram(0, "o", (8, 16), "f32"), kb.sram(0, "oq", (8, 16), "f32")
    loaded, done = kb.semaphore("loaded"), kb.semaphore("done")
    for dst, src in ((a_s, a_h), (b_s, b_h), (aq_s.codes, aq_h.codes), (aq_s.scales, aq_h.scales),
                     (bq_s.codes, bq_h.codes), (bq_s.scales, bq_h.scales)):
        c.dma[0].load(dst, src)
    c.dma[0].signal(loaded)
    c.mxu.wait(loaded, 1)
    c.mxu.matmul_t(acc, a_s, b_s, mode="overwrite")
    c.mxu.matmul_t(accq, aq_s.codes, bq_s.codes, a_scale=aq_s.scales, b_scale=bq_s.scales,
                   mode="overwrite")
    c.mxu.signal(done)
    c.vpu.wait(done, 1)
    c.vpu.acc_read(o, acc)
    c.vpu.acc_read(oq, accq)
    c.vpu.signal(loaded)
    c.dma[1].wait(loaded, 2)
    c.dma[1].store(out_h, o)
    c.dma[1].store(outq_h, oq)
    aq, bq = quantize(jnp.asarray(a), "e4m3", axis=1), quantize(jnp.asarray(b), "e4m3", axis=1)
    res = run_functional(kb.build(), {"a": a.astype(ml_dtypes.bfloat16), "b": b.astype(ml_dtypes.bfloat16),
                                      "aq": aq, "bq": bq})
    want = a.astype(ml_dtypes.bfloat16).astype(np.float64) @ b.astype(ml_dtypes.bfloat16).astype(np.float64).T
    np.testing.assert_allclose(res.read("out"), want, rtol=1e-5, atol=1e-4)
    from jalapeno_emu.mx import dequantize
    want_q = np.asarray(dequantize(aq), np.float64) @ np.asarray(dequantize(bq), np.float64).T
    np.testing.assert_allclose(res.read("outq"), want_q, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("C, capacity, cap", [(64, 0, 64), (33, 0, 64), (47, 96, 96)])
def test_absorbed_reference_equals_naive_mla_in_float64(C, capacity, cap):
    """The absorbed decode reference is the same function as decompress-then-attend (up to BF16)
    over the first ``context`` rows of each sequence's ``cap`` rows (the rest: +-1e4 padding)."""
    B, H, R, P, N, V = 2, 4, 64, 32, 32, 32
    inputs = get_kernel("mla-decode").build(
        {"batch": B, "context": C, "capacity": capacity, "q_heads": H, "kv_lora_rank": R, "rope_dim": P,
         "nope_dim": N, "v_head_dim": V, "kv_dtype": "bf16", "softmax_scale": 0.0, "kv_tile": 0},
        load_preset("tiny")).make_inputs(3)
    q = np.asarray(inputs["q"], np.float64).reshape(B, H, N + P)
    rows = np.asarray(inputs["kv_cache"], np.float64).reshape(B, cap, R + P)
    assert np.all(np.abs(rows[:, C:]) > 5e3)  # the padding is garbage that would swamp the scores
    kv = rows[:, :C]
    w = np.asarray(inputs["w_kv_b"], np.float64).reshape(H, N + V, R)
    k = np.concatenate([np.einsum("bcr,hnr->bhcn", kv[..., :R], w[:, :N]),
                        np.broadcast_to(kv[:, None, :, R:], (B, H, C, P))], axis=-1)
    v = np.einsum("bcr,hvr->bhcv", kv[..., :R], w[:, N:])
    s = np.einsum("bhd,bhcd->bhc", q, k) / math.sqrt(N + P)
    p = np.exp(s - s.max(-1, keepdims=True))
    naive = np.einsum("bhc,bhcv->bhv", p / p.sum(-1, keepdims=True), v).reshape(B * H, V)
    got = mla_decode_reference(inputs["q"], inputs["kv_cache"], inputs["w_kv_b"], batch=B, context=C,
                               heads=H, rank=R, rope=P, nope=N, v=V, scale=1 / math.sqrt(N + P),
                               capacity=capacity)
    np.testing.assert_allclose(np.asarray(got, np.float64), naive, atol=0.02, rtol=0.02)


def test_decode_matches_reference_over_tiles_and_sequences():
    # 3 sequences on 2 cores (one core runs two, switching softmax state), 2 context tiles each.
    r = run_kernel("mla-decode", {"batch": 3, "context": 64, "q_heads": 4, "kv_tile": 32}, check=True)
    assert r.check["passed"], r.check
    assert r.notes["kv_tile"] == 32 and r.summary["time_s"] >= r.summary["lower_bound_s"]


def _kv_rows_loaded(program, row_bytes):
    """Sorted list of the kv_cache rows the program's DMA loads read (each row once per load)."""
    cache = program.allocation("kv_cache")
    rows = []
    for ins in program.instructions:
        if ins.mnemonic == "dma.load" and cache.offset <= ins.arg("src").offset < cache.end:
            src = ins.arg("src")
            first, every = (src.offset - cache.offset) // row_bytes, src.stride // row_bytes
            rows += [first + i * every for i in range(src.rows)]
    return sorted(rows)


@pytest.mark.parametrize("shape, cap, pad", [
    ({"batch": 3, "context": 33, "q_heads": 4, "kv_tile": 32}, 64, 31),  # 2 tiles, 31 padded keys
    ({"batch": 3, "context": 47, "q_heads": 4}, 64, 17),  # one 64-key tile, 17 padded
    ({"batch": 3, "context": 64, "q_heads": 4, "kv_tile": 32, "capacity": 96}, 96, 0),  # rows 64..95 unread
])
def test_decode_at_any_context_ignores_the_padding_rows(shape, cap, pad):
    """Sequence b's rows start at b*cap; the rows past the context hold +-1e4 (large enough that
    attending to them would wreck the output, as the reference over the padded span shows); the
    kernel reads the context's 32-token blocks, masks the padded positions and matches the
    reference over the real rows (3 sequences on 2 cores: a core masks two sequences)."""
    r = run_kernel("mla-decode", shape, check=True)
    assert r.check["passed"], r.check
    B, C, H, W = 3, shape["context"], 4, 64 + 32
    span = C + pad
    assert r.notes["cache_capacity"] == cap and r.notes["padded_tokens"] == pad
    prog = r.build.program
    assert dict(dict(prog.meta)["tensors"])["kv_cache"][1] == (B * cap, W)
    assert _kv_rows_loaded(prog, W * 2) == [b * cap + t for b in range(B) for t in range(span)]
    clamps = [i for i in prog.instructions if i.mnemonic == "vec.clamp"]
    assert len(clamps) == (B if pad else 0) and all(i.arg("dst").cols == pad for i in clamps)
    inputs = r.build.make_inputs(0)
    kv = np.asarray(inputs["kv_cache"], np.float32).reshape(B, cap, W)
    assert np.all(np.abs(kv[:, C:]) > 5e3)
    if pad:
        got = np.asarray(run_functional(prog, inputs).read("out", "bf16", (B * H, 32)), np.float32)
        dims = dict(batch=B, context=span, capacity=cap, heads=H, rank=64, rope=32, nope=32, v=32,
                    scale=r.notes["softmax_scale"])
        unmasked = mla_decode_reference(inputs["q"], inputs["kv_cache"], inputs["w_kv_b"], **dims)
        assert np.max(np.abs(got - np.asarray(unmasked, np.float32))) > 100


def test_decode_padding_only_adds_the_masking():
    """Context 63 reads the blocks of context 64: its program is 64's plus one vec.clamp per
    sequence (the padded scores set to -1e30), and a capacity equal to the rounded context is
    the default program itself."""
    kdef, spec = get_kernel("mla-decode"), load_preset("tiny")

    def ops(shape):
        program = kdef.build(kdef.shape(shape), spec).program
        return [(i.mnemonic, i.engine, i.args) for i in program.instructions]

    full, padded = ops({"batch": 3, "context": 64}), ops({"batch": 3, "context": 63})
    assert [op for op in padded if op[0] != "vec.clamp"] == full
    clamps = [dict(op[2]) for op in padded if op[0] == "vec.clamp"]
    assert len(clamps) == 3 and all(c["lo"] == c["hi"] == -1e30 and c["dst"].cols == 1 for c in clamps)
    assert ops({"batch": 3, "context": 64, "capacity": 64}) == full


def test_decode_full_size_padded_context_costs_its_blocks():
    """DeepSeek-R1, batch 64 on jalapeno-v1 (timing only): context 8161 in a 16384-row capacity
    reads the 8192 rows of context 8192, in the same time, plus one vector instruction per
    sequence."""
    full, padded = (run_kernel("mla-decode", {"batch": 64, "context": c, "capacity": cap, **DEEPSEEK},
                               preset="jalapeno-v1", safety_checks=False).summary
                    for c, cap in ((8192, 0), (8161, 16384)))
    assert padded["hbm_bytes"] == full["hbm_bytes"]
    assert padded["instructions"] == full["instructions"] + 64
    assert padded["time_s"] == pytest.approx(full["time_s"], rel=1e-3)


@pytest.mark.parametrize("shape", [
    {"batch": 2, "seq": 96, "q_heads": 3, "kv_tile": 32, "softmax_scale": yarn_softmax_scale(64)},
    {"prior": 64},  # one query tile over a prior tile and its diagonal
    {"batch": 2, "seq": 64, "prior": 96, "q_heads": 3, "kv_tile": 32},  # 3 prior tiles, 2 query tiles
    {"batch": 2, "seq": 32, "prior": 32, "q_heads": 3, "capacity": 96},  # rows 64..95 of each: +-1e4
])
def test_prefill_matches_reference_causal_over_tiles(shape):
    r = run_kernel("mla-prefill", shape, check=True)
    assert r.check["passed"], r.check
    t = r.notes["tile"]
    assert r.notes["key_tiles"] == -(-shape.get("prior", 0) // t) + -(-r.shape["seq"] // t)


def test_prefill_reference_with_prior_matches_float64():
    """Queries at positions prior.. see every cached token up to their own: decompress-then-attend
    in float64 over the whole cache agrees with the BF16-rounding reference."""
    B, S, prior, H, R, P, N, V = 2, 32, 64, 2, 64, 32, 32, 32
    kdef = get_kernel("mla-prefill")
    build = kdef.build(kdef.shape({"batch": B, "seq": S, "prior": prior, "q_heads": H}), load_preset("tiny"))
    inputs = build.make_inputs(5)
    got = np.asarray(build.reference(inputs)["out"], np.float64).reshape(B, S, H, V)
    q = np.asarray(inputs["q"], np.float64).reshape(B, S, H, N + P)
    kv = np.asarray(inputs["kv_cache"], np.float64).reshape(B, prior + S, R + P)
    w = np.asarray(inputs["w_kv_b"], np.float64).reshape(H, N + V, R)
    k = np.concatenate([np.einsum("bcr,hnr->bhcn", kv[..., :R], w[:, :N]),
                        np.broadcast_to(kv[:, None, :, R:], (B, H, prior + S, P))], axis=-1)
    v = np.einsum("bcr,hvr->bhcv", kv[..., :R], w[:, N:])
    s = np.einsum("bshd,bhcd->bhsc", q, k) / math.sqrt(N + P)
    s = np.where(np.arange(prior + S)[None, :] <= prior + np.arange(S)[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhsc,bhcv->bshv", p / p.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(got, want, atol=0.02, rtol=0.02)


def test_chunked_prefill_equals_one_prefill():
    """64 tokens at prior 0, then 32 at prior 64 over the same latent cache: the outputs of one
    prefill of 96 tokens (the kernel reads the cache, so the chunks see exactly its rows)."""
    kdef, spec = get_kernel("mla-prefill"), load_preset("tiny")
    B, H, W = 2, 3, 64 + 32
    base = {"batch": B, "q_heads": H, "kv_tile": 32}
    whole = kdef.build(kdef.shape(dict(base, seq=96)), spec)
    ins = whole.make_inputs(0)
    want = np.asarray(run_functional(whole.program, ins).read("out", "bf16", (B * 96 * H, 32)),
                      np.float32).reshape(B, 96, H, 32)
    q = np.asarray(ins["q"]).reshape(B, 96, H, -1)
    kv = np.asarray(ins["kv_cache"]).reshape(B, 96, W)
    for lo, hi in ((0, 64), (64, 96)):
        part = kdef.build(kdef.shape(dict(base, seq=hi - lo, prior=lo)), spec)
        pins = dict(part.make_inputs(0), w_kv_b=ins["w_kv_b"], q=q[:, lo:hi].reshape(-1, q.shape[-1]),
                    kv_cache=kv[:, :hi].reshape(-1, W))
        got = np.asarray(run_functional(part.program, pins).read("out", "bf16", (B * (hi - lo) * H, 32)),
                         np.float32).reshape(B, hi - lo, H, 32)
        np.testing.assert_allclose(got, want[:, lo:hi], atol=whole.tolerance.atol, rtol=whole.tolerance.rtol)


def test_impossible_shapes_are_refused_before_building():
    for key, value in (("kv_lora_rank", 48), ("rope_dim", 48), ("nope_dim", 40)):
        with pytest.raises(InvalidArgumentError, match=f"{key}={value} must be a multiple of 32"):
            run_kernel("mla-decode", {key: value})
    with pytest.raises(InvalidArgumentError, match="context=0 must be >= 1"):
        run_kernel("mla-decode", {"context": 0})
    with pytest.raises(InvalidArgumentError, match="capacity=80 must be a multiple of 32 and >= context=70"):
        run_kernel("mla-decode", {"context": 70, "capacity": 80})
    with pytest.raises(InvalidArgumentError, match="capacity=64 must be a multiple of 32 and >= context=70"):
        run_kernel("mla-decode", {"context": 70, "capacity": 64})
    with pytest.raises(InvalidArgumentError, match=r"capacity=64 must be .* >= prior\+seq=96"):
        run_kernel("mla-prefill", {"seq": 64, "prior": 32, "capacity": 64})
    with pytest.raises(InvalidArgumentError, match=r"kv_cache has shape \(130, 96\)"):  # context 65: cap 96
        mla_decode_reference(np.zeros((16, 64)), np.zeros((130, 96)), np.zeros((512, 64)), batch=2,
                             context=65, heads=8, rank=64, rope=32, nope=32, v=32, scale=1.0)
    with pytest.raises(InvalidArgumentError, match="seq=70 must be a multiple of 32"):
        run_kernel("mla-prefill", {"seq": 70})
    # Shapes the on-core tilings cannot hold take the small-scratchpad path (test_mla_small.py)
    # instead of being refused: DeepSeek's dims on the tiny chip build.
    assert get_kernel("mla-decode").build(get_kernel("mla-decode").shape(DEEPSEEK),
                                          load_preset("tiny")).notes["path"] == "small-scratchpad"
    with pytest.raises(InvalidArgumentError, match="prior=48 must be a multiple of 32"):
        run_kernel("mla-prefill", {"prior": 48})
    with pytest.raises(InvalidArgumentError, match="prior=-32 must be >= 0"):
        run_kernel("mla-prefill", {"prior": -32})
    with pytest.raises(InvalidArgumentError, match="kv_tile=48"):
        run_kernel("mla-decode", {"kv_tile": 48})
    with pytest.raises(InvalidArgumentError, match="softmax_scale"):
        run_kernel("mla-decode", {"softmax_scale": -1.0})
    with pytest.raises(InvalidArgumentError, match="kv_dtype"):
        get_kernel("mla-decode").shape(texts=["kv_dtype=fp8"])


def test_decode_full_size_reads_the_latent_cache_once():
    """DeepSeek-R1 dims, batch 64 on jalapeno-v1 (timing only): HBM bytes = cache + weights + q/out."""
    r = run_kernel("mla-decode", {"batch": 64, "context": 1024, **DEEPSEEK}, preset="jalapeno-v1")
    cache = 64 * 1024 * (512 + 64) * 2
    must = cache + r.notes["weight_bytes"] + r.notes["q_out_bytes"]
    assert r.notes["latent_cache_bytes"] == cache
    # Once per head would be 128x the cache; once is exactly these bytes.
    assert must <= r.summary["hbm_bytes"] <= 1.01 * must
    peak = r.summary["hbm_bytes"] / r.summary["time_s"] / r.summary["hbm_utilization"]
    assert r.summary["time_s"] >= cache / peak
    assert r.summary["hbm_utilization"] > 0.25  # at 2 tiles per core the fill/drain latencies show


def test_prefill_full_dims_timing_only():
    r = run_kernel("mla-prefill", {"batch": 1, "seq": 512, **DEEPSEEK}, preset="jalapeno-v1")
    s = r.summary
    # causal: 128 heads x (QK^T + PV) over the lower triangle of 2x2 tiles of 256, plus decompression
    assert s["flops"] > 2 * 128 * (512 * 512 / 2) * (192 + 128)
    assert s["time_s"] >= s["lower_bound_s"] and s["mxu_utilization"] > 0.05


def test_prefill_chunk_over_prior_context_full_dims_timing_only():
    """DeepSeek-R1 dims, a 512-token chunk after 1536 cached tokens (timing only): every (sequence,
    head) item reads the whole latent cache and decompresses K and V for all 2048 tokens."""
    r = run_kernel("mla-prefill", {"batch": 1, "seq": 512, "prior": 1536, **DEEPSEEK}, preset="jalapeno-v1",
                   safety_checks=False)
    s = r.summary
    attention = 2 * 128 * 512 * (1536 + 512 / 2) * (192 + 128)  # QK^T and PV, prior + causal keys
    decompress = 2 * 128 * 2048 * 512 * (128 + 128)  # c_kv @ W_UK^T and @ W_UV^T per head
    assert s["flops"] >= attention + decompress
    assert s["hbm_bytes"] >= 128 * 2048 * (512 + 64) * 2  # the latent cache once per item
    assert s["time_s"] >= s["lower_bound_s"]
