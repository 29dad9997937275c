"""HBM address map: which pseudo-channel serves each byte, and how many bytes a tile puts on each.

Stage: emulator (memory). The timing pass asks this module, once per DMA descriptor, how a strided
HBM tile spreads over the pseudo-channels; the answer decides which channels the transfer queues
on, so a stride that hits one channel runs at one channel's bandwidth.

The map: the address space is cut into granules of ``g = spec.hbm.interleave_bytes``; granule
``addr // g`` lives on global pseudo-channel ``i = (addr // g) % n_pc`` with
``n_pc = stacks * channels_per_stack * pseudo_channels_per_channel``. ``i`` decomposes with the
**stack varying fastest**, then the channel, then the pseudo-channel::

    stack = i % stacks
    channel = (i // stacks) % channels_per_stack
    pseudo_channel = i // (stacks * channels_per_stack)

so consecutive granules rotate over the stacks first (a short stream already uses every stack).

Everything is analytic: a byte range ``[a, b)`` holds ``F(b) - F(a)`` bytes on each channel, where
``F(x)`` (bytes of ``[0, x)`` per channel) is whole rounds of ``n_pc * g`` bytes plus one partial
round. A strided tile is a sum over rows, and since ``F(x + n_pc*g) = F(x) + g`` a row's share only
depends on its start modulo one round, so the row pattern repeats every ``round / gcd(stride,
round)`` rows: the work is bounded by that period, never by the tile's size.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.isa.program import Tile

__all__ = ["bytes_per_pseudo_channel", "channel_bytes", "pseudo_channel_of", "split_pseudo_channel"]


def pseudo_channel_of(addr: int | np.ndarray, spec: ChipSpec) -> int | np.ndarray:
    """Global pseudo-channel index (0 .. n_pc-1) of HBM byte address(es) ``addr``."""
    h = spec.hbm
    return (addr // h.interleave_bytes) % h.pseudo_channels


def split_pseudo_channel(index: int | np.ndarray, spec: ChipSpec) -> tuple:
    """(stack, channel, pseudo_channel) of a global pseudo-channel index; the stack varies fastest."""
    h = spec.hbm
    return (index % h.stacks, (index // h.stacks) % h.channels_per_stack,
            index // (h.stacks * h.channels_per_stack))


@functools.cache
def _channel_starts(g: int, n: int) -> np.ndarray:
    """int64[n]: ``c * g``, the first byte of channel ``c`` within one interleave round."""
    return np.arange(n, dtype=np.int64) * g


def _add_partial(out: np.ndarray, x: int, sign: int, g: int) -> None:
    """Add ``sign`` times the partial-round part of ``F(x)`` (``x`` < one round) to ``out``."""
    q, f = divmod(x, g)
    out[:q] += sign * g  # g on every channel before x's granule, the remainder on it
    if f:
        out[q] += sign * f


def _rows_share(starts: np.ndarray, row_bytes: int, g: int, n: int) -> np.ndarray:
    """Per-channel bytes of rows ``[s, s + row_bytes)`` for each ``s`` in ``starts`` (all < n*g).

    Uses ``F(s + rb) - F(s)``. The partial-round part of ``F(x)`` on channel ``c`` is
    ``clip(x % (n*g) - c*g, 0, g)``: for one or a few rows, slice updates; for more, one
    broadcast; for many rows a histogram of ``q, f = divmod(x % (n*g), g)`` (``g`` below ``q``,
    ``f`` at ``q``) sums them in O(rows + n).
    """
    period = n * g
    ends = starts + row_bytes
    whole = int((ends // period).sum()) * g  # starts are < period: only the ends wrap
    if len(starts) <= 8:  # the common case (a contiguous descriptor is one row)
        out = np.full(n, whole, dtype=np.int64)
        for s, e in zip(starts.tolist(), (ends % period).tolist(), strict=True):
            _add_partial(out, e, 1, g)
            _add_partial(out, s, -1, g)
        return out
    if len(starts) * n <= 1 << 16:
        cg = _channel_starts(g, n)
        return (np.minimum(np.maximum((ends % period)[:, None] - cg, 0), g).sum(0)
                - np.minimum(np.maximum(starts[:, None] - cg, 0), g).sum(0) + whole)
    out = np.full(n, whole, dtype=np.int64)
    for x, sign in (((ends % period), 1), (starts, -1)):
        q, f = np.divmod(x, g)
        # channel c gets g from every row with q > c: a suffix count of the histogram of q.
        out += sign * ((len(x) - np.cumsum(np.bincount(q, minlength=n))) * g
                       + np.bincount(q, weights=f, minlength=n).astype(np.int64))
    return out


@functools.lru_cache(maxsize=8192)
def channel_bytes(offset: int, rows: int, row_bytes: int, stride: int, granule: int,
                  channels: int) -> np.ndarray:
    """Bytes on each of ``channels`` pseudo-channels for ``rows`` rows of ``row_bytes`` at ``stride``.

    Args:
        offset: byte address of the first row (only ``offset % (channels*granule)`` matters).
        rows: number of rows.
        row_bytes: bytes per row.
        stride: bytes from one row's start to the next.
        granule: interleave granule in bytes.
        channels: number of pseudo-channels.

    Returns:
        int64[channels], read-only (cached; callers must not write it). Sums to ``rows*row_bytes``.
    """
    period = channels * granule
    offset %= period
    if rows == 1 or stride == row_bytes:  # one contiguous range: no arrays of row starts
        end = offset + rows * row_bytes
        out = np.full(channels, (end // period) * granule, dtype=np.int64)
        _add_partial(out, end % period, 1, granule)
        _add_partial(out, offset, -1, granule)
        out.setflags(write=False)
        return out
    # Row r starts at offset + r*stride; modulo one round that repeats every `cycle` rows.
    cycle = period // math.gcd(stride % period, period) if stride % period else 1
    starts = (offset + np.arange(min(rows, cycle), dtype=np.int64) * (stride % period)) % period
    out = _rows_share(starts, row_bytes, granule, channels)
    if rows > cycle:
        reps, rest = divmod(rows, cycle)
        out = out * reps + (_rows_share(starts[:rest], row_bytes, granule, channels) if rest else 0)
    out.setflags(write=False)
    return out


def bytes_per_pseudo_channel(tile: Tile, spec: ChipSpec) -> np.ndarray:
    """Bytes of a strided HBM ``tile`` that each pseudo-channel serves.

    Args:
        tile: an HBM tile (rows of ``tile.row_bytes`` bytes, ``tile.stride`` bytes apart).
        spec: the chip (``hbm.interleave_bytes`` and the pseudo-channel count).

    Returns:
        int64[n_pc] in bytes, indexed by global pseudo-channel (see the module docstring);
        read-only and shared between equal queries (cached by offset modulo one interleave round,
        rows, row bytes and stride).

    >>> from jalapeno_emu.chip import load_preset
    >>> from jalapeno_emu.isa.table import Space
    >>> spec = load_preset("tiny")  # 4 pseudo-channels, 256-byte granules
    >>> bytes_per_pseudo_channel(Tile(Space.HBM, 0, 0, "u8", 1, 1280), spec).tolist()
    [512, 256, 256, 256]
    """
    h = spec.hbm
    return channel_bytes(tile.offset, tile.rows, tile.row_bytes, tile.stride, h.interleave_bytes,
                         h.pseudo_channels)
