"""attention-decode / attention-prefill: functional results against the pure-JAX references, the
references against textbook float64 attention, refusals, and full-size timing."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

import jalapeno_emu.model
from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.kernels import get_kernel, run_kernel
from jalapeno_emu.kernels.attention import (
    YARN_GPT_OSS,
    decode_logical_cache,
    decode_queries,
    naive_attention,
    yarn_cos_sin,
)

GPT_OSS = dict(q_heads=64, kv_heads=8, head_dim=64)


def _check(name, shape):
    r = run_kernel(name, shape, check=True)
    assert r.check["passed"], r.check
    assert r.summary["time_s"] >= r.summary["lower_bound_s"]
    return r


@pytest.mark.parametrize("shape", [
    {},  # GQA 2:1, sinks, contiguous BF16 cache, two KV tiles per sequence (online softmax)
    {"context": 250, "window": 100, "sinks": False},  # window mask and padded tail
    {"page_size": 32, "q_heads": 8, "kv_heads": 2},  # paged: gathers through the block table
    {"page_size": 64, "kv_dtype": "fp8e4", "window": 100},  # MXFP8 pages, window skips a page
])
def test_decode_matches_reference(shape):
    r = _check("attention-decode", shape)
    assert r.notes["units"] == 2 * r.shape["kv_heads"]


def test_decode_reference_matches_float64_attention():
    """The reference's roundings (BF16 P and output) stay within BF16 noise of exact attention,
    so the kernel == reference check is a check against attention itself."""
    shape = get_kernel("attention-decode").shape({"window": 100})
    build = get_kernel("attention-decode").build(shape, load_preset("tiny"))
    inputs = build.make_inputs(0)
    got = build.reference(inputs)["out"].reshape(2, 4, 64)
    kt, v = decode_logical_cache(inputs, shape)
    q = decode_queries(inputs, shape)
    ctx = shape["context"]
    valid = np.broadcast_to(np.arange(ctx) >= ctx - 100, (2, ctx))
    sinks = np.asarray(inputs["sinks"])[:, 0]
    for b in range(2):
        for g in range(2):
            want = naive_attention(q[b, 2 * g:2 * g + 2], kt[b, g, :, :ctx].T, v[b, g, :ctx], valid,
                                   sinks[2 * g:2 * g + 2])
            np.testing.assert_allclose(got[b, 2 * g:2 * g + 2], want, atol=1e-2, rtol=2e-2)
    # The sink only enlarges the denominator: without it the rows would sum to the plain mean.
    assert np.all(np.abs(got) < np.abs(v).max())


@pytest.mark.parametrize("shape", [
    {},
    {"window": 40, "sinks": False},
    {"prior": 64},  # two tiles of prior context read from the cache before the chunk's own
    {"prior": 100, "seq": 64, "window": 70, "sinks": False},  # unaligned: key tiles straddle prior
    {"prior": 96, "seq": 64, "window": 48, "capacity": 192},  # spare capacity, sinks
])
def test_prefill_matches_reference(shape):
    r = _check("attention-prefill", shape)
    for out in ("k_cache", "v_cache"):  # the chunk's K^T and V written for decode, the rest kept
        assert r.check["outputs"][out]["passed"]
    if shape == {"window": 40, "sinks": False}:
        assert r.notes["mask_patterns"] == 3  # diagonal plus two window-edge offsets
    if shape.get("window") and shape.get("prior"):
        # The window reaches back window-1 keys: the prior context's older tiles are never read.
        kdef = get_kernel("attention-prefill")
        full = kdef.build(kdef.shape(dict(shape, window=0)), load_preset("tiny"))
        assert r.notes["kv_tiles"] < full.notes["kv_tiles"]


@pytest.mark.parametrize("prior", [0, 40])
def test_prefill_reference_matches_float64_attention(prior):
    kdef = get_kernel("attention-prefill")
    shape = kdef.shape({"seq": 64, "window": 40, "prior": prior})
    build = kdef.build(shape, load_preset("tiny"))
    inputs = build.make_inputs(1)
    ref = build.reference(inputs)
    cos, sin = inputs["rope_cos"][prior:], inputs["rope_sin"][prior:]

    def rope(x):
        h = x.shape[-1] // 2
        return np.concatenate([x[:, :h] * cos - x[:, h:] * sin, x[:, h:] * cos + x[:, :h] * sin], 1)

    q = np.asarray(inputs["q"], np.float64)
    k = np.asarray(inputs["k"], np.float64)  # [G*D, seq]: K^T of the chunk, not rotated
    v = np.asarray(inputs["v"], np.float64)
    k_prior = np.asarray(inputs["k_cache"], np.float64)[:, :prior]  # rotated already
    cap = build.notes["cache_capacity"]
    v_prior = np.asarray(inputs["v_cache"], np.float64).reshape(2, cap, 64)[:, :prior]
    qpos, kpos = np.arange(prior, prior + 64), np.arange(prior + 64)
    valid = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - 40)
    for h in range(4):
        g = h // 2
        kr = rope(k[g * 64:(g + 1) * 64].T)
        keys = np.concatenate([k_prior[g * 64:(g + 1) * 64].T, kr])
        values = np.concatenate([v_prior[g], v[:, g * 64:(g + 1) * 64]])
        want = naive_attention(rope(q[:, h * 64:(h + 1) * 64]) / 8, keys, values, valid,
                               np.repeat(inputs["sinks"][h], 64))
        np.testing.assert_allclose(ref["out"][:, h * 64:(h + 1) * 64], want, atol=1e-2, rtol=2e-2)
        kc = ref["k_cache"][g * 64:(g + 1) * 64]
        np.testing.assert_allclose(kc[:, prior:prior + 64].T, kr, atol=2e-2, rtol=1e-2)
        np.testing.assert_array_equal(kc[:, :prior], k_prior[g * 64:(g + 1) * 64])  # prior kept
        np.testing.assert_array_equal(ref["v_cache"].reshape(2, cap, 64)[g, prior:prior + 64],
                                      v[:, g * 64:(g + 1) * 64])


def _run(build, inputs):
    """Functional run of a build: output name -> array, as the kernel left it in HBM."""
    res = run_functional(build.program, inputs)
    return {name: np.asarray(res.read(name, dt, shp)) for name, (dt, shp) in build.outputs.items()}


def _tokens(x, seq, lo, hi):
    """Rows of tokens lo..hi of every sequence of a [batch*seq, cols] array."""
    return np.asarray(x).reshape(-1, seq, x.shape[-1])[:, lo:hi].reshape(-1, x.shape[-1])


def _chunk_inputs(build, whole, seq, lo, hi, k_cache, v_cache):
    """Inputs of a prefill chunk of tokens lo..hi cut from a whole prompt's inputs."""
    ins = build.make_inputs(0)  # its own mask patterns; everything else from the whole prompt
    ins.update(q=_tokens(whole["q"], seq, lo, hi), v=_tokens(whole["v"], seq, lo, hi),
               k=np.asarray(whole["k"])[:, lo:hi], k_cache=k_cache, v_cache=v_cache,
               rope_cos=whole["rope_cos"][:hi], rope_sin=whole["rope_sin"][:hi],
               rope_cos_t=whole["rope_cos_t"][:, :hi], rope_sin_t=whole["rope_sin_t"][:, :hi])
    if "sinks" in whole:
        ins["sinks"] = whole["sinks"]
    return ins


