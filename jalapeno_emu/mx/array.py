"""``MXArray``: block-scaled data as a JAX pytree (codes + E8M0 scales + static format info)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.mx.formats import ElementFormat, element_format

__all__ = ["MXArray"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True, kw_only=True)
class MXArray:
    """A tensor in an OCP MX format.

    Attributes:
        codes: uint8[*shape], one element code per value; the element's bit pattern in the low bits
            (two's complement for int8).
        scales: uint8[*shape with shape[axis] // block_size], E8M0 bytes (2^(b-127); 0xFF = NaN).
        fmt: element format name ("e2m1", "e2m3", "e3m2", "e4m3", "e5m2", "int8").
        axis: the blocked axis (non-negative after ``quantize``).
        block_size: elements per shared scale along ``axis``.

    ``codes`` and ``scales`` are pytree leaves, the rest is static, so an MXArray passes through
    ``jax.jit``, ``vmap`` (vmap the leading axis; ``axis`` counts the unbatched dimensions) and
    ``lax.scan`` like any array pair.
    """

    codes: Any
    scales: Any
    fmt: str = field(default="e2m1", metadata={"static": True})
    axis: int = field(default=-1, metadata={"static": True})
    block_size: int = field(default=32, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape (that of ``codes``)."""
        return tuple(self.codes.shape)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.codes.shape)

    @property
    def element_format(self) -> ElementFormat:
        """The ``ElementFormat`` row of ``fmt``."""
        return element_format(self.fmt)

    @property
    def norm_axis(self) -> int:
        """``axis`` as a non-negative index."""
        return self.axis % self.ndim if self.ndim else 0

    @property
    def packed_bytes(self) -> int:
        """Bytes to store this array packed: element bits (4, 6 or 8 each) plus one byte per scale."""
        n = math.prod(self.shape)
        return (n * self.element_format.bits + 7) // 8 + math.prod(self.scales.shape)

    def validate(self, *, argname: str = "q") -> MXArray:
        """Check that fmt, axis, block size and the two shapes agree; return self.

        Raises:
            InvalidArgumentError: naming ``argname`` and what disagrees.
        """
        element_format(self.fmt, argname=f"{argname}.fmt")
        codes_shape, scales_shape = tuple(self.codes.shape), tuple(self.scales.shape)
        if not codes_shape:
            raise InvalidArgumentError(f"{argname}.codes is 0-d; an MXArray needs a blocked axis")
        if not -len(codes_shape) <= self.axis < len(codes_shape):
            raise InvalidArgumentError(
                f"{argname}.axis={self.axis} is out of range for codes of shape {codes_shape}"
            )
        if not isinstance(self.block_size, int | np.integer) or self.block_size <= 0:
            raise InvalidArgumentError(f"{argname}.block_size={self.block_size!r} must be >= 1")
        ax = self.norm_axis
        if codes_shape[ax] % self.block_size:
            raise InvalidArgumentError(
                f"{argname}.block_size={self.block_size} does not divide axis {ax} "
                f"of length {codes_shape[ax]}"
            )
        want = (*codes_shape[:ax], codes_shape[ax] // self.block_size, *codes_shape[ax + 1 :])
        if scales_shape != want:
            raise InvalidArgumentError(
                f"{argname}.scales has shape {scales_shape}; codes {codes_shape} blocked by "
                f"{self.block_size} along axis {ax} need {want}"
            )
        for name, leaf in (("codes", self.codes), ("scales", self.scales)):
            if np.dtype(leaf.dtype) != np.uint8:
                raise InvalidArgumentError(f"{argname}.{name} must be uint8, got {leaf.dtype}")
        return self
