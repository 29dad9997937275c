"""``MXArray``: block-scaled data as a JAX pytree (codes + E8M0 scales + static format info)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jalapeno_emu.errors import InvalidArgumentError, InvalidTypeError
from jalapeno_emu.mx._validate import check_axis, check_block_size, check_int, describe, is_array
from jalapeno_emu.mx.formats import FORMATS, ElementFormat, element_format

__all__ = ["MXArray"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True, kw_only=True)
class MXArray:
    """A tensor in an OCP MX format.

    Attributes:
        codes: uint8[*shape], one element code per value; the element's bit pattern in the low bits
            (two's complement for int8).
        scales: uint8[*shape with shape[axis] // block_size], E8M0 bytes (2^(b-127); 0xFF = NaN).
        fmt: element format name ("e2m1", "e2m3", "e3m2", "e4m3", "e5m2", "int8"); the ISA
            spellings ("fp4", "fp8e4", ...) are accepted and stored as these.
        axis: the blocked axis (non-negative after ``quantize``).
        block_size: elements per shared scale along ``axis``.

    ``codes`` and ``scales`` are pytree leaves, the rest is static, so an MXArray passes through
    ``jax.jit``, ``vmap`` (vmap the leading axis; ``axis`` counts the unbatched dimensions) and
    ``lax.scan`` like any array pair.

    Construction checks the static fields (and normalises ``fmt``); ``validate`` checks the
    leaves, which JAX may replace by placeholders when it rebuilds the tree (so they cannot be
    checked here).
    """

    codes: Any
    scales: Any
    fmt: str = field(default="e2m1", metadata={"static": True})
    axis: int = field(default=-1, metadata={"static": True})
    block_size: int = field(default=32, metadata={"static": True})

    def __post_init__(self) -> None:
        # Runs on every construction, JAX's tree rebuilding included: the fast path is one type
        # test and one dict lookup per field.
        if not (type(self.fmt) is str and self.fmt in FORMATS):
            object.__setattr__(self, "fmt", element_format(self.fmt, argname="MXArray fmt").name)
        if type(self.axis) is not int:
            object.__setattr__(self, "axis", check_int(self.axis, "MXArray axis"))
        if type(self.block_size) is not int or self.block_size < 1:
            object.__setattr__(self, "block_size", check_int(self.block_size, "MXArray block_size",
                                                             minimum=1))

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
            InvalidTypeError: a leaf that is not an array, or not uint8.
            InvalidArgumentError: naming ``argname`` and what disagrees.
        """
        element_format(self.fmt, argname=f"{argname}.fmt")
        for name, leaf in (("codes", self.codes), ("scales", self.scales)):
            if not is_array(leaf):
                raise InvalidTypeError(
                    f"{argname}.{name} must be a uint8 array (jax or numpy), got {describe(leaf)}"
                )
        codes_shape, scales_shape = tuple(self.codes.shape), tuple(self.scales.shape)
        if not codes_shape:
            raise InvalidArgumentError(f"{argname}.codes is 0-d; an MXArray needs a blocked axis")
        ax = check_axis(self.axis, codes_shape, f"{argname}.codes", argname=f"{argname}.axis")
        check_block_size(self.block_size, f"{argname}.block_size")
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
            if leaf.dtype != np.uint8:
                raise InvalidTypeError(f"{argname}.{name} must be uint8, got {leaf.dtype}")
        return self