@pytest.mark.parametrize("common", [{}, {"window": 40, "sinks": False}])
def test_chunked_prefill_equals_one_prefill(common):
    """64 tokens at prior 0 (into a cache of capacity 96), then 32 at prior 64: the same outputs
    as one prefill of 96 tokens and exactly the same cache bytes."""
    kdef, spec = get_kernel("attention-prefill"), load_preset("tiny")
    base = dict(batch=2, q_heads=4, kv_heads=2, **common)
    whole = kdef.build(kdef.shape(dict(base, seq=96)), spec)
    first = kdef.build(kdef.shape(dict(base, seq=64, capacity=96)), spec)
    second = kdef.build(kdef.shape(dict(base, seq=32, prior=64)), spec)
    ins = whole.make_inputs(0)
    want = _run(whole, ins)
    got1 = _run(first, _chunk_inputs(first, ins, 96, 0, 64, ins["k_cache"], ins["v_cache"]))
    got2 = _run(second, _chunk_inputs(second, ins, 96, 64, 96, got1["k_cache"], got1["v_cache"]))
    tol = whole.tolerance
    for got, lo, hi in ((got1, 0, 64), (got2, 64, 96)):
        np.testing.assert_allclose(np.asarray(got["out"], np.float32),
                                   np.asarray(_tokens(want["out"], 96, lo, hi), np.float32),
                                   atol=tol.atol, rtol=tol.rtol)
    for cache in ("k_cache", "v_cache"):
        assert got2[cache].tobytes() == want[cache].tobytes()
    # The first chunk left the second chunk's slots as they came in: the second wrote them.
    assert got1["k_cache"].tobytes() != want["k_cache"].tobytes()


