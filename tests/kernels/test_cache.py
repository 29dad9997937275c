"""kv-append / mla-append: bit-exact against their references (every byte of the caches), the
rotation against attention-prefill's K^T rotation and HF DeepSeek's RoPE, the caches consumed by
attention-decode and mla-decode, the YaRN tables, refusals, and full-size timing."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jalapeno_emu import mx
from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.kernels import get_kernel, run_kernel
from jalapeno_emu.kernels.attention import decode_logical_cache, yarn_cos_sin
from jalapeno_emu.kernels.cache import kv_append_reference, rope_rotate_half
from jalapeno_emu.kernels.mla import mla_decode_reference, mla_prefill_reference
from jalapeno_emu.kernels.mla_append import YARN_DEEPSEEK_V3, deepseek_yarn_cos_sin, rope_deinterleaved

BF16 = ml_dtypes.bfloat16
TINY = load_preset("tiny")


def _build(name, shape, spec=TINY):
    kdef = get_kernel(name)
    full = kdef.shape(shape)
    return full, kdef.build(full, spec)


def _run(build, inputs):
    """Run a built kernel functionally; its outputs as arrays of their recorded dtype and shape."""
    res = run_functional(build.program, inputs)
    return {name: res.read(name, dt, shape) for name, (dt, shape) in build.outputs.items()}


def _bits(x):
    return np.asarray(x, BF16).view(np.uint16)


# --- kv-append ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [
    {},  # new token inside a partly filled 32-token block (context 40, cap 64)
    {"context": 1, "batch": 3, "kv_heads": 1},  # the first token of every sequence
    {"context": 64, "head_dim": 128},  # the last slot of a full block
    {"batch": 4, "kv_heads": 8, "head_dim": 1024, "context": 33},  # two jobs per core on tiny
])
def test_kv_append_is_bit_exact_on_every_byte(shape):
    r = run_kernel("kv-append", shape, check=True)
    assert r.check["passed"] and r.check["max_abs_error"] == 0.0, r.check
    if shape.get("head_dim") == 1024:
        assert r.notes["jobs_per_core"] == 2


def test_kv_append_rotation_is_attention_prefill_bit_for_bit():
    """attention-prefill over 64 tokens writes rotated K^T columns 0..63; kv-append of token p
    (context p+1) onto columns 0..p-1 of that cache gives back column p bit for bit."""
    _, pre = _build("attention-prefill", {"seq": 64, "q_heads": 4, "kv_heads": 2, "head_dim": 64})
    pin = pre.make_inputs(3)
    k_pf = np.asarray(_run(pre, pin)["k_cache"])[:, :64]  # [B*G*D, 64]
    for p in (40, 63):
        _, app = _build("kv-append", {"batch": 1, "context": p + 1, "kv_heads": 2, "head_dim": 64})
        ins = app.make_inputs(0)
        ins["k_cache"][:, :p] = k_pf[:, :p]  # the prior context as prefill wrote it
        ins["k_new"] = np.asarray(pin["k"])[:, p].reshape(1, 2 * 64)  # token p's un-rotated key
        ins["rope_cos"], ins["rope_sin"] = pin["rope_cos"][p:p + 1], pin["rope_sin"][p:p + 1]
        got = _run(app, ins)["k_cache"]
        np.testing.assert_array_equal(_bits(got[:, :p + 1]), _bits(k_pf[:, :p + 1]))


def test_kv_append_then_attention_decode():
    """decode reads the appended token where kv-append wrote it, and its output matches decode's
    reference on the appended cache."""
    common = {"batch": 2, "context": 40, "kv_heads": 2, "head_dim": 64}
    dshape, dec = _build("attention-decode", {**common, "q_heads": 4})
    _, app = _build("kv-append", common)
    din = dec.make_inputs(5)
    ins = app.make_inputs(6)
    ins.update(k_cache=din["k_cache"], v_cache=din["v_cache"],
               rope_cos=din["rope_cos"][39:40], rope_sin=din["rope_sin"][39:40])
    appended = _run(app, ins)
    din.update(appended)
    kt, v = decode_logical_cache(din, dshape)  # [B, G, D, cap], [B, G, cap, D]
    k_new = np.asarray(ins["k_new"], np.float32).reshape(2, 2, 64)
    np.testing.assert_array_equal(kt[..., 39], rope_rotate_half(k_new, ins["rope_cos"], ins["rope_sin"]))
    np.testing.assert_array_equal(v[:, :, 39], np.asarray(ins["v_new"], np.float32).reshape(2, 2, 64))
    # Every other token is untouched.
    before_kt, before_v = decode_logical_cache(dec.make_inputs(5), dshape)
    np.testing.assert_array_equal(np.delete(kt, 39, axis=3), np.delete(before_kt, 39, axis=3))
    np.testing.assert_array_equal(np.delete(v, 39, axis=2), np.delete(before_v, 39, axis=2))
    out = _run(dec, din)["out"]
    want = dec.reference(din)["out"]
    tol = dec.tolerance
    assert np.all(np.abs(np.asarray(out, np.float64) - want) <= tol.atol + tol.rtol * np.abs(want))


@pytest.mark.parametrize("context", [1, 32, 40, 8192])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8e4"])
def test_kv_append_cache_allocations_are_attention_decodes(context, kv_dtype):
    common = {"batch": 3, "context": context, "kv_heads": 2, "head_dim": 64, "kv_dtype": kv_dtype}
    spec = load_preset("jalapeno-v1")
    _, dec = _build("attention-decode", {**common, "q_heads": 4}, spec)
    _, app = _build("kv-append", common, spec)
    dt, at = (dict(dict(b.program.meta)["tensors"]) for b in (dec, app))
    names = [n for n in dt if n.startswith(("k_cache", "v_cache"))]
    assert len(names) == (4 if kv_dtype == "fp8e4" else 2)
    assert all(at[n] == dt[n] for n in names)


# --- kv-append, MXFP8 ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [
    {},  # row 7 of a block: seven earlier tokens re-quantised with the new one
    {"context": 1},  # a fresh block
    {"context": 64, "batch": 3, "kv_heads": 3},  # the block's last row; two jobs (accumulators)
])
def test_kv_append_fp8_is_bit_exact_on_every_byte(shape):
    r = run_kernel("kv-append", {**shape, "kv_dtype": "fp8e4"}, check=True)
    assert r.check["passed"] and r.check["max_abs_error"] == 0.0, r.check
    assert set(r.check["outputs"]) == {"k_cache", "k_cache.scales", "v_cache", "v_cache.scales"}
    assert r.notes["v_code_stores"] == r.notes["items"] * (r.notes["block_row"] + 1)
    if shape.get("batch") == 3:
        assert r.notes["jobs_per_core"] == 2


def _fp8_append(scale_v_new: float, context: int = 40):
    """(decode shape, logical K^T and V before, after, the kv-append inputs) for an fp8 append of
    v_new * scale_v_new onto attention-decode's random MXFP8 cache."""
    common = {"batch": 2, "context": context, "kv_heads": 2, "head_dim": 64, "kv_dtype": "fp8e4"}
    dshape, dec = _build("attention-decode", {**common, "q_heads": 4})
    _, app = _build("kv-append", common)
    din = dec.make_inputs(7)
    ins = app.make_inputs(8)
    ins["v_new"] = (np.asarray(ins["v_new"], np.float32) * scale_v_new).astype(BF16)
    # The slots of the new token's block from the new token on hold no token yet: zero, and the
    # block's scales those of its tokens (as kv-append leaves a block).
    items, cap, blk, j = 4, -(-context // 32) * 32, (context - 1) // 32, (context - 1) % 32
    vals = np.array(mx.dequantize(mx.MXArray(codes=jnp.asarray(din["v_cache"]), fmt="e4m3", axis=0,
                                             scales=jnp.asarray(din["v_cache.scales"]), block_size=32)))
    vals = vals.reshape(items, cap, 64)
    vals[:, blk * 32 + j:(blk + 1) * 32] = 0
    vq = mx.quantize(jnp.asarray(vals.reshape(items * cap, 64)), "e4m3", axis=0)
    din["v_cache"], din["v_cache.scales"] = np.asarray(vq.codes), np.asarray(vq.scales)
    for name in ("k_cache", "k_cache.scales", "v_cache", "v_cache.scales"):
        ins[name] = din[name]
    ins.update(rope_cos=din["rope_cos"][context - 1:context], rope_sin=din["rope_sin"][context - 1:context])
    before = decode_logical_cache(din, dshape)
    after_in = dict(din, **_run(app, ins))
    return dshape, dec, before, decode_logical_cache(after_in, dshape), ins, after_in


def test_kv_append_fp8_keeps_earlier_tokens_unless_the_scale_rises():
    # A small new value: every earlier token of the block keeps its value exactly.
    _, _, (kt0, v0), (kt1, v1), ins, _ = _fp8_append(1 / 64)
    np.testing.assert_array_equal(v1[:, :, :39], v0[:, :, :39])
    np.testing.assert_array_equal(np.delete(kt1, 39, axis=3), np.delete(kt0, 39, axis=3))
    v_new = np.asarray(ins["v_new"], np.float32).reshape(2, 2, 64)
    # The new value and key within MXFP8 rounding at their blocks' scales: 3 mantissa bits (2^-4
    # relative), but the OCP floor scale clips a block's largest value in [448, 512) x scale to
    # 448 x scale (up to 2^-3 relative); 2^-9 of the block's largest value below E4M3's normals.
    block_max = np.abs(v1[:, :, 32:40]).max(axis=2)
    assert np.all(np.abs(v1[:, :, 39] - v_new) <= np.maximum(2.0**-3 * np.abs(v_new), 2.0**-9 * block_max))
    k_rot = rope_rotate_half(np.asarray(ins["k_new"], np.float32).reshape(2, 2, 64), ins["rope_cos"],
                             ins["rope_sin"])
    assert np.all(np.abs(kt1[..., 39] - k_rot) <= 2.0**-3 * np.abs(k_rot) + 2.0**-9 * np.abs(k_rot).max())
    # A large one raises each column's scale: the earlier tokens of its block are rounded to it,
    # other blocks are untouched.
    _, _, (_, v0), (_, v1), ins, _ = _fp8_append(256.0)
    np.testing.assert_array_equal(v1[:, :, :32], v0[:, :, :32])
    assert not np.array_equal(v1[:, :, 32:39], v0[:, :, 32:39])
    # each column's new scale: code spacing 2^floor(log2 max) / 8 at the top, finer below
    step = 2.0 ** np.floor(np.log2(np.abs(v1[:, :, 32:40]).max(axis=2))) / 8
    assert np.all(np.abs(v1[:, :, 32:39] - v0[:, :, 32:39]) <= step[:, :, None] / 2)


def test_kv_append_fp8_then_attention_decode():
    _, dec, _, _, _, din = _fp8_append(1.0)
    got = np.asarray(_run(dec, din)["out"], np.float64)
    want = dec.reference(din)["out"]
    tol = dec.tolerance
    assert np.all(np.abs(got - want) <= tol.atol + tol.rtol * np.abs(want))


# --- mla-append ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [
    {},
    {"batch": 3, "q_heads": 5, "context": 7, "nope_dim": 16, "rope_dim": 6, "kv_lora_rank": 40},
    {"batch": 40, "context": 3, "q_heads": 16, "nope_dim": 128, "rope_dim": 64, "kv_lora_rank": 512},
    # a chunk of 3 at positions 4..6; a core's rows cross a sequence and a job boundary mid-token
    {"batch": 3, "tokens": 3, "q_heads": 5, "context": 7, "nope_dim": 16, "rope_dim": 6, "kv_lora_rank": 40},
    {"tokens": 32, "context": 40},  # a core per sequence: 32 positions, 32 query blocks each
    {"batch": 3, "context": 33, "q_heads": 4},  # row 32 of each sequence's 64 (mla-decode's cap)
    {"batch": 3, "tokens": 5, "context": 40, "capacity": 96, "q_heads": 2},  # rows 35..39 of 96
])
def test_mla_append_is_bit_exact_on_every_byte(shape):
    r = run_kernel("mla-append", shape, check=True)
    assert r.check["passed"] and r.check["max_abs_error"] == 0.0, r.check
    if shape.get("batch") == 40:
        assert r.notes["jobs_per_core"] > 1  # 320 query rows per core do not fit tiny's scratchpad


