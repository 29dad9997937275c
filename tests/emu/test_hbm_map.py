"""The HBM address map: interleaving, the pseudo-channel decomposition, per-channel byte counts."""

import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.hbm_map import (
    bytes_per_pseudo_channel,
    channel_bytes,
    pseudo_channel_of,
    split_pseudo_channel,
)
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import Space


def brute_force(offset, rows, row_bytes, stride, granule, channels):
    out = np.zeros(channels, dtype=np.int64)
    for r in range(rows):
        addrs = np.arange(offset + r * stride, offset + r * stride + row_bytes)
        np.add.at(out, (addrs // granule) % channels, 1)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_channel_bytes_matches_a_byte_by_byte_count(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        granule = int(rng.choice([1, 2, 4, 16]))
        channels = int(rng.choice([1, 3, 4, 7, 12]))
        rows = int(rng.choice([1, rng.integers(1, 30), rng.integers(100, 600)]))
        row_bytes = int(rng.integers(1, 70))
        stride = row_bytes + int(rng.choice([0, rng.integers(0, 90)]))
        offset = int(rng.integers(0, 1000))
        got = channel_bytes(offset, rows, row_bytes, stride, granule, channels)
        assert got.tolist() == brute_force(offset, rows, row_bytes, stride, granule, channels).tolist()


def test_stacks_vary_fastest_in_the_pseudo_channel_index():
    spec = load_preset("jalapeno-v1")  # 6 stacks x 32 channels x 2 pseudo-channels, 256 B granules
    g = spec.hbm.interleave_bytes
    idx = pseudo_channel_of(np.arange(8) * g, spec)
    assert idx.tolist() == list(range(8))
    stack, channel, pc = split_pseudo_channel(idx, spec)
    assert stack.tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    assert channel.tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert pc.tolist() == [0] * 8
    assert split_pseudo_channel(spec.hbm.pseudo_channels - 1, spec) == (5, 31, 1)
    assert pseudo_channel_of(spec.hbm.pseudo_channels * g, spec) == 0  # wraps


def test_a_tile_spreads_evenly_or_lands_on_one_channel():
    spec = load_preset("jalapeno-v1")
    n, g = spec.hbm.pseudo_channels, spec.hbm.interleave_bytes
    whole_rounds = Tile(Space.HBM, 0, 4096, "u8", 4, n * g)  # 4 rows of one full round each
    assert set(bytes_per_pseudo_channel(whole_rounds, spec).tolist()) == {4 * g}
    one_channel = Tile(Space.HBM, 0, 3 * g, "u8", 1000, g, stride=n * g)  # every row on channel 3
    per = bytes_per_pseudo_channel(one_channel, spec)
    assert per[3] == 1000 * g and per.sum() == 1000 * g
    with pytest.raises(ValueError):
        per[0] = 1  # cached arrays are shared, so read-only


def test_large_strided_tiles_are_fast():
    import time

    spec = load_preset("jalapeno-v1")
    t0 = time.perf_counter()
    for j in range(200):  # odd strides: no short period to exploit
        tile = Tile(Space.HBM, 0, 12345 + j, "u8", 20000, 100, stride=4096 + 2 * j + 1)
        assert bytes_per_pseudo_channel(tile, spec).sum() == 20000 * 100
    assert time.perf_counter() - t0 < 2.0
