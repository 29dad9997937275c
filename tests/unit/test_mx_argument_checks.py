"""Issue 13: every public MX entry point answers bad input with the project's errors.

Each case is one call that used to raise a JAX, NumPy or Python exception (ValueError from
jnp.array, TypeError from the PRNG or dtype machinery, AttributeError on a missing ``.shape``);
now it raises ``InvalidTypeError`` or ``InvalidArgumentError`` with a message naming the argument.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jalapeno_emu import mx
from jalapeno_emu.errors import EmuError, InvalidArgumentError, InvalidTypeError

X = jnp.linspace(-4.0, 4.0, 4 * 64, dtype=jnp.float32).reshape(4, 64)
Q = mx.quantize(X)
CODES = jnp.zeros((4, 8), jnp.uint8)
BLOCKS, SCALES = jnp.zeros((2, 3, 16), jnp.uint8), jnp.zeros((2, 3), jnp.uint8)


def _mxa(**fields):
    """Q with some fields replaced (through the constructor, so its checks run)."""
    return mx.MXArray(**{"codes": Q.codes, "scales": Q.scales, **fields})


# Things that are not arrays, or not arrays of numbers; (value, error class).
NOT_ARRAYS = {
    "None": (None, InvalidTypeError),
    "str": ("1.0", InvalidTypeError),
    "bytes": (b"\x00\x01", InvalidTypeError),
    "dict": ({"x": 1.0}, InvalidTypeError),
    "set": ({1.0}, InvalidTypeError),
    "object-array": (np.array([1.0, "a"], dtype=object), InvalidTypeError),
    "object": (object(), InvalidTypeError),
    "ragged-list": ([[1.0, 2.0], [3.0]], InvalidArgumentError),
}
ENTRY_POINTS = {  # name -> (call taking the bad value, the argument name the message must carry)
    "quantize": (lambda v: mx.quantize(v), "x"),
    "pack_fp4": (lambda v: mx.pack_fp4(v), "codes"),
    "unpack_fp4": (lambda v: mx.unpack_fp4(v), "packed"),
    "from_gpt_oss-blocks": (lambda v: mx.from_gpt_oss(v, SCALES), "blocks"),
    "from_gpt_oss-scales": (lambda v: mx.from_gpt_oss(BLOCKS, v), "scales"),
    "dequantize": (lambda v: mx.dequantize(v), "q"),
    "matmul": (lambda v: mx.matmul(v, v), "a"),
    "error_stats": (lambda v: mx.error_stats(v, np.zeros(2)), "approx"),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("kind", sorted(NOT_ARRAYS))
def test_entry_points_refuse_non_arrays(entry, kind):
    call, argname = ENTRY_POINTS[entry]
    value, exc = NOT_ARRAYS[kind]
    if entry in ("dequantize", "matmul"):
        exc = InvalidTypeError  # they take an MXArray: anything else is the wrong type
    with pytest.raises(exc, match=rf"^{argname}\b"):
        call(value)


BAD_CALLS = {
    # stochastic rounding needs one PRNG key
    "key=5": (lambda: mx.quantize(X, rounding="stochastic", key=5), InvalidTypeError, "key"),
    "key=str": (lambda: mx.quantize(X, rounding="stochastic", key="seed"), InvalidTypeError, "key"),
    "key-float": (lambda: mx.quantize(X, rounding="stochastic", key=jnp.zeros(2)), InvalidTypeError, "key"),
    "key-shape": (lambda: mx.quantize(X, rounding="stochastic", key=jnp.zeros(3, jnp.uint32)),
                  InvalidTypeError, "key"),
    "keys-batch": (lambda: mx.quantize(X, rounding="stochastic", key=jax.random.split(jax.random.key(0))),
                   InvalidTypeError, "key"),
    "x-prng-keys": (lambda: mx.quantize(jax.random.split(jax.random.key(0), 32)[None]),
                    InvalidTypeError, "x"),
    # axes
    "quantize-axis=None": (lambda: mx.quantize(X, axis=None), InvalidTypeError, "axis"),
    "quantize-axis=0.5": (lambda: mx.quantize(X, axis=0.5), InvalidTypeError, "axis"),
    "quantize-axis=True": (lambda: mx.quantize(X, axis=True), InvalidTypeError, "axis"),
    "pack-axis=None": (lambda: mx.pack_fp4(CODES, axis=None), InvalidTypeError, "axis"),
    "pack-axis=0.5": (lambda: mx.pack_fp4(CODES, axis=0.5), InvalidTypeError, "axis"),
    "pack-axis=2": (lambda: mx.pack_fp4(CODES, axis=2), InvalidArgumentError, "axis"),
    "unpack-axis=0.5": (lambda: mx.unpack_fp4(CODES, axis=0.5), InvalidTypeError, "axis"),
    "pack-0d": (lambda: mx.pack_fp4(jnp.uint8(3)), InvalidArgumentError, "axis"),
    # dequantize's dtype
    "dequantize-bogus": (lambda: mx.dequantize(Q, "bogus"), InvalidTypeError, "dtype"),
    "dequantize-object": (lambda: mx.dequantize(Q, object()), InvalidTypeError, "dtype"),
    "dequantize-int": (lambda: mx.dequantize(Q, "int32"), InvalidTypeError, "dtype"),
    # MXArray fields of the wrong type (static fields: at construction; leaves: where used)
    "mx-fmt=5": (lambda: _mxa(fmt=5), InvalidArgumentError, "MXArray fmt"),
    "mx-fmt=bogus": (lambda: _mxa(fmt="bogus"), InvalidArgumentError, "MXArray fmt"),
    "mx-axis=None": (lambda: _mxa(axis=None), InvalidTypeError, "MXArray axis"),
    "mx-axis=str": (lambda: _mxa(axis="1"), InvalidTypeError, "MXArray axis"),
    "mx-block=32.0": (lambda: _mxa(block_size=32.0), InvalidTypeError, "MXArray block_size"),
    "mx-block=True": (lambda: _mxa(block_size=True), InvalidTypeError, "MXArray block_size"),
    "mx-block=0": (lambda: _mxa(block_size=0), InvalidArgumentError, "MXArray block_size"),
    "mx-codes=None": (lambda: mx.dequantize(_mxa(codes=None)), InvalidTypeError, "q.codes"),
    "mx-codes=list": (lambda: mx.dequantize(_mxa(codes=Q.codes.tolist())), InvalidTypeError, "q.codes"),
    "mx-scales=str": (lambda: mx.dequantize(_mxa(scales="s")), InvalidTypeError, "q.scales"),
    "mx-codes-float": (lambda: mx.dequantize(_mxa(codes=Q.codes.astype(jnp.float32))),
                       InvalidTypeError, "q.codes"),
    "matmul-b-codes=None": (lambda: mx.matmul(mx.quantize(X, axis=1), _mxa(codes=None, scales=None, axis=0)),
                            InvalidTypeError, "b.codes"),
    "matmul_accumulate-acc=None": (lambda: mx.matmul_accumulate(None, mx.quantize(X, axis=1),
                                                                mx.quantize(X.T, axis=0)),
                                   InvalidTypeError, "acc"),
    "block_sum-block_size=0": (lambda: mx.block_sum_is_exact_in_f32("e2m1", "e2m1", 0),
                               InvalidArgumentError, "block_size"),
    "error_stats-complex": (lambda: mx.error_stats(np.zeros(2, complex), np.zeros(2)),
                            InvalidTypeError, "approx"),
    "error_stats-ulp_format": (lambda: mx.error_stats(np.zeros(2), np.zeros(2), ulp_format=["float32"]),
                               InvalidArgumentError, "ulp_format"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_arguments_raise_project_errors_naming_them(case):
    call, exc, argname = BAD_CALLS[case]
    with pytest.raises(exc, match=rf"^{argname}\b") as info:
        call()
    assert isinstance(info.value, EmuError)
    assert "\n" not in str(info.value)  # one readable sentence


def test_pack_fp4_of_an_empty_axis_is_empty():
    # No pairs, no bytes (lax refuses a strided slice of an empty axis, so this used to raise).
    for shape, axis in (((0,), -1), ((3, 0), -1), ((0, 4), 0)):
        packed = mx.pack_fp4(jnp.zeros(shape, jnp.uint8), axis=axis)
        want = list(shape)
        want[axis] //= 2
        assert packed.shape == tuple(want) and packed.dtype == jnp.uint8
        assert mx.unpack_fp4(packed, axis=axis).shape == shape


def test_good_inputs_still_work_plain_jit_and_vmap():
    # Lists and numpy arrays are converted as before; tracers pass the checks untouched.
    assert mx.quantize(np.asarray(X)).codes.tolist() == Q.codes.tolist()
    assert mx.quantize(X.tolist()).codes.tolist() == Q.codes.tolist()
    assert (jax.jit(lambda x: mx.dequantize(mx.quantize(x)))(X) == mx.dequantize(Q)).all()
    keys = jax.random.split(jax.random.key(0), 2)
    raw = jax.random.split(jax.random.PRNGKey(0), 2)
    for k in (keys, raw):
        codes = jax.vmap(lambda x, k: mx.quantize(x, rounding="stochastic", key=k).codes)(
            jnp.stack([X, X]), k)
        assert codes.shape == (2, *X.shape)
    assert mx.dequantize(Q, None).dtype == jnp.float32  # None: the default dtype
    assert mx.pack_fp4(np.array([1, 2, 3, 4], np.uint8)).tolist() == [0x21, 0x43]


def test_nan_and_inf_keep_their_documented_meaning():
    # quantize's docstring: a block holding NaN or Inf gets scale 0xFF and zero codes, and
    # dequantises to NaN; the argument checks never look at values.
    x = X.at[0, 3].set(jnp.nan).at[2, 40].set(jnp.inf)
    q = mx.quantize(x)
    assert int(q.scales[0, 0]) == 0xFF and int(q.scales[2, 1]) == 0xFF
    assert not q.codes[0, :32].any() and not q.codes[2, 32:].any()
    d = mx.dequantize(q)
    assert bool(jnp.isnan(d[0, :32]).all()) and bool(jnp.isnan(d[2, 32:]).all())
    assert bool(jnp.isfinite(d[1]).all())