def test_mla_append_rope_table_rows_per_core_follow_its_tokens():
    """3 sequences of a 5-token chunk over 8 cores, 2 tokens each: core 2 holds the last token of
    sequence 0 and the first of sequence 1 (positions 8 and 4 of a 9-token context), so its two
    table rows come from both ends of the table; every byte still exact."""
    spec = TINY.replace(**{"core.count": 8})
    r = run_kernel("mla-append", {"batch": 3, "tokens": 5, "context": 9, "q_heads": 2}, preset=spec,
                   check=True)
    assert r.check["passed"] and r.check["max_abs_error"] == 0.0, r.check
    prog = r.build.program
    cos = prog.allocation("rope_cos")
    table_loads = {}  # core -> [(first table row, rows)]
    for ins in prog.instructions:
        src = ins.arg("src") if ins.mnemonic == "dma.load" else None
        if src is not None and cos.offset <= src.offset < cos.end:
            row = (src.offset - cos.offset) // src.stride
            table_loads.setdefault(ins.engine.core, []).append((row, src.rows))
    assert r.notes["rope_table_rows"] == 2 and len(table_loads) == 8
    assert table_loads[2] == [(4, 1), (0, 1)]  # wraps: position 8 (table row 4), then 4 (row 0)
    assert table_loads[0] == [(0, 2)] and table_loads[3] == [(1, 2)] and table_loads[7] == [(4, 1)]


