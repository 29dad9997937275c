"""Bad input gets a project error (also a ValueError/TypeError) whose message names the argument."""

import jax.numpy as jnp
import numpy as np
import pytest

from jalapeno_emu import mx
from jalapeno_emu.errors import EmuError, InvalidArgumentError, InvalidTypeError

X = jnp.ones((4, 64), jnp.float32)


@pytest.mark.parametrize(
    ("kwargs", "exc", "names"),
    [
        ({"fmt": "e9m9"}, InvalidArgumentError, "fmt"),
        ({"fmt": "E2M1"}, InvalidArgumentError, "fmt"),
        ({"scale_mode": "round"}, InvalidArgumentError, "scale_mode"),
        ({"rounding": "nearest"}, InvalidArgumentError, "rounding"),
        ({"rounding": "stochastic"}, InvalidArgumentError, "key"),
        ({"block_size": 48}, InvalidArgumentError, "block_size"),
        ({"block_size": 0}, InvalidArgumentError, "block_size"),
        ({"block_size": 2.0}, InvalidTypeError, "block_size"),
        ({"axis": 2}, InvalidArgumentError, "axis"),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}={v[k]}" for k in v),
)
def test_quantize_rejects_bad_arguments(kwargs, exc, names):
    with pytest.raises(exc, match=names):
        mx.quantize(X, **kwargs)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_, jnp.complex64])
def test_quantize_rejects_non_float_inputs(dtype):
    with pytest.raises(InvalidTypeError, match="x has dtype"):
        mx.quantize(jnp.zeros((2, 32), dtype))


def test_errors_are_builtin_subclasses_and_project_errors():
    assert issubclass(InvalidArgumentError, ValueError) and issubclass(InvalidArgumentError, EmuError)
    assert issubclass(InvalidTypeError, TypeError) and issubclass(InvalidTypeError, EmuError)


def test_quantize_rejects_0d():
    with pytest.raises(InvalidArgumentError, match="0-d"):
        mx.quantize(jnp.float32(1.0))


def test_from_gpt_oss_shape_disagreements():
    blocks = jnp.zeros((3, 4, 16), jnp.uint8)
    with pytest.raises(InvalidArgumentError, match="scales"):
        mx.from_gpt_oss(blocks, jnp.zeros((3, 5), jnp.uint8))
    with pytest.raises(InvalidArgumentError, match="blocks"):
        mx.from_gpt_oss(jnp.zeros((3, 4, 8), jnp.uint8), jnp.zeros((3, 4), jnp.uint8))
    with pytest.raises(InvalidTypeError, match="blocks"):
        mx.from_gpt_oss(blocks.astype(jnp.int32), jnp.zeros((3, 4), jnp.uint8))


def test_pack_fp4_rejects_odd_length_and_wrong_dtype():
    with pytest.raises(InvalidArgumentError, match="odd"):
        mx.pack_fp4(jnp.zeros((3, 5), jnp.uint8))
    with pytest.raises(InvalidTypeError, match="codes"):
        mx.pack_fp4(jnp.zeros((4,), jnp.int8))


def test_matmul_checks_operands():
    a = mx.quantize(jnp.ones((2, 64)), axis=1)
    b = mx.quantize(jnp.ones((64, 3)), axis=0)
    with pytest.raises(InvalidArgumentError, match="b is blocked along axis 1"):
        mx.matmul(a, mx.quantize(jnp.ones((64, 32)), axis=1))
    with pytest.raises(InvalidArgumentError, match="a is blocked along axis 0"):
        mx.matmul(mx.quantize(jnp.ones((32, 64)), axis=0), b)
    with pytest.raises(InvalidArgumentError, match="K differs"):
        mx.matmul(a, mx.quantize(jnp.ones((32, 3)), axis=0))
    with pytest.raises(InvalidArgumentError, match="block_size"):
        mx.matmul(mx.quantize(jnp.ones((2, 64)), axis=1, block_size=16), b)
    with pytest.raises(InvalidTypeError, match="a must be an MXArray"):
        mx.matmul(np.ones((2, 64)), b)


def test_mxarray_validation_names_the_mismatch():
    q = mx.MXArray(codes=jnp.zeros((4, 64), jnp.uint8), scales=jnp.zeros((4, 3), jnp.uint8),
                   fmt="e2m1", axis=1, block_size=32)
    with pytest.raises(InvalidArgumentError, match=r"q.scales has shape \(4, 3\)"):
        mx.dequantize(q)


def test_error_stats_rejects_shape_mismatch_and_unknown_ulp_format():
    with pytest.raises(InvalidArgumentError, match="shape"):
        mx.error_stats(np.zeros(3), np.zeros(4))
    with pytest.raises(InvalidArgumentError, match="ulp_format"):
        mx.error_stats(np.zeros(3), np.zeros(3), ulp_format="float8")


def test_dequantize_rejects_integer_dtype():
    with pytest.raises(InvalidTypeError, match="dtype"):
        mx.dequantize(mx.quantize(X), dtype=jnp.int32)
