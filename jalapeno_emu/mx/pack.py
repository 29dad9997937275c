"""Packing of 4-bit codes two per byte, and import of gpt-oss checkpoint tensors."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jalapeno_emu.errors import InvalidArgumentError, InvalidTypeError
from jalapeno_emu.mx._validate import as_array, check_axis
from jalapeno_emu.mx.array import MXArray

__all__ = ["from_gpt_oss", "pack_fp4", "unpack_fp4"]


def _uint8(a: jax.Array, argname: str) -> jax.Array:
    a = as_array(a, argname, "a uint8 array")
    if a.dtype != jnp.uint8:
        raise InvalidTypeError(f"{argname} must be a uint8 array, got dtype {a.dtype}")
    return a


def pack_fp4(codes: jax.Array, axis: int = -1) -> jax.Array:
    """Pack 4-bit codes two per byte along ``axis``: element 2j in the low nibble of byte j.

    Args:
        codes: uint8[..., 2n, ...] with values < 16 (the high nibble is ignored).
        axis: the axis to pack; its length must be even.

    Returns:
        uint8[..., n, ...]. This is the layout of the gpt-oss checkpoints' ``*_blocks`` tensors.

    Raises:
        InvalidTypeError: ``codes`` is not a uint8 array, or ``axis`` not an int.
        InvalidArgumentError: ``axis`` out of range, or an odd length along it.
    """
    codes = _uint8(codes, "codes")
    ax = check_axis(axis, tuple(codes.shape), "codes")
    if codes.shape[ax] % 2:
        raise InvalidArgumentError(
            f"codes has odd length {codes.shape[ax]} along axis {ax}; pack_fp4 needs pairs"
        )
    if codes.shape[ax] == 0:  # a strided slice of an empty axis is refused by lax; no pairs, no bytes
        return codes
    lo = jax.lax.slice_in_dim(codes, 0, None, 2, axis=ax) & 0xF
    hi = jax.lax.slice_in_dim(codes, 1, None, 2, axis=ax) & 0xF
    return lo | (hi << 4)


def unpack_fp4(packed: jax.Array, axis: int = -1) -> jax.Array:
    """Inverse of ``pack_fp4``: uint8[..., n, ...] -> uint8[..., 2n, ...] codes (low nibble first).

    Raises:
        InvalidTypeError: ``packed`` is not a uint8 array, or ``axis`` not an int.
        InvalidArgumentError: ``axis`` out of range.
    """
    packed = _uint8(packed, "packed")
    ax = check_axis(axis, tuple(packed.shape), "packed")
    pair = jnp.stack([packed & 0xF, packed >> 4], axis=ax + 1)
    shape = list(packed.shape)
    shape[ax] *= 2
    return pair.reshape(shape)


def from_gpt_oss(blocks: jax.Array, scales: jax.Array) -> MXArray:
    """Build an MXFP4 ``MXArray`` from a gpt-oss checkpoint pair.

    Args:
        blocks: uint8[..., G, 16], 32 packed E2M1 codes per group (``*_blocks`` in the checkpoint).
        scales: uint8[..., G], one E8M0 byte per group (``*_scales``).

    Returns:
        MXArray of shape [..., G * 32], fmt "e2m1", blocked by 32 along the last axis.

    Raises:
        InvalidTypeError: either is not a uint8 array.
        InvalidArgumentError: the shapes are not [..., G, 16] and [..., G].
    """
    blocks = _uint8(blocks, "blocks")
    scales = _uint8(scales, "scales")
    if blocks.ndim < 2 or blocks.shape[-1] != 16:
        raise InvalidArgumentError(
            f"blocks has shape {blocks.shape}; expected [..., G, 16] (32 packed E2M1 codes per group)"
        )
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise InvalidArgumentError(
            f"scales has shape {scales.shape} but blocks {blocks.shape} need {blocks.shape[:-1]}"
        )
    codes = unpack_fp4(blocks, axis=-1).reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)
    return MXArray(codes=codes, scales=scales, fmt="e2m1", axis=codes.ndim - 1, block_size=32)