def _vector_count(program, core):
    return sum(1 for i in program.instructions if i.engine.core == core and i.mnemonic.startswith("vec."))


def test_mla_append_one_token_is_the_decode_program():
    """tokens=1 (the default): per core and job, one de-interleave pair and one rotation for all
    query rows and one for all latent rows (one position), the latent rows stored with one DMA
    every cap-th row (context 50: cap 64), whole query rows stored after the rotation."""
    shape = {"batch": 3, "context": 50, "q_heads": 4}
    full, b = _build("mla-append", shape)
    assert full["tokens"] == 1 and b.program.name == "mla_append_b3_c50_h4_cap64"
    assert b.notes["jobs_per_core"] == 1 and b.notes["rope_table_rows"] == 1
    assert [_vector_count(b.program, c) for c in range(2)] == [2 * (2 + 6)] * 2
    stores = [i.arg("dst") for i in b.program.instructions if i.mnemonic == "dma.store"]
    wk, wq = 64 + 32, 32 + 32
    cache_stores = [t for t in stores if t.cols == wk]
    assert [(t.rows, t.stride) for t in cache_stores] == [(2, 64 * wk * 2), (1, 64 * wk * 2)]
    cache = b.program.allocation("kv_cache")
    assert [(t.offset - cache.offset) // (wk * 2) for t in cache_stores] == [49, 2 * 64 + 49]
    assert [(t.rows, t.cols) for t in stores if t.cols != wk] == [(6, wq), (6, wq)]
    # The full-size decode step: 64 cores x 32 instructions (4 for the tables, 28 for the job).
    dec = run_kernel("mla-append", dict(batch=64, context=8192, q_heads=128, nope_dim=128, rope_dim=64,
                                        kv_lora_rank=512), preset="jalapeno-v1", safety_checks=False)
    assert dec.summary["instructions"] == 64 * 32


def test_mla_append_chunk_rotates_per_token_blocks():
    """A chunk: six vector instructions per token of query rows ([q_heads, P/2] blocks, one table
    row broadcast) and six per run of a sequence's latent rows (one table row each), after one
    de-interleave pair per part and job; the query rows' nope part goes back before the rotation."""
    _, b = _build("mla-append", {"batch": 2, "tokens": 32, "context": 40})  # a sequence per core
    assert b.notes["jobs_per_core"] == 2 and b.notes["rope_table_rows"] == 32
    per_core = 2 * (2 + 6 * 16) + 2 * (2 + 6)  # per job: 16 tokens of query rows, 16 latent rows
    assert [_vector_count(b.program, c) for c in range(2)] == [per_core] * 2
    assert b.notes["vector_instructions"] == 2 * per_core
    stores = [i.arg("dst") for i in b.program.instructions if i.mnemonic == "dma.store"]
    # per job: q_rot's nope [128, 32] (as loaded) and rope [128, 32] parts, 16 cache rows in one DMA
    assert sorted((t.rows, t.cols, t.stride) for t in stores) == sorted([(128, 32, 128), (128, 32, 128),
                                                                         (16, 96, 192)] * 4)


def _hf_deepseek_rope(x, cos_half, sin_half):
    """HF modeling_deepseek apply_rotary_pos_emb in float64: view (d/2, 2), transpose, reshape,
    then x*cos + rotate_half(x)*sin with the full-width [cos | cos] tables."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    x = x.reshape(*x.shape[:-1], d // 2, 2).swapaxes(-1, -2).reshape(x.shape)
    cos = np.concatenate([cos_half, cos_half], axis=-1).astype(np.float64)
    sin = np.concatenate([sin_half, sin_half], axis=-1).astype(np.float64)
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * cos + rot * sin


def test_mla_rope_is_hf_deepseek_and_preserves_scores():
    rng = np.random.default_rng(0)
    cos, sin = deepseek_yarn_cos_sin(3000, 64)
    q = rng.standard_normal((4, 64)).astype(BF16)
    k = rng.standard_normal((4, 64)).astype(BF16)
    m, n = 2999, 1234
    got = rope_deinterleaved(q, cos[m], sin[m])
    want = _hf_deepseek_rope(q, cos[m], sin[m])
    np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=1e-6)  # one BF16 rounding apart
    # Scores depend only on the distance (de-interleaved storage keeps q.k): (m, n) vs (m-n, 0).
    def score(a, b):
        return np.sum(_hf_deepseek_rope(q, cos[a], sin[a]) * _hf_deepseek_rope(k, cos[b], sin[b]), axis=-1)

    np.testing.assert_allclose(score(m, n), score(m - n, 0), rtol=1e-5, atol=1e-5)


def test_mla_append_then_mla_decode():
    dims = {"batch": 2, "context": 64, "q_heads": 8, "nope_dim": 32, "rope_dim": 32, "kv_lora_rank": 64}
    dshape, dec = _build("mla-decode", dims)
    _, app = _build("mla-append", dims)
    din, ins = dec.make_inputs(2), app.make_inputs(3)
    ins["kv_cache"] = din["kv_cache"]
    out = _run(app, ins)
    # the row mla-decode reads at position 63 of each sequence is [c_kv | rope(k_pe)]
    kv_a = np.asarray(ins["kv_a"], np.float32)
    rows = np.asarray(out["kv_cache"], np.float32)[[63, 127]]
    np.testing.assert_array_equal(rows[:, :64], kv_a[:, :64])
    rotated = rope_deinterleaved(kv_a[:, 64:], ins["rope_cos"], ins["rope_sin"])
    np.testing.assert_array_equal(rows[:, 64:], rotated)
    din.update(q=out["q_rot"], kv_cache=out["kv_cache"])
    got = np.asarray(_run(dec, din)["out"], np.float64)
    want = np.asarray(mla_decode_reference(din["q"], din["kv_cache"], din["w_kv_b"], batch=2, context=64,
                                           heads=8, rank=64, rope=32, nope=32, v=dshape["v_head_dim"],
                                           scale=1 / math.sqrt(64)), np.float64)
    tol = dec.tolerance
    assert np.all(np.abs(got - want) <= tol.atol + tol.rtol * np.abs(want))


def _within(got, want, tol):
    """Every element of ``got`` within the kernel tolerance ``tol`` of ``want``."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return bool(np.all(np.abs(got - want) <= tol.atol + tol.rtol * np.abs(want)))


def _naive_decode(q, rows, w_kv_b, heads, nope, v, scale):
    """Decompress-then-attend in float64 over ``rows`` [B, context, R+P] (the real rows only)."""
    q, rows, w = (np.asarray(x, np.float64) for x in (q, rows, w_kv_b))
    b, _, width = rows.shape
    rank = w.shape[1]
    w = w.reshape(heads, nope + v, rank)
    k_pe = np.broadcast_to(rows[:, None, :, rank:], (b, heads, rows.shape[1], width - rank))
    k = np.concatenate([np.einsum("bcr,hnr->bhcn", rows[..., :rank], w[:, :nope]), k_pe], -1)
    s = np.einsum("bhd,bhcd->bhc", q.reshape(b, heads, -1), k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    vals = np.einsum("bcr,hvr->bhcv", rows[..., :rank], w[:, nope:])
    return np.einsum("bhc,bhcv->bhv", p / p.sum(-1, keepdims=True), vals).reshape(b * heads, v)


def test_mla_append_at_33_then_mla_decode_at_33():
    """Context 33 (not a multiple of 32): with the default capacity both kernels use 64 rows per
    sequence; mla-append writes row b*64 + 32 and leaves every other byte, the padding rows 33..63
    (+-1e4 garbage) included; mla-decode at 33 reads what it wrote and ignores the padding."""
    B, H = 3, 4
    dims = {"batch": B, "context": 33, "q_heads": H, "nope_dim": 32, "rope_dim": 32, "kv_lora_rank": 64}
    dshape, dec = _build("mla-decode", dims)
    _, app = _build("mla-append", dims)
    assert dec.notes["cache_capacity"] == app.notes["cache_capacity"] == 64
    din, ins = dec.make_inputs(2), app.make_inputs(3)
    ins["kv_cache"] = din["kv_cache"]
    out = _run(app, ins)
    before = np.asarray(din["kv_cache"]).reshape(B, 64, 96)
    after = np.asarray(out["kv_cache"]).reshape(B, 64, 96)
    kv_a = np.asarray(ins["kv_a"], np.float32)
    rotated = rope_deinterleaved(kv_a[:, 64:], ins["rope_cos"], ins["rope_sin"])
    np.testing.assert_array_equal(_bits(after[:, 32]), _bits(np.concatenate([kv_a[:, :64], rotated], -1)))
    np.testing.assert_array_equal(_bits(np.delete(after, 32, 1)), _bits(np.delete(before, 32, 1)))
    assert np.all(np.abs(after[:, 33:].astype(np.float32)) > 5e3)  # the padding is still garbage
    din.update(q=out["q_rot"], kv_cache=out["kv_cache"])
    got = _run(dec, din)["out"]
    scale = dec.notes["softmax_scale"]
    ref = dict(batch=B, context=33, heads=H, rank=64, rope=32, nope=32, v=dshape["v_head_dim"], scale=scale)
    assert _within(got, mla_decode_reference(din["q"], din["kv_cache"], din["w_kv_b"], **ref), dec.tolerance)
    naive = _naive_decode(din["q"], after[:, :33], din["w_kv_b"], H, 32, dshape["v_head_dim"], scale)
    np.testing.assert_allclose(np.asarray(got, np.float64), naive, atol=0.02, rtol=0.02)


def test_mla_prefill_append_decode_chain_in_one_padded_cache():
    """One latent cache of capacity 64 per sequence, +-1e4 garbage wherever nothing was written:
    mla-append of a 32-token chunk, mla-prefill (prior 0, seq 32) on it, then mla-append at
    context 33, mla-decode at 33, mla-append at 34, mla-decode at 34. Each append writes exactly
    its rows, bit for bit the independently rotated ones; prefill and the decodes match their
    references within tolerance and decompress-then-attend in float64 over the real rows."""
    B, H, R, P, N, V, CAP = 2, 2, 64, 32, 32, 32, 64
    dims = {"batch": B, "q_heads": H, "nope_dim": N, "rope_dim": P, "kv_lora_rank": R, "capacity": CAP}
    rng = np.random.default_rng(21)
    q = rng.standard_normal((B, 34, H, N + P)).astype(BF16)  # the queries of positions 0..33
    kv_a = rng.standard_normal((B, 34, R + P)).astype(BF16)
    w = (rng.standard_normal((H * (N + V), R)) / math.sqrt(R)).astype(BF16)
    cos, sin = deepseek_yarn_cos_sin(34, P)
    want_rows = np.concatenate([kv_a[..., :R].astype(np.float32),
                                rope_deinterleaved(kv_a[..., R:], cos[None], sin[None])], -1).astype(BF16)
    want_q = np.concatenate([q[..., :N].astype(np.float32),
                             rope_deinterleaved(q[..., N:], cos[None, :, None], sin[None, :, None])], axis=-1)
    cache = (1e4 * rng.choice((-1.0, 1.0), size=(B, CAP, R + P))).astype(BF16)
    ref = dict(batch=B, heads=H, rank=R, rope=P, nope=N, v=V, capacity=CAP)
    for ctx, new in ((32, 32), (33, 1), (34, 1)):  # the prefill chunk, then two decode steps
        pos = slice(ctx - new, ctx)
        q_rot, filled = _append_chunk(q[:, pos].reshape(B * new * H, -1), kv_a[:, pos].reshape(B * new, -1),
                                      cache.reshape(B * CAP, -1), context=ctx, tokens=new, dims=dims)
        filled = filled.reshape(B, CAP, -1)
        np.testing.assert_array_equal(_bits(filled[:, pos]), _bits(want_rows[:, pos]))
        np.testing.assert_array_equal(_bits(np.delete(filled, pos, 1)), _bits(np.delete(cache, pos, 1)))
        np.testing.assert_array_equal(_bits(q_rot), _bits(want_q[:, pos].reshape(B * new * H, -1)))
        cache = filled
        kind, keys = ("mla-prefill", {"seq": new}) if new > 1 else ("mla-decode", {"context": ctx})
        _, att = _build(kind, {**dims, **keys})
        ins = dict(att.make_inputs(0), q=q_rot, kv_cache=cache.reshape(B * CAP, -1), w_kv_b=w)
        got = _run(att, ins)["out"]
        scale = att.notes["softmax_scale"]
        if new > 1:
            want = mla_prefill_reference(q_rot, ins["kv_cache"], w, seq=new, scale=scale, **ref)
        else:
            want = mla_decode_reference(q_rot, ins["kv_cache"], w, context=ctx, scale=scale, **ref)
            naive = _naive_decode(q_rot, want_rows[:, :ctx], w, H, N, V, scale)
            np.testing.assert_allclose(np.asarray(got, np.float64), naive, atol=0.02, rtol=0.02)
        assert _within(got, want, att.tolerance), (kind, ctx)
    assert np.all(np.abs(cache[:, 34:].astype(np.float32)) > 5e3)  # never written: still garbage


def _append_chunk(q, kv_a, cache, *, context, tokens, dims):
    """Run mla-append of a chunk (positions context-tokens..context-1) onto ``cache``."""
    _, app = _build("mla-append", {**dims, "context": context, "tokens": tokens})
    cos, sin = deepseek_yarn_cos_sin(context, dims["rope_dim"])
    ins = {"q": q, "kv_a": kv_a, "kv_cache": cache, "rope_cos": cos[context - tokens:],
           "rope_sin": sin[context - tokens:]}
    out = _run(app, ins)
    return np.asarray(out["q_rot"]), np.asarray(out["kv_cache"])


def test_mla_append_chunks_then_mla_prefill():
    """Chunked MLA prefill: mla-append of a 32-token chunk, then mla-prefill (prior 0, seq 32) on
    the filled cache; then the next chunk (context 64) and mla-prefill with prior 32. The cache
    rows are [c_kv | rope(k_pe)] at each token's own position and q_rot is rope(q_pe) there (HF
    DeepSeek's table, independently indexed), the chunked cache is byte for byte the one a single
    64-token append writes, and prefill's output matches its reference on it."""
    B, S, H, R, P, N = 1, 32, 2, 64, 32, 32  # small: mla-prefill's functional run dominates
    dims = {"batch": B, "q_heads": H, "nope_dim": N, "rope_dim": P, "kv_lora_rank": R}
    rng = np.random.default_rng(11)
    q = rng.standard_normal((B, 2 * S, H, N + P)).astype(BF16)  # both chunks' queries
    kv_a = rng.standard_normal((B, 2 * S, R + P)).astype(BF16)
    cos, sin = deepseek_yarn_cos_sin(2 * S, P)
    want_rows = np.concatenate([kv_a[..., :R].astype(np.float32),
                                rope_deinterleaved(kv_a[..., R:], cos[None], sin[None])], axis=-1)
    want_q = np.concatenate([q[..., :N].astype(np.float32),
                             rope_deinterleaved(q[..., N:], cos[None, :, None], sin[None, :, None])], axis=-1)
    cache = rng.standard_normal((B, 2 * S, R + P)).astype(BF16)  # rows not yet written: garbage
    for k in range(2):  # chunk k: positions k*S .. (k+1)*S-1, cache of context (k+1)*S
        ctx = (k + 1) * S
        chunk = slice(k * S, ctx)
        q_rot, filled = _append_chunk(q[:, chunk].reshape(B * S * H, -1), kv_a[:, chunk].reshape(B * S, -1),
                                      cache[:, :ctx].reshape(B * ctx, -1), context=ctx, tokens=S, dims=dims)
        filled = filled.reshape(B, ctx, -1)
        np.testing.assert_array_equal(_bits(filled[:, chunk]), _bits(want_rows[:, chunk]))
        np.testing.assert_array_equal(_bits(filled[:, :k * S]), _bits(cache[:, :k * S]))  # prior untouched
        np.testing.assert_array_equal(_bits(q_rot), _bits(want_q[:, chunk].reshape(B * S * H, -1)))
        cache[:, :ctx] = filled
        pshape, pre = _build("mla-prefill", {**dims, "seq": S, "prior": k * S})
        pin = pre.make_inputs(k)
        pin.update(q=q_rot, kv_cache=filled.reshape(B * ctx, -1))
        got = np.asarray(_run(pre, pin)["out"], np.float64)
        want = np.asarray(mla_prefill_reference(q_rot, pin["kv_cache"], pin["w_kv_b"], batch=B, seq=S,
                                                prior=k * S, heads=H, rank=R, rope=P, nope=N,
                                                v=pshape["v_head_dim"], scale=pre.notes["softmax_scale"]),
                          np.float64)
        tol = pre.tolerance
        assert np.all(np.abs(got - want) <= tol.atol + tol.rtol * np.abs(want))
    # The same 64 tokens appended in one go write the same cache bytes.
    garbage = rng.standard_normal((B * 2 * S, R + P)).astype(BF16)
    _, whole = _append_chunk(q.reshape(B * 2 * S * H, -1), kv_a.reshape(B * 2 * S, -1), garbage,
                             context=2 * S, tokens=2 * S, dims=dims)
    np.testing.assert_array_equal(_bits(whole), _bits(cache.reshape(B * 2 * S, -1)))


def test_deepseek_yarn_tables():
    cos, sin = deepseek_yarn_cos_sin(5000, 64)
    np.testing.assert_allclose(cos**2 + sin**2, 1.0, rtol=1e-6)  # mscale/mscale_all_dim = 1
    inv_freq = np.arctan2(sin[1], cos[1]).astype(np.float64)
    base = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    # Correction range for theta 1e4, 4096 original positions, 64 dims: floor(10.47), ceil(22.5).
    np.testing.assert_allclose(inv_freq[:11], base[:11], rtol=1e-5)  # ramp 0: extrapolated
    np.testing.assert_allclose(inv_freq[23:], base[23:] / 40, rtol=1e-4)  # ramp 1: interpolated
    mid = (16 - 10) / (23 - 10)
    assert inv_freq[16] == pytest.approx(base[16] / 40 * mid + base[16] * (1 - mid), rel=1e-5)
    # HF's default mscale_all_dim is 0: then cos/sin carry the full 0.1*ln(factor) + 1.
    cfg = {k: v for k, v in YARN_DEEPSEEK_V3.items() if k != "mscale_all_dim"}
    c2, s2 = deepseek_yarn_cos_sin(4, 64, cfg)
    np.testing.assert_allclose(np.hypot(c2, s2), 0.1 * math.log(40) + 1, rtol=1e-6)
    # factor 1 (no scaling) is plain RoPE.
    c3, s3 = deepseek_yarn_cos_sin(3, 8, {"rope_theta": 50000.0, "factor": 1.0})
    np.testing.assert_allclose(np.arctan2(s3[1], c3[1]), 50000.0 ** (-np.arange(0, 8, 2) / 8), rtol=1e-6)
    with pytest.raises(InvalidArgumentError, match="rope_dim=7"):
        deepseek_yarn_cos_sin(4, 7)


def test_kv_append_reference_matches_gpt_oss_rope_table_rows():
    """kv_append_reference rotates with the given row: at position 0 (angle 0) the key is only
    scaled by the concentration factor, rounded to BF16."""
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 64)).astype(BF16)
    cos, sin = yarn_cos_sin(1, 64)
    kc, vc = kv_append_reference(k, k, cos, sin, np.zeros((64, 160), BF16), np.zeros((32, 64), BF16),
                                 batch=1, context=1, kv_heads=1, head_dim=64)
    conc = 0.1 * math.log(32) + 1
    scaled = (k.astype(np.float32)[0] * np.float32(conc)).astype(BF16)
    np.testing.assert_array_equal(_bits(kc[:, 0]), _bits(scaled))
    assert not np.any(kc[:, 1:].astype(np.float32)) and not np.any(vc[1:].astype(np.float32))


