"""The moe kernel's HBM layouts: the packed expert tables and the router panels.

Stage: kernels (``moe`` family). Host-side packing for the model bindings and the tests, and the
SRAM views the kernel takes of one packed chunk.

**Packed expert table** ("experts" [E, expert_bytes] u8, "shared" [S, expert_bytes] u8): for
each expert, for each intermediate slice j (columns c0..c0+w of I) one contiguous chunk, in order:

    [H, 2w]      fp4 codes of [Wg[:, c0:c0+w] | Wu[:, c0:c0+w]] (row-major, two per byte, low nibble first)
    [H/32, 2w]   their E8M0 scales
    [w, H]       fp4 codes of Wd[c0:c0+w, :]
    [w/32, H]    their scales
    [1, 2w]      bf16 [gate_bias[c0:c0+w] | up_bias[c0:c0+w]]       (expert_bias only)
    [1, H]       bf16 down_bias, in chunk 0 only                     (expert_bias only)

1.59375 * H * I bytes per expert (4.25 bits per weight), plus 4 I + 2 H with biases. A chunk is
what one work item gathers, so an expert's biases travel with its weights: only the experts a
token chose are read. The router is stored as R column panels ("router" [R*H, E/R] bf16, panel
r = Wr[:, r*E/R:(r+1)*E/R]).

**Split layout** (grouping=gather plans, which have ``down_blocks``): the down projection is
stored by H blocks instead of with each slice, because the gather program multiplies all of an
expert's intermediate columns by one H block at a time:

    per slice j:      [H, 2w] gate|up codes, [H/32, 2w] scales, [1, 2w] bf16 gate|up bias (bias only)
    per H block hb:   [I, hw] fp4 codes of Wd[:, hb], [I/32, hw] scales
    once:             [1, H] bf16 down bias (bias only)

Same bytes per expert; ``chunk_off``/``chunk_sizes`` then locate the slices' gate|up segments,
``down_off`` the H blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.isa.builder import MXTensor
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.lazy import LazyModule

ml_dtypes = LazyModule("ml_dtypes")  # loaded on first use: importing it costs 0.5 s

__all__ = ["ChunkViews", "chunk_bytes", "chunk_views", "gu_bytes", "pack_experts", "router_logical",
           "router_panels", "split_layout", "unpack_expert_biases", "unpack_experts"]


def chunk_bytes(h: int, w: int, bias: bool = False, first: bool = False) -> int:
    """Bytes of one packed (expert, slice) chunk of width ``w`` (``first``: slice 0, which holds
    the down bias when ``bias``)."""
    base = h * w + (h // 32) * 2 * w + w * h // 2 + (w // 32) * h
    return base + (4 * w if bias else 0) + (2 * h if bias and first else 0)


@dataclass(frozen=True)
class ChunkViews:
    """SRAM views of one packed chunk: ``gu`` [H, 2w] and ``down`` [w, H] MXFP4 tensors,
    ``gu_bias`` [1, 2w] and ``down_bias`` [1, H] bf16 tiles (None without biases / past chunk 0)."""

    gu: MXTensor
    down: MXTensor
    gu_bias: Tile | None
    down_bias: Tile | None


def _view(t: Tile, off: int, dtype: str, rows: int, cols: int) -> Tile:
    return Tile(t.space, t.core, t.offset + off, dtype, rows, cols)


def gu_bytes(h: int, w: int) -> int:
    """Bytes of a chunk's leading gate|up segment (codes and scales of [H, 2w]), what its gate|up
    matmul reads; the down projection and the biases follow it."""
    return h * w + (h // 32) * 2 * w


def chunk_views(buf: Tile, h: int, w: int, bias: bool = False, first: bool = False) -> ChunkViews:
    """The views of the chunk (layout in the module docstring) that starts at ``buf``'s offset."""
    o1 = h * w
    o2 = o1 + (h // 32) * 2 * w
    o3 = o2 + w * h // 2
    o4 = o3 + (w // 32) * h
    gu = MXTensor(_view(buf, 0, "fp4", h, 2 * w), _view(buf, o1, "e8m0", h // 32, 2 * w), 0)
    dn = MXTensor(_view(buf, o2, "fp4", w, h), _view(buf, o3, "e8m0", w // 32, h), 0)
    gub = _view(buf, o4, "bf16", 1, 2 * w) if bias else None
    db = _view(buf, o4 + 4 * w, "bf16", 1, h) if bias and first else None
    return ChunkViews(gu, dn, gub, db)


def _fp4_bytes(codes: np.ndarray) -> np.ndarray:
    """Row-major fp4 codes [R, C] -> bytes [R * C / 2], two per byte, low nibble first."""
    c = np.asarray(codes, np.uint8)
    return ((c[:, 0::2] & 0xF) | ((c[:, 1::2] & 0xF) << 4)).reshape(-1)


def _fp4_codes(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    raw = np.asarray(raw, np.uint8).reshape(rows, cols // 2)
    return np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(rows, cols)


def _bf16_bytes(values: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values).astype(ml_dtypes.bfloat16)).view(np.uint8).reshape(-1)


def split_layout(h: int, i: int, slices: tuple[tuple[int, int], ...],
                 down_blocks: tuple[tuple[int, int], ...],
                 bias: bool) -> tuple[list[int], list[int], list[int], int]:
    """The split layout's (gate|up segment offsets, their sizes, H block offsets, expert bytes)."""
    sizes = [h * w + (h // 32) * 2 * w + (4 * w if bias else 0) for _, w in slices]
    gu_off = np.cumsum([0, *sizes]).tolist()
    blocks = [i * hw // 2 + (i // 32) * hw for _, hw in down_blocks]
    down_off = (gu_off[-1] + np.cumsum([0, *blocks])).tolist()
    return gu_off[:-1], sizes, down_off[:-1], down_off[-1] + (2 * h if bias else 0)


def pack_experts(gate: list[mx.MXArray], up: list[mx.MXArray], down: list[mx.MXArray], plan: Any,
                 gate_bias: list[Any] | None = None, up_bias: list[Any] | None = None,
                 down_bias: list[Any] | None = None) -> np.ndarray:
    """Experts' MXFP4 weights (and biases) -> the packed table, uint8 [n, expert_bytes].

    Args:
        gate, up: per expert an MXArray [H, I] blocked along H (axis 0).
        down: per expert an MXArray [I, H] blocked along I (axis 0).
        plan: the launch's ``MoePlan`` (slices, offsets, whether it carries biases).
        gate_bias, up_bias: per expert [I] values (stored BF16); needed iff ``plan.expert_bias``.
        down_bias: per expert [H] values (stored BF16); needed iff ``plan.expert_bias``.
    """
    if plan.expert_bias != (gate_bias is not None and up_bias is not None and down_bias is not None):
        raise ValueError(f"the plan has expert_bias={plan.expert_bias}: pass gate_bias, up_bias and "
                         "down_bias exactly when it is True")
    n = len(gate)
    out = np.zeros((n, plan.expert_bytes), np.uint8)
    if getattr(plan, "down_blocks", ()):
        for e, (g, u, dn) in enumerate(zip(gate, up, down, strict=True)):
            biases = (gate_bias[e], up_bias[e], down_bias[e]) if plan.expert_bias else None
            out[e] = _pack_split(g, u, dn, biases, plan)
        return out
    for e, (g, u, dn) in enumerate(zip(gate, up, down, strict=True)):
        gc, gs, uc, us = (np.asarray(a) for a in (g.codes, g.scales, u.codes, u.scales))
        dc, ds = np.asarray(dn.codes), np.asarray(dn.scales)
        parts = []
        for j, (c0, w) in enumerate(plan.slices):
            parts += [_fp4_bytes(np.concatenate([gc[:, c0:c0 + w], uc[:, c0:c0 + w]], axis=1)),
                      np.concatenate([gs[:, c0:c0 + w], us[:, c0:c0 + w]], axis=1).reshape(-1),
                      _fp4_bytes(dc[c0:c0 + w]), ds[c0 // 32:(c0 + w) // 32].reshape(-1)]
            if plan.expert_bias:
                gb, ub = np.asarray(gate_bias[e]), np.asarray(up_bias[e])
                parts.append(_bf16_bytes(np.concatenate([gb[c0:c0 + w], ub[c0:c0 + w]])))
                if j == 0:
                    parts.append(_bf16_bytes(down_bias[e]))
        out[e] = np.concatenate(parts)
    return out


def _pack_split(g: mx.MXArray, u: mx.MXArray, dn: mx.MXArray, biases: tuple | None, plan: Any) -> np.ndarray:
    gc, gs, uc, us = (np.asarray(a) for a in (g.codes, g.scales, u.codes, u.scales))
    dc, ds = np.asarray(dn.codes), np.asarray(dn.scales)
    parts = []
    for c0, w in plan.slices:
        parts += [_fp4_bytes(np.concatenate([gc[:, c0:c0 + w], uc[:, c0:c0 + w]], axis=1)),
                  np.concatenate([gs[:, c0:c0 + w], us[:, c0:c0 + w]], axis=1).reshape(-1)]
        if biases is not None:
            gb, ub = np.asarray(biases[0]), np.asarray(biases[1])
            parts.append(_bf16_bytes(np.concatenate([gb[c0:c0 + w], ub[c0:c0 + w]])))
    for h0, hw in plan.down_blocks:
        parts += [_fp4_bytes(dc[:, h0:h0 + hw]), np.ascontiguousarray(ds[:, h0:h0 + hw]).reshape(-1)]
    if biases is not None:
        parts.append(_bf16_bytes(biases[2]))
    return np.concatenate(parts)


def _unpack_split(row: np.ndarray, plan: Any) -> tuple[tuple[mx.MXArray, ...], tuple[np.ndarray, ...]]:
    h, i = plan.h, plan.i
    gc, gs = np.zeros((h, i), np.uint8), np.zeros((h // 32, i), np.uint8)
    uc, us = np.zeros_like(gc), np.zeros_like(gs)
    dc, ds = np.zeros((i, h), np.uint8), np.zeros((i // 32, h), np.uint8)
    gb, ub, db = np.zeros(i, np.float32), np.zeros(i, np.float32), np.zeros(h, np.float32)
    for (c0, w), off in zip(plan.slices, plan.chunk_off, strict=True):
        gu = _fp4_codes(row[off:off + h * w], h, 2 * w)
        gus = row[off + h * w:off + h * w + (h // 32) * 2 * w].reshape(h // 32, 2 * w)
        gc[:, c0:c0 + w], uc[:, c0:c0 + w] = gu[:, :w], gu[:, w:]
        gs[:, c0:c0 + w], us[:, c0:c0 + w] = gus[:, :w], gus[:, w:]
        if plan.expert_bias:
            o = off + h * w + (h // 32) * 2 * w
            vals = row[o:o + 4 * w].copy().view(ml_dtypes.bfloat16).astype(np.float32)
            gb[c0:c0 + w], ub[c0:c0 + w] = vals[:w], vals[w:]
    for (h0, hw), off in zip(plan.down_blocks, plan.down_off, strict=True):
        dc[:, h0:h0 + hw] = _fp4_codes(row[off:off + i * hw // 2], i, hw)
        ds[:, h0:h0 + hw] = row[off + i * hw // 2:off + i * hw // 2 + (i // 32) * hw].reshape(i // 32, hw)
    if plan.expert_bias:
        db[:] = row[plan.expert_bytes - 2 * h:].copy().view(ml_dtypes.bfloat16).astype(np.float32)
    weights = tuple(mx.MXArray(codes=c, scales=sc, fmt="e2m1", axis=0, block_size=32)
                    for c, sc in ((gc, gs), (uc, us), (dc, ds)))
    return weights, (gb, ub, db)


def unpack_experts(table: np.ndarray, plan: Any) -> list[tuple[mx.MXArray, mx.MXArray, mx.MXArray]]:
    """The packed table -> per expert (gate [H, I], up [H, I], down [I, H]) MXFP4 MXArrays."""
    h, i = plan.h, plan.i
    rows = np.asarray(table, np.uint8).reshape(-1, plan.expert_bytes)
    if getattr(plan, "down_blocks", ()):
        return [_unpack_split(row, plan)[0] for row in rows]
    out = []
    for row in rows:
        gc, gs = np.zeros((h, i), np.uint8), np.zeros((h // 32, i), np.uint8)
        uc, us = np.zeros_like(gc), np.zeros_like(gs)
        dc, ds = np.zeros((i, h), np.uint8), np.zeros((i // 32, h), np.uint8)
        for (c0, w), off in zip(plan.slices, plan.chunk_off, strict=True):
            o = off
            gu = _fp4_codes(row[o:o + h * w], h, 2 * w)
            o += h * w
            gus = row[o:o + (h // 32) * 2 * w].reshape(h // 32, 2 * w)
            o += (h // 32) * 2 * w
            gc[:, c0:c0 + w], uc[:, c0:c0 + w] = gu[:, :w], gu[:, w:]
            gs[:, c0:c0 + w], us[:, c0:c0 + w] = gus[:, :w], gus[:, w:]
            dc[c0:c0 + w] = _fp4_codes(row[o:o + w * h // 2], w, h)
            o += w * h // 2
            ds[c0 // 32:(c0 + w) // 32] = row[o:o + (w // 32) * h].reshape(w // 32, h)
        out.append(tuple(mx.MXArray(codes=c, scales=sc, fmt="e2m1", axis=0, block_size=32)
                         for c, sc in ((gc, gs), (uc, us), (dc, ds))))
    return out


def unpack_expert_biases(table: np.ndarray, plan: Any) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The packed table -> per expert (gate_bias [I], up_bias [I], down_bias [H]) float32 (from
    BF16); needs ``plan.expert_bias``."""
    h, i = plan.h, plan.i
    rows = np.asarray(table, np.uint8).reshape(-1, plan.expert_bytes)
    if getattr(plan, "down_blocks", ()):
        return [_unpack_split(row, plan)[1] for row in rows]
    out = []
    for row in rows:
        gb, ub = np.zeros(i, np.float32), np.zeros(i, np.float32)
        db = np.zeros(h, np.float32)
        for j, ((c0, w), off) in enumerate(zip(plan.slices, plan.chunk_off, strict=True)):
            o = off + chunk_bytes(h, w)
            vals = row[o:o + 4 * w].copy().view(ml_dtypes.bfloat16).astype(np.float32)
            gb[c0:c0 + w], ub[c0:c0 + w] = vals[:w], vals[w:]
            if j == 0:
                db[:] = row[o + 4 * w:o + 4 * w + 2 * h].copy().view(ml_dtypes.bfloat16).astype(np.float32)
        out.append((gb, ub, db))
    return out


def router_panels(wr: np.ndarray, plan: Any) -> np.ndarray:
    """Wr [H, E] -> the HBM layout [R*H, E/R] (column panels stacked)."""
    ew = plan.router_cols
    return np.concatenate([wr[:, r * ew:(r + 1) * ew] for r in range(plan.router_parts)], axis=0)


def router_logical(panels: np.ndarray, plan: Any) -> np.ndarray:
    """The HBM layout [R*H, E/R] -> Wr [H, E]."""
    h = plan.h
    return np.concatenate([panels[r * h:(r + 1) * h] for r in range(plan.router_parts)], axis=1)
