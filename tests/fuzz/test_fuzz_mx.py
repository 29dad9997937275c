"""Fuzzing the MX API: every public entry point returns its result or raises the project's
``InvalidTypeError`` / ``InvalidArgumentError``, never a JAX, NumPy or Python exception.

Arguments are arrays of random shapes (0-d, empty, ragged lists), dtypes (floats, ints, bool,
complex, object, text) and values (NaN, +-Inf, huge, subnormal, -0), with formats, axes, block
sizes, scale modes, roundings and keys drawn from the valid choices, their other spellings and
near misses. A result must have the documented shape and dtype.

Every valid combination of shapes and static arguments compiles once (about half a second, two
for a matmul), so the valid shapes come from small pools and the budgets are small: the value is
in the error paths, which cost nothing, and in the values (NaN, Inf, huge), which compile nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jalapeno_emu import mx
from jalapeno_emu.errors import EmuError, InvalidArgumentError, InvalidTypeError
from tests.fuzz.helpers import call, fuzz_settings, time_limit

# float64 inputs are rounded to float32 (documented); a huge one overflows to Inf on the way,
# which is a case under test, not a problem.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

# Float values with every special: NaN, +-Inf, the float32 extremes, subnormals, signed zeros.
FLOAT_VALUES = st.one_of(
    st.floats(-1e3, 1e3, width=32),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    # (mapped through float32: an array element must be exactly representable in its dtype)
    st.sampled_from([0.0, -0.0, np.nan, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1e-45, 1.17549435e-38,
                     6.0, 448.0, 57344.0, 1e30]).map(lambda v: float(np.float32(v))),
)
FLOAT_SHAPES = st.sampled_from([(4, 64), (64, 4), (2, 32), (0, 32), (32,), (3, 5), (2, 0), ()])


@st.composite
def float_arrays(draw: st.DrawFn) -> object:
    """A float array of a pooled shape, in one of the accepted input dtypes, as numpy or jax."""
    shape = draw(FLOAT_SHAPES)
    x = draw(hnp.arrays(np.float32, shape, elements=FLOAT_VALUES))
    dtype = draw(st.sampled_from([np.float32, np.float32, ml_dtypes.bfloat16, np.float16, np.float64]))
    with np.errstate(over="ignore"):  # float16 saturates huge values to Inf: fine, Inf is a case
        x = x.astype(dtype)
    return jnp.asarray(x) if draw(st.booleans()) else x


# Things that are not arrays of real floats.
NOT_FLOATS = st.one_of(
    hnp.arrays(st.sampled_from([np.int32, np.uint8, np.bool_, np.complex64, np.int8]),
               st.sampled_from([(2, 32), (32,), (0,)])),
    st.sampled_from([None, "1.0", b"\x00", {"x": 1.0}, {1.0}, object(), [[1.0, 2.0], [3.0]], [], [[]], 1.5,
                     np.array([1.0, "a"], dtype=object), np.array(["a", "b"]), np.datetime64("2020-01-01"),
                     np.zeros(4, dtype=[("a", "f4")]), range(32), memoryview(b"\x00" * 32)]),
    st.lists(st.floats(allow_nan=True), min_size=32, max_size=32),  # a list of 32 floats is fine
)

FMTS = st.sampled_from([*mx.FORMATS, "fp4", "fp8e4", "fp8e5", "fp6e2", "fp6e3",  # valid, both spellings
                        "bf16", "E2M1", "e2m2", "", None, 4, mx.FORMATS["e2m1"], ("e2m1",)])
AXES = st.sampled_from([-1, -1, 0, 1, -2, 2, -3, None, 0.5, True, np.int64(0), "0", 2**64])
BLOCK_SIZES = st.sampled_from([32, 32, 16, 64, 1, 0, -32, 3, True, 32.0, np.int32(32), None, "32", 2**64])
SCALE_MODES = st.sampled_from([*mx.SCALE_MODES, "FLOOR", "bogus", None, 1])
ROUNDINGS = st.sampled_from([*mx.ROUNDINGS, "rtz", None])
KEYS = st.sampled_from(["typed", "raw", None, 5, "key", "uint32x2", "uint32x3", "batch", "float"])


def _key(kind: object) -> object:
    """The PRNG key (or not-a-key) named by ``kind``; built here, not at import, to keep JAX lazy."""
    return {
        "typed": lambda: jax.random.key(0), "raw": lambda: jax.random.PRNGKey(1),
        "uint32x2": lambda: np.zeros(2, np.uint32), "uint32x3": lambda: jnp.zeros((3,), jnp.uint32),
        "batch": lambda: jax.random.split(jax.random.key(0), 2), "float": lambda: jnp.zeros(2),
    }.get(kind, lambda: kind)()


# Every valid combination compiles once: the valid test draws its static arguments from these few.
VALID_LAYOUTS = st.sampled_from([((4, 64), -1, 32), ((64, 4), 0, 32), ((2, 32), 1, 16), ((0, 32), -1, 32)])


@fuzz_settings(max_examples=25, deadline_s=30)
@given(VALID_LAYOUTS.flatmap(lambda layout: st.tuples(
           st.just(layout), hnp.arrays(np.float32, layout[0], elements=FLOAT_VALUES))),
       st.sampled_from(["e2m1", "fp8e4", "int8"]), st.sampled_from(["floor", "rceil"]),
       st.sampled_from(["rne", "stochastic"]))
def test_quantize_values(layout_and_x, fmt, scale_mode, rounding):
    # Valid arguments, any values: a block holding NaN or Inf dequantises to NaN throughout; every
    # other block to numbers (out-of-range elements saturate), infinite only where the MX value is
    # beyond float32 (a block near float32's largest value whose scale rounds up, as rceil may).
    (shape, axis, block), x = layout_and_x
    key = jax.random.key(7) if rounding == "stochastic" else None
    with time_limit(60, "quantize"):
        q = mx.quantize(x, fmt, axis=axis, block_size=block, scale_mode=scale_mode, rounding=rounding,
                        key=key)
        _check_mxarray(q, shape)
        out = np.asarray(mx.dequantize(q))
    ax = axis % len(shape)
    x_blocks = np.moveaxis(x, ax, -1).reshape(-1, block)
    out_blocks = np.moveaxis(out, ax, -1).reshape(-1, block)
    special = ~np.isfinite(x_blocks).all(axis=1)
    assert np.isnan(out_blocks[special]).all()
    assert not np.isnan(out_blocks[~special]).any()
    overflowed = np.isinf(out_blocks).any(axis=1) & ~special
    assert (np.abs(x_blocks[overflowed]).max(axis=1, initial=0) >= 2.0**126).all()


def _check_mxarray(q: object, shape: tuple[int, ...]) -> None:
    """``q`` is a valid MXArray of ``shape``, and dequantises to float32 of that shape."""
    assert isinstance(q, mx.MXArray)
    assert q.shape == tuple(shape) and q.codes.dtype == np.uint8 and q.scales.dtype == np.uint8
    q.validate()
    out = mx.dequantize(q)
    assert out.shape == tuple(shape) and out.dtype == jnp.float32


@fuzz_settings(max_examples=80, deadline_s=30)
@given(st.one_of(float_arrays(), float_arrays(), NOT_FLOATS), FMTS, AXES, BLOCK_SIZES, SCALE_MODES, ROUNDINGS,
       KEYS)
def test_quantize(x, fmt, axis, block_size, scale_mode, rounding, key):
    # A known bug, tracked by test_quantize_of_an_empty_axis_with_a_huge_block_size below.
    assume(not (getattr(x, "size", None) == 0 and isinstance(block_size, int) and block_size >= 2**63))
    with time_limit(60, "quantize"):
        q = call(mx.quantize, x, fmt, axis=axis, block_size=block_size, scale_mode=scale_mode,
                 rounding=rounding, key=_key(key))
        if isinstance(q, EmuError):
            assert isinstance(q, InvalidArgumentError | InvalidTypeError), repr(q)
            event(f"refused: {type(q).__name__}")
            return
        event("quantized")
        _check_mxarray(q, np.shape(x))


# codes and scales for MXArray(...): uint8 arrays whose shapes may or may not agree, other dtypes,
# and non-arrays.
LEAVES = st.one_of(
    hnp.arrays(np.uint8, st.sampled_from([(2, 32), (2, 1), (1, 32), (2, 2), (32,), (1,), (0, 32), (0, 1),
                                          ()])),
    hnp.arrays(st.sampled_from([np.float32, np.int32, np.int8]), st.sampled_from([(2, 32), (2, 1)])),
    st.sampled_from([None, [1, 2], "codes", 3]),
)


@fuzz_settings(max_examples=80, deadline_s=30)
@given(LEAVES, LEAVES, FMTS, AXES, BLOCK_SIZES,
       st.sampled_from([jnp.float32, jnp.bfloat16, "float16", None, "bogus", jnp.int32, "int8", object, 3]))
def test_mxarray_and_dequantize(codes, scales, fmt, axis, block_size, dtype):
    with time_limit(60, "dequantize"):
        q = call(mx.MXArray, codes=codes, scales=scales, fmt=fmt, axis=axis, block_size=block_size)
        if isinstance(q, EmuError):
            assert isinstance(q, InvalidArgumentError | InvalidTypeError), repr(q)
            event("MXArray refused")
            return
        out = call(mx.dequantize, q, dtype)
        if isinstance(out, EmuError):
            assert isinstance(out, InvalidArgumentError | InvalidTypeError), repr(out)
            event("dequantize refused")
            return
        event("dequantized")
        assert out.shape == np.shape(codes)
        # error_stats takes any two real arrays of one shape; a dequantised array is one.
        stats = call(mx.error_stats, out, out)
        assert not isinstance(stats, EmuError) or out.dtype == jnp.bfloat16, stats


CODE_ARRAYS = st.one_of(
    hnp.arrays(np.uint8, st.sampled_from([(4, 8), (4, 7), (8,), (0,), (0, 4), (4, 0), (), (2, 3, 4)])),
    NOT_FLOATS,
    hnp.arrays(np.float32, st.sampled_from([(4, 8)])),
)


@fuzz_settings(max_examples=80, deadline_s=30)
@given(CODE_ARRAYS, AXES)
def test_pack_and_unpack_fp4(codes, axis):
    with time_limit(60, "pack_fp4"):
        packed = call(mx.pack_fp4, codes, axis)
        unpacked = call(mx.unpack_fp4, codes, axis)
    for result in (packed, unpacked):
        if isinstance(result, EmuError):
            assert isinstance(result, InvalidArgumentError | InvalidTypeError), repr(result)
    if not isinstance(packed, EmuError):
        event("packed")
        # Unpacking what was packed gives back the low nibbles.
        again = mx.unpack_fp4(packed, axis)
        np.testing.assert_array_equal(np.asarray(again), np.asarray(codes) & 0xF)
    if not isinstance(unpacked, EmuError):
        event("unpacked")
        assert unpacked.dtype == np.uint8 and unpacked.size == 2 * np.size(codes)


@fuzz_settings(max_examples=40, deadline_s=30)
@given(st.one_of(hnp.arrays(np.uint8, st.sampled_from([(2, 3, 16), (3, 16), (16,), (2, 3, 15), (0, 16)])),
                 NOT_FLOATS),
       st.one_of(hnp.arrays(np.uint8, st.sampled_from([(2, 3), (3,), (), (2, 4), (0,)])), NOT_FLOATS))
def test_from_gpt_oss(blocks, scales):
    with time_limit(60, "from_gpt_oss"):
        q = call(mx.from_gpt_oss, blocks, scales)
        if isinstance(q, EmuError):
            assert isinstance(q, InvalidArgumentError | InvalidTypeError), repr(q)
            return
        event("imported")
        _check_mxarray(q, (*np.shape(blocks)[:-2], np.shape(blocks)[-2] * 32))


@functools.cache
def _operands() -> dict[str, object]:
    """MX matrices for matmul, built once: two valid pairs (K = 64, NaN, Inf and huge values among
    the inputs) and operands that break one
    rule each (blocked along the wrong axis, another K, another block size, 3-D, not an MXArray)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    x[0, :32] = np.nan  # a NaN block: its scale is 0xFF and the products NaN
    x[1, 5] = np.inf
    y = rng.standard_normal((64, 8)).astype(np.float32) * 1e30
    return {
        "a:e2m1": mx.quantize(x, "e2m1", axis=1), "a:e4m3": mx.quantize(x, "e4m3", axis=1),
        "b:e2m1": mx.quantize(y, "e2m1", axis=0),
        "a:wrong-axis": mx.quantize(x[:, :32].T.copy(), "e2m1", axis=0),
        "b:other-k": mx.quantize(y[:32], "e2m1", axis=0),
        "b:block16": mx.quantize(y, "e2m1", axis=0, block_size=16),
        "a:3d": mx.quantize(x.reshape(2, 2, 64), "e2m1", axis=2),
        "a:array": jnp.asarray(x), "none": None,
    }