# --- refusals and timing --------------------------------------------------------------------------
@pytest.mark.parametrize("name, shape, match", [
    ("kv-append", {"head_dim": 48}, "head_dim=48"),
    ("kv-append", {"context": 0}, "context=0"),
    ("kv-append", {"batch": 0}, "batch=0"),
    ("kv-append", {"kv_dtype": "fp4"}, "kv_dtype='fp4'"),
    ("kv-append", {"kv_dtype": "fp8e4", "head_dim": 2048}, "head_dim=2048"),
    ("kv-append", {"head_dim": 32768}, "head_dim=32768"),
    ("mla-append", {"rope_dim": 33}, "rope_dim=33"),
    ("mla-append", {"context": 0}, "context=0"),
    ("mla-append", {"kv_lora_rank": 200_000}, "kv_lora_rank=200000"),
    ("mla-append", {"tokens": 0}, "tokens=0"),
    ("mla-append", {"tokens": 97}, "tokens=97"),  # more new tokens than the context holds
    ("mla-append", {"context": 40, "capacity": 48}, "capacity=48 must be a multiple of 32"),
    ("mla-append", {"context": 40, "capacity": 32}, "capacity=32 must be a multiple of 32 and >= context=40"),
    # 2048 tokens per core: their RoPE table rows alone fill tiny's scratchpad
    ("mla-append", {"batch": 1, "q_heads": 1, "tokens": 4096, "context": 4096}, "tokens=4096"),
])
def test_impossible_shapes_are_refused(name, shape, match):
    with pytest.raises(InvalidArgumentError, match=match):
        run_kernel(name, shape)


