"""Tiles as bytes: reading and writing a strided tile of a flat byte buffer, and the values its
bytes hold.

Stage: emulator (memory), for ``functional.py``: every instruction's operands are tiles of the
flat uint8 arrays that back memory (``memory_layout.py``), located by a byte offset that may be a
traced value, so one compiled function serves a tile at any address. Nothing here loops: a while
loop per strided tile doubled the XLA compile time of the functions that read or write one, and
a demo's first run compiles about 300 of them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import DTYPES

__all__ = ["decode", "encode", "land_all", "read_bytes", "write_bytes"]

_SPAN_READ_MAX_BYTES = 1 << 16
"""A strided read whose first-to-last byte span is at most this is sliced whole and reshaped
(a copy of the span: cheap at this size, and a gather of narrow rows runs 4x slower); a wider
one gathers its rows."""
_ROWS = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(), start_index_map=(0,))
_ROWS_BACK = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(),
                                         scatter_dims_to_operand_dims=(0,))


def _row_starts(off: Any, rows: int, stride: int) -> jax.Array:
    """int32[rows, 1]: the first byte of each row of a tile at byte ``off``."""
    return (off + jnp.arange(rows, dtype=jnp.int32) * stride)[:, None]


def read_bytes(buf: jax.Array, off: Any, tile: Tile) -> jax.Array:
    """uint8[rows, row_bytes] of a strided tile at byte ``off`` (an int or a traced int32) of
    ``buf`` (uint8[n])."""
    rb, rows, stride = tile.row_bytes, tile.rows, tile.stride
    if tile.contiguous:
        return lax.dynamic_slice(buf, (off,), (rows * rb,)).reshape(rows, rb)
    span = (rows - 1) * stride + rb
    if span <= _SPAN_READ_MAX_BYTES:
        flat = jnp.pad(lax.dynamic_slice(buf, (off,), (span,)), (0, rows * stride - span))
        return flat.reshape(rows, stride)[:, :rb]
    return lax.gather(buf, _row_starts(off, rows, stride), _ROWS, (rb,), indices_are_sorted=True,
                      unique_indices=True, mode=lax.GatherScatterMode.CLIP)


def write_bytes(buf: jax.Array, off: Any, tile: Tile, data: jax.Array) -> jax.Array:
    """``buf`` (uint8[n]) with the tile at byte ``off`` set to ``data`` (rows x row_bytes bytes,
    any shape holding that many; other dtypes are cast to uint8); the bytes between its rows are
    kept."""
    rb, rows, stride = tile.row_bytes, tile.rows, tile.stride
    data = data.astype(jnp.uint8).reshape(rows, rb)
    if tile.contiguous:
        return lax.dynamic_update_slice(buf, data.reshape(-1), (off,))
    # Row windows scattered in place (the rows of a tile never overlap: stride >= row bytes).
    return lax.scatter(buf, _row_starts(off, rows, stride), data, _ROWS_BACK,
                       indices_are_sorted=True, unique_indices=True, mode=lax.GatherScatterMode.CLIP)


def land_all(buf: jax.Array, offs: jax.Array, tile: Tile, data: jax.Array) -> jax.Array:
    """``write_bytes`` of every member of a batch at once: ``offs`` int32[size] and ``data``
    [size, ...] (each member's bytes). Only for members whose writes do not overlap, except
    repeated identical members (a padded batch): a scatter lands overlapping windows in no set
    order."""
    rb, rows, stride = tile.row_bytes, tile.rows, tile.stride
    size = offs.shape[0]
    if tile.contiguous:
        starts, data = offs[:, None], data.astype(jnp.uint8).reshape(size, rows * rb)
    else:
        starts = (offs[:, None] + jnp.arange(rows, dtype=jnp.int32)[None, :] * stride).reshape(-1, 1)
        data = data.astype(jnp.uint8).reshape(size * rows, rb)
    return lax.scatter(buf, starts, data, _ROWS_BACK, indices_are_sorted=False, unique_indices=False,
                       mode=lax.GatherScatterMode.CLIP)


def decode(raw: jax.Array, dtype: str) -> jax.Array:
    """Values [rows, cols] from bytes [rows, row_bytes]: floats/ints typed, MX codes as uint8."""
    dt = DTYPES[dtype]
    if dtype == "fp4":
        return jnp.stack([raw & 0xF, raw >> 4], axis=-1).reshape(raw.shape[0], -1)
    if dt.bits == 8:
        return raw
    rows = raw.shape[0]
    jdt = jnp.dtype(dt.numpy)
    return lax.bitcast_convert_type(raw.reshape(rows, -1, dt.bits // 8), jdt)


def encode(values: jax.Array, dtype: str) -> jax.Array:
    """Bytes [rows, row_bytes] of values [rows, cols] (floats are rounded RNE to ``dtype``)."""
    dt = DTYPES[dtype]
    if dtype == "fp4":
        v = values.astype(jnp.uint8)
        return (v[:, 0::2] & 0xF) | ((v[:, 1::2] & 0xF) << 4)
    if dt.bits == 8:
        return values.astype(jnp.uint8)
    rows = values.shape[0]
    raw = lax.bitcast_convert_type(values.astype(jnp.dtype(dt.numpy)), jnp.uint8)
    return raw.reshape(rows, -1)
