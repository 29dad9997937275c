"""Split-KV mla-decode: each sequence's context split over cores, partial softmax states merged
on chip (flash-decoding's combine in a fixed order). Functional on tiny with forced splits;
the split reference against float64 attention; the full-size DeepSeek-R1 batch-1 timing."""

import math

import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.kernels import get_kernel, run_kernel
from jalapeno_emu.kernels.mla import mla_decode_reference, split_ranges

DEEPSEEK = {"q_heads": 128, "kv_lora_rank": 512, "rope_dim": 64, "nope_dim": 128, "v_head_dim": 128}


@pytest.mark.parametrize("shape, exact", [
    ({"batch": 1, "context": 64, "kv_splits": 2, "kv_tile": 32}, True),  # one tile per split
    # splits of 96 and 128 tokens, three and four tiles (the online rescale inside a split), the
    # last split's last tile padded (200 -> 224), 5 heads on 2 head cores (3 + 2)
    ({"batch": 1, "context": 200, "kv_splits": 2, "kv_tile": 32, "q_heads": 5}, False),
])
def test_split_decode_matches_the_split_reference(shape, exact):
    r = run_kernel("mla-decode", shape, check=True)
    assert r.notes["kv_splits"] == 2 and r.notes["attention_cores"] == 2
    assert r.check["passed"], r.check
    if exact:  # P relative to each split's maximum, merged in the kernel's order: bit for bit
        assert r.check["max_abs_error"] == 0.0


def test_split_reference_is_attention_in_float64():
    """The merge of the partial states (max, sum, output) is the same function as one softmax
    over the whole context: 5 uneven splits of a padded context against float64 attention."""
    B, C, H, R, P, N, V = 2, 150, 4, 64, 32, 32, 32
    kd = get_kernel("mla-decode")
    inputs = kd.build(kd.shape({"batch": B, "context": C, "q_heads": H}), load_preset("tiny")).make_inputs(4)
    assert split_ranges(160, 5) == [(0, 32), (32, 64), (64, 96), (96, 128), (128, 160)]
    q = np.asarray(inputs["q"], np.float64).reshape(B, H, N + P)
    kv = np.asarray(inputs["kv_cache"], np.float64).reshape(B, 160, R + P)[:, :C]
    w = np.asarray(inputs["w_kv_b"], np.float64).reshape(H, N + V, R)
    k = np.concatenate([np.einsum("bcr,hnr->bhcn", kv[..., :R], w[:, :N]),
                        np.broadcast_to(kv[:, None, :, R:], (B, H, C, P))], axis=-1)
    s = np.einsum("bhd,bhcd->bhc", q, k) / math.sqrt(N + P)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhc,bhcv->bhv", p / p.sum(-1, keepdims=True),
                     np.einsum("bcr,hvr->bhcv", kv[..., :R], w[:, N:])).reshape(B * H, V)
    dims = dict(batch=B, context=C, heads=H, rank=R, rope=P, nope=N, v=V, scale=1 / math.sqrt(N + P))
    args = (inputs["q"], inputs["kv_cache"], inputs["w_kv_b"])
    one = np.asarray(mla_decode_reference(*args, **dims), np.float64)
    five = np.asarray(mla_decode_reference(*args, splits=5, **dims), np.float64)
    np.testing.assert_allclose(five, want, atol=0.02, rtol=0.02)
    # the splits round P relative to their own maxima: a few BF16 ulps from the single softmax
    tol = get_kernel("mla-decode").build(get_kernel("mla-decode").shape({}), load_preset("tiny")).tolerance
    assert np.all(np.abs(five - one) <= tol.atol + tol.rtol * np.abs(one))


def test_bad_split_counts_are_refused():
    with pytest.raises(InvalidArgumentError, match=r"kv_splits=3: .* needs 6 cores"):
        run_kernel("mla-decode", {"batch": 2, "kv_splits": 3})
    with pytest.raises(InvalidArgumentError, match=r"kv_splits=2: .*\(context=20 has 1\)"):
        run_kernel("mla-decode", {"batch": 1, "context": 20, "kv_splits": 2})
    with pytest.raises(InvalidArgumentError, match="kv_splits=2: split-KV needs the on-core tiling"):
        run_kernel("mla-decode", {"batch": 1, "context": 64, "kv_splits": 2, **DEEPSEEK})  # tiny: small path


def test_batch_one_splits_over_the_cores_full_size_timing_only():
    """DeepSeek-R1 at batch 1, context 8192 (jalapeno-v1): 64 splits of 128 tokens on 64 cores,
    over 4x faster than a core per sequence, the same HBM bytes (cache, weights once), never below
    the bound; short contexts keep one core per sequence."""
    v1 = load_preset("jalapeno-v1")
    shape = {"batch": 1, "context": 8192, **DEEPSEEK}
    split = run_kernel("mla-decode", shape, preset=v1, safety_checks=False)
    one = run_kernel("mla-decode", dict(shape, kv_splits=1), preset=v1, safety_checks=False)
    assert split.notes["kv_splits"] == 64 and split.notes["attention_cores"] >= 48
    assert split.summary["hbm_bytes"] == one.summary["hbm_bytes"]
    assert split.summary["time_s"] < 0.25 * one.summary["time_s"]
    assert split.summary["time_s"] >= split.summary["lower_bound_s"]
    kd = get_kernel("mla-decode")
    assert kd.build(kd.shape({"batch": 1, "context": 256, **DEEPSEEK}), v1).notes["kv_splits"] == 1
    assert kd.build(kd.shape({"batch": 64, "context": 512, **DEEPSEEK}), v1).notes["kv_splits"] == 1