def test_full_size_timing_is_latency_bound():
    """gpt-oss-120b (batch 64, 8k context; BF16 and MXFP8 caches) and DeepSeek-R1 (batch 64, 128
    heads) on jalapeno-v1, timing only: each byte moved once, microseconds of DMA round trips."""
    kv = run_kernel("kv-append", dict(batch=64, context=8192, kv_heads=8, head_dim=64),
                    preset="jalapeno-v1", safety_checks=False)
    items, cores = 64 * 8, 64
    assert kv.summary["hbm_bytes"] == 4 * items * 64 * 2 + cores * 2 * 32 * 4  # k, v in and out; cos, sin
    mla = run_kernel("mla-append", dict(batch=64, context=8192, q_heads=128, nope_dim=128, rope_dim=64,
                                        kv_lora_rank=512), preset="jalapeno-v1", safety_checks=False)
    assert mla.summary["hbm_bytes"] == 2 * 2 * (64 * 128 * 192 + 64 * 576) + cores * 2 * 32 * 4
    fp8 = run_kernel("kv-append", dict(batch=64, context=8192, kv_heads=8, head_dim=64, kv_dtype="fp8e4"),
                     preset="jalapeno-v1", safety_checks=False)
    # worst case: the block's last row, so 32 token rows of codes go back per (sequence, KV head)
    assert fp8.notes["block_row"] == 31 and fp8.notes["v_code_stores"] == items * 32
    for r in (kv, mla, fp8):
        s = r.summary
        assert r.notes["cores"] == 64 and r.notes["jobs_per_core"] == 1
        assert s["bound"] == "latency" and s["time_s"] < 20e-6
        # launch + a load and a store round trip (set-up + HBM latency each) is the floor
        spec = load_preset("jalapeno-v1")
        assert s["time_s"] >= spec.sync.kernel_launch_s + 2 * (spec.dma.setup_latency_s + spec.hbm.latency_s)