@pytest.mark.parametrize("window", [0, 40])
def test_decode_reads_the_cache_prefill_wrote(window):
    """attention-decode at context 96 reads prefill's output caches as they are: its query is the
    last prompt token's, so its output is prefill's last output row (decode walks other KV
    tiles, so P's BF16 roundings differ: within the kernels' tolerance, a BF16 ulp)."""
    spec = load_preset("tiny")
    pk, dk = get_kernel("attention-prefill"), get_kernel("attention-decode")
    common = dict(batch=2, q_heads=4, kv_heads=2, head_dim=64, window=window)
    pre = pk.build(pk.shape(dict(common, seq=96)), spec)
    dec = dk.build(dk.shape(dict(common, context=96)), spec)
    ins = pre.make_inputs(0)
    got = _run(pre, ins)
    dins = dec.make_inputs(0)
    dins.update(q=np.asarray(ins["q"]).reshape(2, 96, 4 * 64)[:, 95].reshape(8, 64),
                k_cache=got["k_cache"], v_cache=got["v_cache"], sinks=ins["sinks"],
                rope_cos=ins["rope_cos"], rope_sin=ins["rope_sin"])
    out = np.asarray(_run(dec, dins)["out"], np.float32)
    want = np.asarray(got["out"], np.float32).reshape(2, 96, 4 * 64)[:, 95].reshape(8, 64)
    np.testing.assert_allclose(out, want, atol=dec.tolerance.atol, rtol=dec.tolerance.rtol)


def test_yarn_tables_follow_gpt_oss():
    cos, sin = yarn_cos_sin(5000, 64)
    conc = 0.1 * math.log(32) + 1
    np.testing.assert_allclose(cos[0], conc, rtol=1e-7)  # position 0: angle 0, scaled by concentration
    np.testing.assert_allclose(cos**2 + sin**2, conc**2, rtol=1e-5)
    inv_freq = np.arctan2(sin[1], cos[1])
    assert inv_freq[0] == pytest.approx(1.0)  # fastest dims extrapolate: 1/theta^0
    # slowest dim is interpolated: 1/(factor * theta^(62/64))
    assert inv_freq[-1] == pytest.approx(1 / (32 * 150000 ** (62 / 64)), rel=1e-4)
    # the packaged copy of https://huggingface.co/openai/gpt-oss-120b config.json
    config = Path(jalapeno_emu.model.__file__).parent / "configs" / "gpt-oss-120b.json"
    hf = json.loads(config.read_text())
    rs = hf["rope_scaling"]
    assert {"rope_theta": hf["rope_theta"], "factor": rs["factor"],
            "original_max_position_embeddings": rs["original_max_position_embeddings"],
            "beta_fast": rs["beta_fast"], "beta_slow": rs["beta_slow"]} == YARN_GPT_OSS