# Valid pairs are few on purpose: each compiles the matmul (about two seconds).
A_NAMES = st.sampled_from(["a:e2m1", "a:e2m1", "a:e4m3", "a:wrong-axis", "a:3d", "a:array", "none", "b:e2m1"])
B_NAMES = st.sampled_from(["b:e2m1", "b:e2m1", "b:other-k", "b:block16", "none", "a:e2m1"])
ACCS = st.sampled_from(["zeros", "nan", "wrong-shape", "float64", "list", None])


@fuzz_settings(max_examples=30, deadline_s=60)
@given(A_NAMES, B_NAMES, ACCS)
def test_matmul(a_name, b_name, acc_kind):
    ops = _operands()
    a, b = ops[a_name], ops[b_name]
    m, n = (4, 8)
    acc = {"zeros": lambda: jnp.zeros((m, n), jnp.float32), "nan": lambda: jnp.full((m, n), jnp.nan),
           "wrong-shape": lambda: jnp.zeros((n, m), jnp.float32), "float64": lambda: np.zeros((m, n)),
           "list": lambda: [[0.0] * n] * m, None: lambda: None}[acc_kind]()
    with time_limit(120, "matmul"):
        for result in (call(mx.matmul, a, b), call(mx.matmul_accumulate, acc, a, b)):
            if isinstance(result, EmuError):
                assert isinstance(result, InvalidArgumentError | InvalidTypeError), repr(result)
                continue
            event("multiplied")
            assert result.shape == (m, n) and result.dtype == jnp.float32