def test_mla_append_prefill_chunk_full_size_is_hbm_bound():
    """DeepSeek-R1's 2048-token prefill chunk (batch 1, context 8192) on jalapeno-v1, timing only:
    q in and q_rot out once, the chunk's latent rows, 32 table rows per core; six vector
    instructions per token of query rows; the nope part's store overlaps the rotation and the
    second job's load the first's stores, so the HBM stream sets the time."""
    dims = dict(q_heads=128, nope_dim=128, rope_dim=64, kv_lora_rank=512)
    r = run_kernel("mla-append", dict(batch=1, tokens=2048, context=8192, **dims), preset="jalapeno-v1",
                   safety_checks=False)
    s, cores = r.summary, 64
    assert r.notes["cores"] == cores and r.notes["rope_table_rows"] == 32 and r.notes["jobs_per_core"] == 2
    assert s["hbm_bytes"] == 2 * 2 * (2048 * 128 * 192 + 2048 * 576) + cores * 2 * 32 * 32 * 4
    # per core and job: 16 tokens of query rows and 16 latent rows (one run), a de-interleave pair each
    assert r.notes["vector_instructions"] == cores * 2 * ((2 + 6 * 16) + (2 + 6))
    assert s["bound"] == "hbm"
    assert s["time_s"] < 1.15 * (s["launch_s"] + s["memory_bound_s"])
