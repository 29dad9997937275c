"""Tiles as bytes (``emu.tile_bytes``): every path of reading, writing and landing a tile's bytes,
against numpy."""

import jax.numpy as jnp
import numpy as np

from jalapeno_emu.emu import tile_bytes
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import Space


def test_strided_tiles_read_and_write_exactly_their_bytes():
    """Every path of the byte movers against numpy: contiguous, a short span sliced whole, a long
    span gathered by rows, and a batch's rows scattered at once (a repeated last member)."""
    rng = np.random.default_rng(2)
    mem = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    for rows, cols, stride, off in [(4, 64, -1, 100), (8, 16, 96, 7), (128, 16, 512, 3),
                                    (64, 64, 2048, 1000), (1, 300, -1, 5)]:
        t = Tile(Space.SRAM, 0, 0, "u8", rows, cols, stride)
        starts = off + np.arange(rows) * t.stride
        want = np.stack([mem[s:s + t.row_bytes] for s in starts])
        got = np.asarray(tile_bytes.read_bytes(jnp.asarray(mem), jnp.int32(off), t))
        assert np.array_equal(got, want), (rows, cols, stride)
        data = rng.integers(0, 256, (rows, t.row_bytes), dtype=np.uint8)
        expect = mem.copy()
        for s, row in zip(starts, data, strict=True):
            expect[s:s + t.row_bytes] = row
        got = np.asarray(tile_bytes.write_bytes(jnp.asarray(mem), jnp.int32(off), t, jnp.asarray(data)))
        assert np.array_equal(got, expect), (rows, cols, stride)
        span = (rows - 1) * t.stride + t.row_bytes
        offs = np.array([off, off + span + 3, off + 2 * span + 9, off + 2 * span + 9], np.int32)
        batch = rng.integers(0, 256, (4, rows, t.row_bytes), dtype=np.uint8)
        batch[3] = batch[2]
        expect = mem.copy()
        for o, member in zip(offs, batch, strict=True):
            for i, row in enumerate(member):
                expect[o + i * t.stride:o + i * t.stride + t.row_bytes] = row
        got = np.asarray(tile_bytes.land_all(jnp.asarray(mem), jnp.asarray(offs), t, jnp.asarray(batch)))
        assert np.array_equal(got, expect), (rows, cols, stride)