# error_stats on float64 inputs near the top of their range overflows (with RuntimeWarnings): the
# xfail test below tracks that; here only the kind of outcome is checked.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@fuzz_settings(max_examples=60, deadline_s=5)
@given(FMTS, FMTS, BLOCK_SIZES, st.one_of(float_arrays(), NOT_FLOATS), st.one_of(float_arrays(), NOT_FLOATS),
       st.sampled_from(["float32", "bfloat16", "float16", "float64", None, 3]))
def test_small_helpers(fa, fb, block_size, approx, reference, ulp_format):
    # element_format, block_sum_is_exact_in_f32 and error_stats: host-side, no compilation.
    results = [call(mx.element_format, fa), call(mx.error_stats, approx, reference, ulp_format=ulp_format)]
    if not isinstance(block_size, np.integer):  # a known bug: test_block_sum_with_a_numpy_block_size
        results.append(call(mx.block_sum_is_exact_in_f32, fa, fb, block_size))
    for result in results:
        assert not isinstance(result, EmuError) or isinstance(result, InvalidArgumentError | InvalidTypeError)


# Found by fuzzing (issue 13): error_stats squared and multiplied float64 values without scaling,
# so finite inputs beyond ~1e154 overflowed (cosine_similarity NaN, snr_db Inf for two nearly equal
# vectors).
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_error_stats_of_large_finite_inputs():
    stats = mx.error_stats(np.array([1e200, 1.0]), np.array([1e200, 0.0]))
    assert stats.cosine_similarity == pytest.approx(1.0)
    assert stats.snr_db == pytest.approx(4000.0)  # 10 log10(1e400 / 1)
    assert stats.rmse == pytest.approx(np.sqrt(0.5))


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_error_stats_of_opposite_values_near_the_float64_maximum():
    # The difference itself overflows: max_abs_error is inf (it exceeds float64), the rest is finite.
    big = np.finfo(np.float64).max / 1.5
    stats = mx.error_stats(np.array([big, 1.0]), np.array([-big, 1.0]))
    assert stats.cosine_similarity == pytest.approx(-1.0)
    assert stats.snr_db == pytest.approx(10 * np.log10(1 / 4))  # error 2 big against a signal of big
    assert stats.rmse == pytest.approx(big * np.sqrt(2), rel=1e-12)


