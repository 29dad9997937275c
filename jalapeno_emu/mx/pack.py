"""Packing of 4-bit codes two per byte, and import of gpt-oss checkpoint tensors."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jalapeno_emu.errors import InvalidArgumentError, InvalidTypeError
from jalapeno_emu.mx.array import MXArray

__all__ = ["from_gpt_oss", "pack_fp4", "unpack_fp4"]


def _uint8(a: jax.Array, argname: str) -> jax.Array:
    a = jnp.asarray(a)
    if a.dtype != jnp.uint8:
        raise InvalidTypeError(f"{argname} must be uint8, got {a.dtype}")
    return a


def _axis(a: jax.Array, axis: int, argname: str) -> int:
    if a.ndim == 0 or not -a.ndim <= axis < a.ndim:
        raise InvalidArgumentError(f"axis={axis} is out of range for {argname} of shape {a.shape}")
    return axis % a.ndim


def pack_fp4(codes: jax.Array, axis: int = -1) -> jax.Array:
    """Pack 4-bit codes two per byte along ``axis``: element 2j in the low nibble of byte j.

    Args:
        codes: uint8[..., 2n, ...] with values < 16 (the high nibble is ignored).
        axis: the axis to pack; its length must be even.

    Returns:
        uint8[..., n, ...]. This is the layout of the gpt-oss checkpoints' ``*_blocks`` tensors.
    """
    codes = _uint8(codes, "codes")
    ax = _axis(codes, axis, "codes")
    if codes.shape[ax] % 2:
        raise InvalidArgumentError(
            f"codes has odd length {codes.shape[ax]} along axis {ax}; pack_fp4 needs pairs"
        )
    lo = jax.lax.slice_in_dim(codes, 0, None, 2, axis=ax) & 0xF
    hi = jax.lax.slice_in_dim(codes, 1, None, 2, axis=ax) & 0xF
    return lo | (hi << 4)


def unpack_fp4(packed: jax.Array, axis: int = -1) -> jax.Array:
    """Inverse of ``pack_fp4``: uint8[..., n, ...] -> uint8[..., 2n, ...] codes (low nibble first)."""
    packed = _uint8(packed, "packed")
    ax = _axis(packed, axis, "packed")
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


