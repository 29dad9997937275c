"""Argument checks shared by the public MX entry points (quantize, pack, matmul, ...).

Every check runs on the host, on Python objects, shapes and dtypes only: never per element and
never on traced values, so a jitted or vmapped caller pays nothing at run time and a direct caller
a few microseconds. Each failure is one sentence naming the argument and what was expected,
raised as the project's ``InvalidTypeError`` (wrong kind of object) or ``InvalidArgumentError``
(right kind, wrong value).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Set
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jalapeno_emu.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["MAX_BLOCK_SIZE", "as_array", "as_host_array", "check_axis", "check_block_size", "check_int",
           "check_prng_key", "describe", "is_array"]

# The largest MX block: mx.matmul sums one block's products in float32 limbs of L bits, with
# (2^L - 1)^2 * block_size < 2^24 for exactness, and L >= 1 needs block_size <= 2^21.
MAX_BLOCK_SIZE = 1 << 21

# Text, bytes and unordered containers: numpy would make a 0-d string or object array of them
# (a bytearray: its bytes as numbers) instead of refusing. A memoryview is a real buffer: it passes.
_NEVER_ARRAYS = (str, bytes, bytearray, Mapping, Set)
# numpy dtype kinds that are no numbers: object, unicode, bytes, datetime, timedelta.
_NON_NUMERIC_KINDS = frozenset("OUSMm")


def describe(value: object) -> str:
    """A short phrase for ``value`` in an error message: its type, and dtype/shape for arrays."""
    if value is None:
        return "None"
    if is_array(value):
        return f"{type(value).__name__} of dtype {value.dtype} and shape {tuple(value.shape)}"
    if isinstance(value, int | float | complex):  # the value says more than its type
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


def is_array(value: object) -> bool:
    """True for an object with ``shape`` and ``dtype`` (jax/numpy arrays, tracers, ShapeDtypeStruct)."""
    return hasattr(value, "shape") and hasattr(value, "dtype")


def as_host_array(value: Any, argname: str, expected: str) -> np.ndarray:
    """``value`` as a numeric numpy array, or a project error saying why it is not one.

    Args:
        value: a numpy or jax array, or anything numpy turns into a numeric array (nested lists
            of numbers, scalars).
        argname: the caller's argument name, for the message.
        expected: what the caller takes, e.g. "a uint8 array", for the message.

    Raises:
        InvalidTypeError: None, text, bytes, a mapping or set, or an array of non-numbers.
        InvalidArgumentError: a nested sequence that is not rectangular (ragged).
    """
    if value is None or isinstance(value, _NEVER_ARRAYS):
        raise InvalidTypeError(f"{argname} must be {expected}, got {describe(value)}")
    if isinstance(value, np.ndarray):
        arr = value
    else:
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError):  # numpy refuses ragged nesting since 1.24
            raise InvalidArgumentError(
                f"{argname} is ragged (a nested sequence whose rows differ in length); it must be "
                f"{expected}, every row the same length"
            ) from None
    if arr.dtype.kind in _NON_NUMERIC_KINDS:
        raise InvalidTypeError(f"{argname} must be {expected}, got {describe(value)}")
    return arr


def as_array(value: Any, argname: str, expected: str) -> jax.Array:
    """``value`` as a JAX array (see ``as_host_array`` for what is refused, and how).

    A jax.Array, tracers included, is returned as it is: the hot path converts and copies nothing.
    """
    if isinstance(value, jax.Array):
        return value
    arr = as_host_array(value, argname, expected)
    try:
        return jnp.asarray(arr)
    except TypeError:  # a dtype jax has no type for (e.g. a structured void dtype)
        raise InvalidTypeError(f"{argname} must be {expected}, got {describe(value)}") from None


def check_int(value: object, argname: str, *, minimum: int | None = None) -> int:
    """``value`` as an int (bool refused), at least ``minimum`` when given."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidTypeError(f"{argname}={value!r} must be an int")
    if minimum is not None and value < minimum:
        raise InvalidArgumentError(f"{argname}={value} must be >= {minimum}")
    return int(value)


def check_block_size(value: object, argname: str = "block_size") -> int:
    """``value`` as a block size: an int in [1, MAX_BLOCK_SIZE].

    An empty axis is divided by any size, so divisibility alone does not bound it; a size beyond
    the bound would reach JAX as a static shape too large for it.
    """
    size = check_int(value, argname, minimum=1)
    if size > MAX_BLOCK_SIZE:
        raise InvalidArgumentError(
            f"{argname}={size} is larger than {MAX_BLOCK_SIZE:,} (2**21), the largest block whose "
            "dot products mx.matmul sums exactly in float32 (the OCP MX block is 32)")
    return size


def check_axis(axis: object, shape: tuple[int, ...], arrayname: str, *, argname: str = "axis") -> int:
    """``axis`` as a non-negative index into ``shape`` (negative counts from the end)."""
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise InvalidTypeError(
            f"{argname}={axis!r} must be an int (a dimension of {arrayname}; negative counts from the end)"
        )
    if not -len(shape) <= axis < len(shape):
        raise InvalidArgumentError(f"{argname}={axis} is out of range for {arrayname} of shape {shape}")
    return int(axis) % len(shape)


@functools.cache
def _raw_key_shape() -> tuple[int, ...]:
    # The legacy uint32 key's shape depends on the default PRNG implementation (threefry: (2,),
    # rbg: (4,)); eval_shape finds it without running anything.
    return tuple(jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape)


def check_prng_key(key: object, argname: str = "key") -> None:
    """Raise unless ``key`` is one JAX PRNG key: typed (``jax.random.key``) or raw uint32 (``PRNGKey``)."""
    if is_array(key):
        dtype = key.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            if tuple(key.shape) == ():
                return
        elif np.dtype(dtype) == np.uint32 and tuple(key.shape) == _raw_key_shape():
            return
    raise InvalidTypeError(
        f"{argname} must be one JAX PRNG key (jax.random.key(seed) or jax.random.PRNGKey(seed)), "
        f"got {describe(key)}"
    )
