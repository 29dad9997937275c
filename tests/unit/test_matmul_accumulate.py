"""matmul_accumulate: issuing K in ordered pieces equals one matmul over all of K, bit for bit."""

import jax.numpy as jnp
import numpy as np
import pytest

from jalapeno_emu import mx
from jalapeno_emu.errors import InvalidArgumentError


def _split_k(q: mx.MXArray, axis: int, start: int, stop: int) -> mx.MXArray:
    codes = q.codes[:, start:stop] if axis == 1 else q.codes[start:stop]
    s0, s1 = start // q.block_size, stop // q.block_size
    scales = q.scales[:, s0:s1] if axis == 1 else q.scales[s0:s1]
    return mx.MXArray(codes=codes, scales=scales, fmt=q.fmt, axis=axis, block_size=q.block_size)


@pytest.mark.parametrize(("fa", "fb", "scale"), [("e2m1", "e2m1", 1.0), ("e4m3", "e2m1", 1.0),
                                                ("e2m1", "e2m1", 2.0**-60)])
def test_k_pieces_in_order_equal_the_whole(fa, fb, scale):
    rng = np.random.default_rng(3)
    a = mx.quantize(rng.standard_normal((5, 256)).astype(np.float32) * scale, fa, axis=1)
    b = mx.quantize(rng.standard_normal((256, 7)).astype(np.float32) * scale, fb, axis=0)
    whole = np.asarray(mx.matmul(a, b))
    acc = jnp.zeros((5, 7), jnp.float32)
    for lo, hi in ((0, 64), (64, 96), (96, 256)):
        acc = mx.matmul_accumulate(acc, _split_k(a, 1, lo, hi), _split_k(b, 0, lo, hi))
    assert np.array_equal(np.asarray(acc).view(np.uint32), whole.view(np.uint32))


def test_subnormal_accumulators_are_not_flushed():
    a = mx.quantize(jnp.zeros((1, 32)), axis=1)
    b = mx.quantize(jnp.zeros((32, 1)), axis=0)
    tiny = jnp.array([[2.0**-140]], jnp.float32)
    assert float(mx.matmul_accumulate(tiny, a, b)[0, 0]) == 2.0**-140


def test_accumulator_shape_is_checked():
    a = mx.quantize(jnp.ones((2, 32)), axis=1)
    b = mx.quantize(jnp.ones((32, 3)), axis=0)
    with pytest.raises(InvalidArgumentError, match="acc must be float32"):
        mx.matmul_accumulate(jnp.zeros((3, 2)), a, b)