@pytest.mark.parametrize("name, shape, match", [
    ("attention-decode", {"head_dim": 48}, "head_dim=48"),
    ("attention-decode", {"head_dim": 8192}, "head_dim=8192"),
    ("attention-decode", {"q_heads": 6, "kv_heads": 4}, "q_heads=6"),
    ("attention-decode", {"window": -1}, "window=-1"),
    ("attention-decode", {"page_size": 64, "context": 96}, "page_size=64 must divide context=96"),
    ("attention-decode", {"page_size": 48}, "page_size=48"),
    ("attention-decode", {"page_size": -32}, "page_size=-32"),
    ("attention-decode", {"kv_dtype": "fp4"}, "kv_dtype"),
    ("attention-prefill", {"kv_dtype": "fp8e4"}, "kv_dtype"),
    ("attention-prefill", {"seq": 100}, "seq=100"),
    ("attention-prefill", {"q_heads": 3, "kv_heads": 2}, "q_heads=3"),
    ("attention-prefill", {"prior": -1}, "prior=-1"),
    ("attention-prefill", {"capacity": 100}, "capacity=100 must be a multiple of 32"),
    ("attention-prefill", {"prior": 64, "capacity": 160}, "capacity=160 .* >= prior\\+seq=192"),
])
def test_impossible_shapes_are_refused(name, shape, match):
    with pytest.raises(InvalidArgumentError, match=match):
        run_kernel(name, shape)


def test_window_larger_than_context_is_full_attention():
    a = run_kernel("attention-decode", {"window": 10_000}, check=True)
    assert a.check["passed"] and a.notes["masked_tiles"] == 0


def _timed(name, shape):
    """Timing-only at full size: build and time (the safety checker, which run_kernel also runs,
    is proven on the tiny shapes above and takes tens of seconds on 76k instructions)."""
    spec = load_preset("jalapeno-v1")
    kdef = get_kernel(name)
    build = kdef.build(kdef.shape(shape), spec)
    return build, run_timing(build.program, spec).summary()


def test_decode_gpt_oss_batch64_8k_is_hbm_bound():
    build, s = _timed("attention-decode", dict(batch=64, context=8192, **GPT_OSS))
    kv_bytes = 64 * 8 * 8192 * 64 * 2 * 2
    assert kv_bytes <= s["hbm_bytes"] < 1.01 * kv_bytes  # each KV tile read exactly once
    assert s["bound"] == "hbm"
    assert s["hbm_utilization_of_achievable"] >= 0.8
    assert build.notes["cores"] == 64


def test_decode_sliding_window_reads_only_the_window():
    _, s = _timed("attention-decode", dict(batch=64, context=8192, window=128, **GPT_OSS))
    assert s["hbm_bytes"] < 64 * 8 * 160 * 64 * 2 * 2  # 128 keys (+ alignment) per KV head


def test_prefill_full_width_timing_is_vector_bound():
    _, s = _timed("attention-prefill", dict(batch=1, seq=2048, **GPT_OSS))
    assert s["flops"] >= 4 * 64 * 64 * 2048 * 2048 / 2  # causal QK^T and PV
    # The busiest engine is a vector unit (exp at 128 elements/cycle); at seq 2048 it is ~67 % of
    # the time, the rest is pipeline start-up and hand-offs between the units.
    assert s["compute_bound_s"] >= 0.5 * s["time_s"] > s["memory_bound_s"]


def test_prefill_chunk_over_prior_context_timing():
    """A 512-token chunk after 1536 cached tokens (gpt-oss full attention, timing only): every
    query tile reads the whole prior K and V, and the vector unit's softmax still bounds it."""
    _, s = _timed("attention-prefill", dict(batch=1, seq=512, prior=1536, **GPT_OSS))
    assert s["flops"] >= 4 * 64 * 64 * 512 * (1536 + 512 / 2)  # QK^T and PV over prior + causal keys
    assert s["hbm_bytes"] >= 4 * 8 * 1536 * 64 * 2 * 2  # 4 query tiles of 128 x 8 KV heads x prior K, V
    assert s["bound"] == "compute" and s["compute_bound_s"] >= 0.5 * s["time_s"]


def test_prefill_chunk_with_window_reads_only_the_window():
    """gpt-oss sliding layers, the last 2048-token chunk of an 8k prompt: the 128-token window
    reaches one tile back into the 6144 cached tokens, so the chunk moves about the bytes of
    the prompt's first chunk (the whole prior K and V would add 8*6144*64*2*2 B per query tile)."""
    _, first = _timed("attention-prefill", dict(batch=1, seq=2048, window=128, **GPT_OSS))
    _, last = _timed("attention-prefill", dict(batch=1, seq=2048, prior=6144, window=128, **GPT_OSS))
    assert first["hbm_bytes"] <= last["hbm_bytes"] < 1.01 * first["hbm_bytes"]
    assert last["time_s"] < 1.1 * first["time_s"]
