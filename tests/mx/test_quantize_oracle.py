"""mx.quantize / mx.dequantize against the independent oracle, bit for bit,
plus properties that need no oracle (fixed point, bounds, packing, jit/vmap,
stochastic rounding)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.mx import oracle
from tests.mx.helpers import (
    F32_MAX,
    adversarial_blocks,
    assert_f32_identical,
    assert_quantized_equal,
    f32_bits,
    lib,
    make_mx,
    random_data,
)

COMBOS = [
    pytest.param(f, m, r, id=f"{f}-{m}-{r}")
    for f in oracle.FMT_NAMES
    for m in oracle.SCALE_MODES
    for r in oracle.ROUNDINGS
]
FMTS = [pytest.param(f, id=f) for f in oracle.FMT_NAMES]


def lib_quantize(x, fmt, mode="floor", rounding="rne", axis=-1, bs=32, key=None):
    """Call the library with keyword arguments exactly as documented."""
    kw = {"key": key} if key is not None else {}
    return lib().quantize(jnp.asarray(x), fmt=fmt, axis=axis, block_size=bs,
                          scale_mode=mode, rounding=rounding, **kw)


def check_against_oracle(x, fmt, mode, rounding, axis=-1, bs=32, labels=None):
    """Library quantize and dequantize equal the oracle bit for bit; returns the MXArray."""
    x32 = np.asarray(x).astype(np.float32)
    q = lib_quantize(x, fmt, mode, rounding, axis, bs)
    exp_codes, exp_scales = oracle.quantize(x32, fmt, axis, bs, mode, rounding)
    assert_quantized_equal(q, exp_codes, exp_scales, x32, labels, axis, bs)
    deq = lib().dequantize(q, dtype=jnp.float32)
    assert_f32_identical(deq, oracle.dequantize(exp_codes, exp_scales, fmt, axis, bs),
                         "dequantize")
    return q


# ---------------------------------------------------------------------------
# bit-exact against the oracle
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, mode, rounding", COMBOS)
def test_adversarial_blocks(fmt, mode, rounding):
    """Random data at 2^-140..2^120, zeros, grid ties +-1ulp, saturation, scale
    boundaries (even / rceil / powers of two), FP32 max, subnormals, NaN/inf."""
    x, labels = adversarial_blocks(fmt)
    check_against_oracle(x, fmt, mode, rounding, labels=labels)


@functools.cache
def layout_case(layout: str):
    """(x, axis, block_size) for the layout / dtype variants."""
    rng = np.random.default_rng(sum(map(ord, layout)))
    if layout == "3d-last-bs8":
        x = random_data(rng, (2, 3, 64))
        x[0, 0, :8] = [2.0**-149, -0.0, 0.0, 1.0, F32_MAX, 3.0, 7.0, -5.0]
        x[0, 1, 8:16] = -0.0
        x[1, 2, 40] = np.nan
        return x, -1, 8
    if layout == "2d-axis0-bs64":
        x = random_data(rng, (128, 5))
        x[:64, 1] = 0.0
        x[70, 2] = -np.inf
        x[:64, 3] *= 2.0**-130
        return x, 0, 64
    if layout == "bf16-3d-axis1":
        x = random_data(rng, (2, 64, 3), -130, 120).astype(ml_dtypes.bfloat16)
        x[0, :6, 0] = [2.0**-133, -(2.0**-133), 2.0**-126, -0.0, 3.3895314e38, 1.0]
        x[1, 33, 2] = np.inf
        return x, 1, 32
    if layout == "f16":
        x = random_data(rng, (4, 64), -24, 14).astype(np.float16)
        x[0, :6] = [2.0**-24, -(2.0**-24), 2.0**-14, -0.0, 65504.0, -65504.0]
        x[1, :32] = (np.arange(32) * 2.0**-24).astype(np.float16)  # all subnormal
        x[3, 33] = np.nan
        return x, -1, 32
    raise ValueError(layout)


# Each (layout, fmt) runs with two scale modes and the rounding alternating,
# rotated so every layout meets all four modes and both roundings, and every
# (fmt, mode) pair meets two layouts.  Scale mode and rounding logic do not
# depend on layout and are covered in full by test_adversarial_blocks; this
# keeps the number of library compilations (~0.1 s each) within budget.
LAYOUTS = ["3d-last-bs8", "2d-axis0-bs64", "bf16-3d-axis1", "f16"]
LAYOUT_CASES = []
for _i, _lay in enumerate(LAYOUTS):
    for _j, _f in enumerate(oracle.FMT_NAMES):
        for _t in range(2):
            _m = oracle.SCALE_MODES[(_i + _j + 2 * _t) % 4]
            _r = oracle.ROUNDINGS[(_i + _j + _t) % 2]
            LAYOUT_CASES.append(pytest.param(_lay, _f, _m, _r, id=f"{_lay}-{_f}-{_m}-{_r}"))


@pytest.mark.parametrize("layout, fmt, mode, rounding", LAYOUT_CASES)
def test_layouts_and_dtypes(layout, fmt, mode, rounding):
    """Block sizes 8/64, blocking along axis 0 / the last axis of 3-D / the middle
    axis, bfloat16 and float16 inputs."""
    x, axis, bs = layout_case(layout)
    check_against_oracle(x, fmt, mode, rounding, axis=axis, bs=bs)


def test_metadata():
    x = random_data(np.random.default_rng(0), (64, 3))
    q = lib_quantize(x, "e3m2", "ceil", "rna", axis=0, bs=32)
    assert q.fmt == "e3m2"
    assert q.block_size == 32
    assert q.axis % 2 == 0
    assert q.codes.shape == (64, 3) and q.scales.shape == (2, 3)


def test_e2m1_elements_match_ml_dtypes():
    """At block scale 2^0, rne E2M1 codes equal ml_dtypes.float4_e2m1fn's cast.

    Blocks are built with amax in [4, 6] so the floor-mode scale byte is 127
    and every |x| <= 6 (max normal).  Where the two differ (checked below so
    this note stays true): ml_dtypes saturates anything beyond 6, including
    +-inf, to +-6 (codes 0x7 / 0xF) whereas MX turns a block holding inf into
    scale 0xFF; and ml_dtypes casts NaN to code 0x8 (-0.0, E2M1 has no NaN)
    whereas MX marks the whole block NaN via scale 0xFF with codes 0.  In
    range, ml_dtypes rounds to nearest even exactly like MX "rne".
    """
    t = ml_dtypes.float4_e2m1fn
    odd = np.array([7.0, 100.0, np.inf, -np.inf, np.nan], np.float32).astype(t).view(np.uint8)
    assert odd.tolist() == [0x7, 0x7, 0x7, 0xF, 0x8]

    rng = np.random.default_rng(5)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    specials = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, 7)])
    vals = np.concatenate([specials, -specials, rng.uniform(-6, 6, 31 * 20)]).astype(np.float32)
    vals = np.concatenate([vals, np.zeros(-len(vals) % 31, np.float32)]).reshape(-1, 31)
    anchors = rng.choice(np.array([4.0, 4.5, 5.0, 6.0, -6.0], np.float32), (len(vals), 1))
    x = np.concatenate([anchors, vals], axis=1)
    q = lib_quantize(x, "e2m1", "floor", "rne")
    assert (np.asarray(q.scales) == 127).all()
    ref = x.astype(t).view(np.uint8) & 0xF
    codes = np.asarray(q.codes)
    bad = np.argwhere(codes != ref)
    if len(bad):
        i = tuple(bad[0])
        raise AssertionError(f"x={x[i]} lib code={codes[i]:#x} ml_dtypes code={ref[i]:#x}")


# ---------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS)
def test_floor_rne_dequantize_is_a_fixed_point(fmt):
    """quantize(dequantize(q)) == q for floor / rne (incl. -0, NaN blocks, clamps)."""
    x, labels = adversarial_blocks(fmt)
    q = lib_quantize(x, fmt)
    d = np.asarray(lib().dequantize(q, dtype=jnp.float32))
    q2 = lib_quantize(d, fmt)
    assert_quantized_equal(q2, np.asarray(q.codes), np.asarray(q.scales), d, labels)


@pytest.mark.parametrize("mode", oracle.SCALE_MODES)
@pytest.mark.parametrize("fmt", FMTS)
def test_dequantized_within_block_range(fmt, mode):
    """Every dequantized value is at most max_normal * 2^(scale-127); NaN only for 0xFF."""
    x, _ = adversarial_blocks(fmt)
    q = lib_quantize(x, fmt, mode)
    d = np.asarray(lib().dequantize(q, dtype=jnp.float32)).astype(np.float64)
    scales = np.asarray(q.scales)[:, 0].astype(int)
    nan_blk = scales == 0xFF
    assert np.isnan(d[nan_blk]).all()
    assert not np.isnan(d[~nan_blk]).any()
    lim = float(oracle.FORMATS[fmt].max_normal) * np.ldexp(1.0, scales[~nan_blk] - 127)
    # In float32 the bound itself may overflow: ceil / even / rceil can pick
    # 2^s with max_normal * 2^s >= 2^128 for amax near FP32 max, and those
    # elements legitimately dequantize to +-inf.
    with np.errstate(over="ignore"):
        lim32 = lim.astype(np.float32).astype(np.float64)
    assert (np.abs(d[~nan_blk]) <= lim32[:, None]).all()


def test_pack_unpack_fp4():
    mx = lib()
    # element 2j goes in the LOW nibble of byte j
    packed = np.asarray(mx.pack_fp4(jnp.asarray(np.array([[0x1, 0x2, 0xF, 0x8]], np.uint8))))
    assert packed.dtype == np.uint8
    assert packed.tolist() == [[0x21, 0x8F]]
    rng = np.random.default_rng(6)
    codes = rng.integers(0, 16, (4, 6, 8), dtype=np.uint8)
    for axis, shape in ((-1, (4, 6, 4)), (1, (4, 3, 8)), (0, (2, 6, 8))):
        p = mx.pack_fp4(jnp.asarray(codes), axis=axis)
        assert p.shape == shape
        assert np.asarray(mx.unpack_fp4(p, axis=axis)).tolist() == codes.tolist()
    # explicit along axis 0: rows 2j (low) and 2j+1 (high)
    p0 = np.asarray(mx.pack_fp4(jnp.asarray(codes), axis=0))
    assert (p0 == (codes[0::2] | (codes[1::2] << 4))).all()


def test_from_gpt_oss():
    # Two rows, G = 2 groups of 16 bytes (32 e2m1 codes each).
    blocks = np.zeros((2, 2, 16), np.uint8)
    blocks[0, 0, 0] = 0x21  # elements 0, 1 -> codes 1 (0.5), 2 (1.0)
    blocks[0, 0, 15] = 0xF7  # elements 30, 31 -> 6.0, -6.0
    blocks[0, 1, 3] = 0x9C  # elements 38, 39 -> codes 0xC (-2.0), 0x9 (-0.5)
    blocks[1, 0, 0] = 0x80  # elements 0, 1 -> +0, code 0x8 (-0.0)
    blocks[1, 1, 0] = 0x37  # elements 32, 33 -> codes 7, 3 (in a NaN-scale block)
    scales = np.array([[127, 130], [0, 0xFF]], np.uint8)
    q = lib().from_gpt_oss(jnp.asarray(blocks), jnp.asarray(scales))
    assert q.fmt == "e2m1" and q.block_size == 32 and q.axis % 2 == 1
    codes = np.asarray(q.codes)
    assert codes.shape == (2, 64) and np.asarray(q.scales).tolist() == scales.tolist()
    expected = np.zeros((2, 64), np.uint8)
    expected[0, [0, 1, 30, 31, 38, 39]] = [0x1, 0x2, 0x7, 0xF, 0xC, 0x9]
    expected[1, [1, 32, 33]] = [0x8, 0x7, 0x3]
    assert codes.tolist() == expected.tolist()
    d = np.asarray(lib().dequantize(q, dtype=jnp.float32))
    assert d[0, [0, 1, 30, 31, 38, 39]].tolist() == [0.5, 1.0, 6.0, -6.0, -16.0, -4.0]
    assert f32_bits(d[1, :2]).tolist() == [0, 0x80000000]
    assert np.isnan(d[1, 32:]).all() and not np.isnan(d[1, :32]).any()
    assert_f32_identical(d, oracle.dequantize(expected, scales, "e2m1"))


# ---------------------------------------------------------------------------
# jit / vmap
# ---------------------------------------------------------------------------


def _parts(q):
    return q.codes, q.scales


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_under_jit_and_vmap(fmt):
    mx = lib()
    rng = np.random.default_rng(7)
    x = random_data(rng, (4, 64))
    x[1, :32] = -0.0
    kw = {"fmt": fmt, "block_size": 32, "scale_mode": "even", "rounding": "rna"}
    exp_codes, exp_scales = oracle.quantize(x, fmt, -1, 32, "even", "rna")

    jitted = jax.jit(lambda v: _parts(mx.quantize(v, axis=-1, **kw)))
    codes, scales = jitted(jnp.asarray(x))
    eager = mx.quantize(jnp.asarray(x), axis=-1, **kw)
    assert np.asarray(codes).tolist() == np.asarray(eager.codes).tolist()
    assert np.asarray(scales).tolist() == np.asarray(eager.scales).tolist()
    assert np.asarray(codes).tolist() == exp_codes.tolist()
    assert np.asarray(scales).tolist() == exp_scales.tolist()

    # vmap over a leading batch axis; per example a 1-D vector.
    codes, scales = jax.vmap(lambda v: _parts(mx.quantize(v, axis=-1, **kw)))(jnp.asarray(x))
    assert np.asarray(codes).tolist() == exp_codes.tolist()
    assert np.asarray(scales).tolist() == exp_scales.tolist()

    # vmap where each example is blocked along ITS axis 0 (batch axis 1 of the
    # stacked array): catches axis bookkeeping that ignores the batch dim.
    x3 = random_data(rng, (3, 64, 2))
    codes, scales = jax.vmap(lambda v: _parts(mx.quantize(v, axis=0, **kw)))(jnp.asarray(x3))
    e_codes, e_scales = oracle.quantize(x3, fmt, 1, 32, "even", "rna")
    assert np.asarray(codes).tolist() == e_codes.tolist()
    assert np.asarray(scales).tolist() == e_scales.tolist()


# ---------------------------------------------------------------------------
# stochastic rounding (not bit-checkable: properties only)
# ---------------------------------------------------------------------------


def _stochastic_input(fmt: str, rng) -> np.ndarray:
    """Random blocks plus blocks needing saturation and values exactly on the grid."""
    f = oracle.FORMATS[fmt]
    mn = float(f.max_normal)
    x = random_data(rng, (16, 32), -8, 8)
    # floor scale 0 with amax in (max_normal, 2^(emax+1)): saturates.
    x[0] = rng.uniform(-1, 1, 32) * mn
    x[0, 0] = np.nextafter(np.float32(2.0 ** (f.emax + 1)), 0)
    x[1] = [float(oracle.decode(int(c), fmt)) for c in rng.integers(0, f.max_code_mag + 1, 32)]
    x[1, 0] = mn  # exact grid points must stay exact
    x[2, :] = -0.0
    return x


@pytest.mark.parametrize("fmt", FMTS)
def test_stochastic_codes_are_neighbours(fmt):
    x = _stochastic_input(fmt, np.random.default_rng(8))
    q = lib_quantize(x, fmt, "floor", "stochastic", key=jax.random.key(0))
    _, exp_scales = oracle.quantize(x, fmt)
    scales = np.asarray(q.scales)
    assert scales.tolist() == exp_scales.tolist()  # scale does not depend on rounding
    codes = np.asarray(q.codes)
    for (r, i), v in np.ndenumerate(x):
        lo, hi = oracle.element_neighbours(float(v), int(scales[r, 0]), fmt)
        assert codes[r, i] in (lo, hi), (r, i, float(v), codes[r, i], lo, hi)
    # on-grid row: codes reproduce the values exactly
    d = np.asarray(lib().dequantize(q, dtype=jnp.float32))
    assert f32_bits(d[1]).tolist() == f32_bits(x[1]).tolist()


@pytest.mark.parametrize("fmt", FMTS)
def test_stochastic_is_unbiased(fmt):
    """Mean over 2048 independent draws is within 6 sigma of x for every column."""
    f = oracle.FORMATS[fmt]
    rng = np.random.default_rng(9)
    n_draws = 2048
    row = (rng.uniform(-1, 1, 32) * float(f.max_normal) * 0.999).astype(np.float32)
    row[0] = np.float32(f.max_normal)  # anchor: floor scale byte 127
    x = np.tile(row, (n_draws, 1))
    q = lib_quantize(x, fmt, "floor", "stochastic", key=jax.random.key(1))
    assert (np.asarray(q.scales) == 127).all()
    d = np.asarray(lib().dequantize(q, dtype=jnp.float32)).astype(np.float64)
    for i, v in enumerate(row):
        nbrs = oracle.element_neighbours(float(v), 127, fmt)
        lo, hi = (float(oracle.decode(c, fmt)) for c in nbrs)
        step = abs(hi - lo)
        if step == 0:
            assert (d[:, i] == v).all()
            continue
        p = abs(float(v) - lo) / step  # probability of rounding away from zero
        sigma = step * np.sqrt(p * (1 - p) / n_draws)
        assert abs(d[:, i].mean() - float(v)) <= 6 * sigma + 1e-12 * step, (i, float(v), lo, hi)
        # both neighbours actually occur when p is not extreme
        if 0.05 < p < 0.95:
            assert (d[:, i] == lo).any() and (d[:, i] == hi).any(), (i, float(v))


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["key", "PRNGKey"])
def test_stochastic_key_determinism(make_key):
    x = random_data(np.random.default_rng(10), (8, 64), -4, 4)
    a = np.asarray(lib_quantize(x, "e2m1", rounding="stochastic", key=make_key(3)).codes)
    b = np.asarray(lib_quantize(x, "e2m1", rounding="stochastic", key=make_key(3)).codes)
    c = np.asarray(lib_quantize(x, "e2m1", rounding="stochastic", key=make_key(4)).codes)
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()


def test_stochastic_with_make_mx_round_trip():
    # MXArray built by hand from stochastic codes dequantizes like the oracle.
    x = random_data(np.random.default_rng(11), (2, 32))
    q = lib_quantize(x, "e3m2", rounding="stochastic", key=jax.random.key(5))
    q2 = make_mx(np.asarray(q.codes), np.asarray(q.scales), "e3m2", axis=-1)
    assert_f32_identical(lib().dequantize(q2, dtype=jnp.float32),
                         oracle.dequantize(np.asarray(q.codes), np.asarray(q.scales), "e3m2"))