# Found by fuzzing (issue 13): quantize checked only that block_size divides the blocked axis, which
# any size does when the axis is empty; block_size >= 2**63 then reached JAX as a static shape and
# failed with a TypeError from MLIR.
def test_quantize_of_an_empty_axis_with_a_huge_block_size():
    with pytest.raises(InvalidArgumentError, match="block_size"):
        mx.quantize(np.zeros((2, 0), np.float32), block_size=2**64)
    with pytest.raises(InvalidArgumentError, match=r"block_size=4194304 is larger than 2,097,152"):
        mx.quantize(np.zeros((2, 0), np.float32), block_size=2**22)
    assert mx.quantize(np.zeros((2, 0), np.float32), block_size=32).scales.shape == (2, 0)


def test_an_mxarray_with_a_huge_block_size_is_refused():
    q = mx.quantize(np.zeros((2, 0), np.float32), block_size=32)
    huge = mx.MXArray(codes=q.codes, scales=q.scales, fmt=q.fmt, axis=q.axis, block_size=2**64)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        mx.dequantize(huge)


def test_block_sum_with_a_numpy_block_size():
    assert mx.block_sum_is_exact_in_f32("e2m1", "e5m2", np.int32(32)) == mx.block_sum_is_exact_in_f32(
        "e2m1", "e5m2", 32)
