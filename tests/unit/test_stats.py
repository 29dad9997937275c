"""error_stats on hand-computed cases."""

import math

import ml_dtypes
import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.mx.stats import ulp_distance


def test_error_stats_hand_computed():
    ref = np.array([1.0, 2.0, -4.0, 0.0])
    approx = np.array([1.0, 2.5, -3.0, 0.5])
    s = mx.error_stats(approx, ref)
    assert s.count == 4
    assert s.max_abs_error == 1.0
    assert s.max_rel_error == 0.25  # 0.5/2 and 1/4; the zero reference is left out
    assert math.isclose(s.rmse, math.sqrt((0.25 + 1 + 0.25) / 4))
    assert math.isclose(s.snr_db, 10 * math.log10(21 / 1.5))
    cos = (1 + 5 + 12) / (math.sqrt(1 + 6.25 + 9 + 0.25) * math.sqrt(21))
    assert math.isclose(s.cosine_similarity, cos)


def test_perfect_match_has_infinite_snr_and_zero_ulps():
    x = np.linspace(-3, 3, 50, dtype=np.float32)
    s = mx.error_stats(x, x)
    assert s.snr_db == float("inf") and s.max_abs_error == 0 and s.cosine_similarity == 1.0
    assert s.ulp_histogram["0"] == 50 and s.ulp_histogram["nonfinite"] == 0


def test_ulp_distance_counts_across_zero_and_in_bfloat16():
    one = np.float32(1.0)
    nxt = np.nextafter(one, np.float32(2))
    assert ulp_distance(np.array([nxt]), np.array([one]))[0] == 1
    tiny = np.float32(2.0**-149)
    assert ulp_distance(np.array([tiny]), np.array([-tiny]))[0] == 2
    assert ulp_distance(np.array([0.0]), np.array([-0.0]))[0] == 0
    b_next = float(np.nextafter(ml_dtypes.bfloat16(1), ml_dtypes.bfloat16(2)))
    assert ulp_distance(np.array([b_next]), np.array([1.0]), "bfloat16")[0] == 1
    assert ulp_distance(np.array([np.nan]), np.array([1.0]))[0] == -1


def test_histogram_buckets_are_powers_of_two():
    ref = np.ones(6, np.float32)
    bits = ref.view(np.int32) + np.array([0, 1, 2, 3, 5, 9], np.int32)
    s = mx.error_stats(bits.view(np.float32), ref)
    assert s.ulp_histogram == {"0": 1, "1": 1, "2": 1, "3-4": 1, "5-8": 1, "9-16": 1,
                               "nonfinite": 0}


def test_mxfp4_error_is_within_half_a_grid_step():
    """Every in-range MXFP4 value is within half the E2M1 spacing at its magnitude (<= 1/4 of 2^s)."""
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    q = mx.quantize(x, "e2m1", scale_mode="ceil")  # ceil never saturates
    scale = np.exp2(np.repeat(np.asarray(q.scales, np.float64), 32, 1) - 127)
    err = np.abs(np.asarray(mx.dequantize(q), np.float64) - x)
    assert np.all(err <= scale)  # the largest E2M1 spacing (4 -> 6) is 2, half of it 1
    assert mx.error_stats(mx.dequantize(q), x).snr_db > 13
