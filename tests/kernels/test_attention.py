"""attention-decode / attention-prefill: functional results against the pure-JAX references, the
references against textbook float64 attention, refusals, and full-size timing."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
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


@pytest.mark.parametrize("shape", [{}, {"window": 40, "sinks": False}])
def test_prefill_matches_reference(shape):
    r = _check("attention-prefill", shape)
    assert r.check["outputs"]["k_cache"]["passed"]  # the rotated K^T written for decode
    if shape.get("window"):
        assert r.notes["mask_patterns"] == 3  # diagonal plus two window-edge offsets


def test_prefill_reference_matches_float64_attention():
    kdef = get_kernel("attention-prefill")
    shape = kdef.shape({"seq": 64, "window": 40})
    build = kdef.build(shape, load_preset("tiny"))
    inputs = build.make_inputs(1)
    ref = build.reference(inputs)
    cos, sin = inputs["rope_cos"], inputs["rope_sin"]

    def rope(x):
        h = x.shape[-1] // 2
        return np.concatenate([x[:, :h] * cos - x[:, h:] * sin, x[:, h:] * cos + x[:, :h] * sin], 1)

    q = np.asarray(inputs["q"], np.float64)
    k = np.asarray(inputs["k"], np.float64)  # [G*D, seq]: K^T
    v = np.asarray(inputs["v"], np.float64)
    pos = np.arange(64)
    valid = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 40)
    for h in range(4):
        g = h // 2
        kr = rope(k[g * 64:(g + 1) * 64].T)
        want = naive_attention(rope(q[:, h * 64:(h + 1) * 64]) / 8, kr, v[:, g * 64:(g + 1) * 64], valid,
                               np.repeat(inputs["sinks"][h], 64))
        np.testing.assert_allclose(ref["out"][:, h * 64:(h + 1) * 64], want, atol=1e-2, rtol=2e-2)
        np.testing.assert_allclose(ref["k_cache"][g * 64:(g + 1) * 64].T, kr, atol=2e-2, rtol=1e-2)


def test_yarn_tables_follow_gpt_oss():
    cos, sin = yarn_cos_sin(5000, 64)
    conc = 0.1 * math.log(32) + 1
    np.testing.assert_allclose(cos[0], conc, rtol=1e-7)  # position 0: angle 0, scaled by concentration
    np.testing.assert_allclose(cos**2 + sin**2, conc**2, rtol=1e-5)
    inv_freq = np.arctan2(sin[1], cos[1])
    assert inv_freq[0] == pytest.approx(1.0)  # fastest dims extrapolate: 1/theta^0
    # slowest dim is interpolated: 1/(factor * theta^(62/64))
    assert inv_freq[-1] == pytest.approx(1 / (32 * 150000 ** (62 / 64)), rel=1e-4)
    config = Path("/work/shared/model_configs.json")
    if config.exists():
        hf = json.loads(config.read_text())["openai/gpt-oss-120b"]["hf_config"]
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
