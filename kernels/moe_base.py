"""The moe family's shared base: the layout record every program's plan extends, and the helpers
its modules share (numerics, tile views, sizes, semaphore counters).

Stage: kernels (``moe`` family), below every moe module: ``moe`` (the kernel, its choice between
programs), ``moe_slots`` (the expert-slot program), ``moe_panel`` (its small-scratchpad form),
``moe_gather`` (the prefill program), ``moe_pack`` (HBM layouts) and ``moe_routing``. A helper
two of them need lives here, so no moe module imports another's private names.

**The layout record** (:class:`MoeLayout`): what every program's plan has and the packers, the
references and the HBM tensors read -- the shape (tokens, hidden, intermediate, experts, top_k,
shared experts), the expert slots, the intermediate slices and where each slice's chunk sits in a
packed expert, the router's column panels and the routing's static shape. ``MoePlan`` (slots),
``PanelPlan`` and ``GatherPlan`` extend it with their splits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.emu.unit_math import inorder_block_matmul
from jalapeno_emu.isa.builder import EngineHandle, KernelBuilder, MXTensor
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import DTYPES
from jalapeno_emu.lazy import LazyModule, lazy_jit

from .base import TensorSpec
from .moe_routing import RoutingDims

ml_dtypes = LazyModule("ml_dtypes")  # loaded on first use: importing it costs 0.5 s

jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

__all__ = [
    "BIAS_PARTS",
    "SWIGLU_ALPHA",
    "SWIGLU_LIMIT",
    "Counter",
    "MoeLayout",
    "Spec",
    "activation_reference",
    "aligned",
    "bf16_accumulate",
    "bias_parts",
    "column",
    "emit_activation",
    "expected_distinct_experts",
    "expert_rows_reference",
    "inorder_jit",
    "layout_bytes",
    "load_mx",
    "mx_cols",
    "mx_rows",
    "mx_specs",
    "quant_reference",
    "slices_of",
    "store_mx",
    "view",
    "weight_cols",
    "weight_specs",
    "widest",
]

SWIGLU_ALPHA = 1.702
"""gpt-oss swiglu: glu * sigmoid(alpha * glu)."""
SWIGLU_LIMIT = 7.0
"""gpt-oss swiglu_limit (config): glu <= 7, -7 <= linear <= 7."""
BIAS_PARTS = 3
"""A gate weight as hi + mid + lo BF16 parts: exact for FP32 (3 x 8 significand bits)."""

Spec = tuple[str, str, tuple[int, int]]
"""(name, dtype, [rows, cols]) of one scratchpad tile a plan sizes and a program allocates."""


@dataclass(frozen=True, kw_only=True)
class MoeLayout:
    """The layout every moe program's plan shares (see the module docstring).

    Attributes:
        t, h, i, e, k, s: tokens, hidden, intermediate, experts (0: a dense FFN), top_k, shared experts.
        d: expert slots (distinct experts the program serves; ``e`` for the gather program, which
            runs every expert; 0 for a dense FFN).
        slices: (start column, width) of each intermediate slice; widths multiples of 32.
        chunk_off, chunk_sizes: byte offset and size of each slice's chunk in one packed expert
            (the split layout: its gate|up segment).
        expert_bytes: bytes of one packed expert.
        expert_bias: the packed chunks carry gpt-oss's gate/up and down biases.
        router_parts, router_cols: R column panels of the router, E/R columns each (0, 0: none).
        rd: the routing's static shape (None for a dense FFN).
        down_blocks, down_off: the split layout's H blocks of the down projection and their
            offsets in a packed expert (``moe_pack``); empty for the per-slice layout.
    """

    t: int
    h: int
    i: int
    e: int
    k: int
    s: int
    d: int
    slices: tuple[tuple[int, int], ...]
    chunk_off: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    expert_bytes: int
    expert_bias: bool
    router_parts: int
    router_cols: int
    rd: RoutingDims | None
    down_blocks: tuple[tuple[int, int], ...] = ()
    down_off: tuple[int, ...] = ()

    @property
    def slice_max(self) -> int:
        """Widest slice."""
        return widest(self.slices)


def expected_distinct_experts(experts: int, top_k: int, tokens: int) -> float:
    """E * (1 - (1 - k/E)^T): distinct experts hit when each of T tokens picks k of E uniformly."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


@functools.lru_cache(maxsize=4096)  # the planners ask it of the same few layouts a million times
def widest(pieces: tuple[tuple[int, int], ...]) -> int:
    """The largest width among (start, width) pieces."""
    return max(w for _, w in pieces)


def slices_of(i: int, w: int) -> tuple[tuple[int, int], ...]:
    """(start, width) of the slices of width ``w`` over ``i`` intermediate columns (the last may be
    narrower)."""
    return tuple((c0, min(w, i - c0)) for c0 in range(0, i, w))


# --- sizes and views --------------------------------------------------------------------------
@functools.lru_cache(maxsize=1 << 16)  # the planners size the same few hundred tiles millions of times
def aligned(dtype: str, shape: tuple[int, int]) -> int:
    """Scratchpad bytes of a packed tile with the builder's 64-byte alignment."""
    return -(-shape[0] * DTYPES[dtype].row_bytes(shape[1]) // 64) * 64


def layout_bytes(specs: list[Spec] | tuple[Spec, ...]) -> int:
    """Bytes of consecutive aligned tiles."""
    return sum(aligned(dt, sh) for _, dt, sh in specs)


def mx_specs(name: str, fmt: str, rows: int, cols: int) -> list[Spec]:
    """Codes ``name.c`` and scales ``name.s`` of an MX tile blocked along columns (bf16: one plain tile)."""
    if fmt == "bf16":
        return [(name, "bf16", (rows, cols))]
    return [(f"{name}.c", fmt, (rows, cols)), (f"{name}.s", "e8m0", (rows, cols // 32))]


def view(t: Tile, off: int, dtype: str, rows: int, cols: int, stride: int = -1) -> Tile:
    """Another view of the bytes of tile ``t`` starting ``off`` bytes in."""
    return Tile(t.space, t.core, t.offset + off, dtype, rows, cols, stride)


def column(row: Tile, off: int = 0, n: int | None = None) -> Tile:
    """``n`` (default: all) elements of a packed f32 or i32 row, from element ``off``, viewed as an
    [n, 1] column (what a per-row weight or a gather index is)."""
    n = row.cols - off if n is None else n
    return Tile(row.space, row.core, row.offset + 4 * off, row.dtype, n, 1, 4)


def mx_rows(x: MXTensor | Tile, r0: int, rows: int) -> MXTensor | Tile:
    """Rows r0..r0+rows of a tile or of an MX tensor blocked along columns."""
    if isinstance(x, MXTensor):
        return MXTensor(x.codes.sub(r0, 0, rows, x.codes.cols), x.scales.sub(r0, 0, rows, x.scales.cols), 1)
    return x.sub(r0, 0, rows, x.cols)


def mx_cols(x: MXTensor | Tile, c0: int, cols: int) -> MXTensor | Tile:
    """Columns c0..c0+cols (block aligned for MX) of every row."""
    if isinstance(x, MXTensor):
        return x.sub(0, c0, x.codes.rows, cols)
    return x.sub(0, c0, x.rows, cols)


def _move_mx(move: Any, dst: MXTensor | Tile, src: MXTensor | Tile) -> None:
    if isinstance(dst, MXTensor):
        move(dst.codes, src.codes)
        move(dst.scales, src.scales)
    else:
        move(dst, src)


def load_mx(q: EngineHandle, dst: MXTensor | Tile, src: MXTensor | Tile) -> None:
    """dma.load of a tile, or of an MX tensor's codes then scales."""
    _move_mx(q.load, dst, src)


def store_mx(q: EngineHandle, dst: MXTensor | Tile, src: MXTensor | Tile) -> None:
    """dma.store of a tile, or of an MX tensor's codes then scales."""
    _move_mx(q.store, dst, src)


class Counter:
    """Semaphores of one scope and the signals issued on each so far, so that waits name the right
    counts (``signal`` returns the count the signal makes)."""

    def __init__(self, kb: KernelBuilder, prefix: str, names: tuple[str, ...]) -> None:
        self.sem = {n: kb.semaphore(f"{prefix}.{n}") for n in names}
        self.count = dict.fromkeys(names, 0)

    def signal(self, eng: EngineHandle, name: str) -> int:
        """``eng`` signals semaphore ``name``; the count it reaches."""
        eng.signal(self.sem[name])
        self.count[name] += 1
        return self.count[name]


# --- the vector unit's activation ---------------------------------------------------------------
def emit_activation(v: EngineHandle, ones: Tile | None, g_t: Tile, u_t: Tile, a_t: Tile,
                    activation: str) -> None:
    """a_t = act(g_t, u_t) on the vector unit (gpt-oss clamped SwiGLU, which clamps g_t and u_t in
    place and needs ``ones`` [1, >= w] of 1.0, or SiLU(gate) * up)."""
    if activation == "swiglu_oai":
        w = g_t.cols
        v.clamp(g_t, g_t, float("-inf"), SWIGLU_LIMIT)
        v.clamp(u_t, u_t, -SWIGLU_LIMIT, SWIGLU_LIMIT)
        v.scale(a_t, g_t, SWIGLU_ALPHA)
        v.sigmoid(a_t, a_t)
        v.mul(a_t, g_t, a_t)
        v.add(u_t, u_t, ones.sub(0, 0, 1, w))
        v.mul(a_t, a_t, u_t)
    else:
        v.silu(a_t, g_t)
        v.mul(a_t, a_t, u_t)


# --- reference numerics --------------------------------------------------------------------------
inorder_jit = lazy_jit(inorder_block_matmul)
"""The matrix unit's BF16 path: per 32-block FP32 sums in order (jitted ``inorder_block_matmul``)."""


@functools.partial(lazy_jit, static_argnames=("activation",))
def activation_reference(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
    """The expert activation in FP32, the vector unit's operations in its order."""
    if activation == "swiglu_oai":
        g = jnp.minimum(gate, jnp.float32(SWIGLU_LIMIT))
        u = jnp.clip(up, jnp.float32(-SWIGLU_LIMIT), jnp.float32(SWIGLU_LIMIT))
        glu = g * jax.nn.sigmoid(g * jnp.float32(SWIGLU_ALPHA))
        return glu * (u + jnp.float32(1))
    return (gate * jax.nn.sigmoid(gate)) * up


def bias_parts(w: np.ndarray) -> list[np.ndarray]:
    """FP32 weights [n] -> their hi, mid, lo BF16 parts (as float32), each remainder exact."""
    parts, rest = [], np.asarray(w, np.float32)
    for _ in range(BIAS_PARTS):
        part = rest.astype(ml_dtypes.bfloat16).astype(np.float32)
        parts.append(part)
        rest = (rest - part).astype(np.float32)
    return parts


def bf16_accumulate(acc: jax.Array, a: jax.Array, b: mx.MXArray) -> jax.Array:
    """acc + BF16 a @ MXFP4 b with the matrix unit's BF16 path (per-block sums, in order)."""
    return inorder_jit(a.astype(jnp.float32), mx.dequantize(b, jnp.float32), acc)


def weight_cols(g: mx.MXArray, u: mx.MXArray, c0: int, w: int) -> mx.MXArray:
    """[Wg[:, c0:c0+w] | Wu[:, c0:c0+w]] as one MXArray blocked along rows."""
    codes = np.concatenate([np.asarray(g.codes)[:, c0:c0 + w], np.asarray(u.codes)[:, c0:c0 + w]], axis=1)
    scales = np.concatenate([np.asarray(g.scales)[:, c0:c0 + w], np.asarray(u.scales)[:, c0:c0 + w]],
                            axis=1)
    return mx.MXArray(codes=codes, scales=scales, fmt="e2m1", axis=0, block_size=32)


def quant_reference(v: Any, act_fmt: str) -> Any:
    """Activations as the matrix unit takes them: BF16, or MX blocked along columns."""
    # mx takes the kernels' spelling ("fp8e4" is "e4m3": jalapeno_emu.mx.formats), so no table here.
    return v.astype(jnp.bfloat16) if act_fmt == "bf16" else mx.quantize(v, act_fmt, axis=1)


def _matmul_acc(acc: jax.Array, a: Any, b: mx.MXArray, act_fmt: str) -> jax.Array:
    return bf16_accumulate(acc, a, b) if act_fmt == "bf16" else mx.matmul_accumulate(acc, a, b)


def expert_rows_reference(p: MoeLayout, shape: dict[str, Any], xq_rows: Any, weights: tuple,
                          biases: tuple | None, gate_w: np.ndarray | None, slices: tuple[int, ...],
                          down_bias: bool) -> jax.Array:
    """FP32 [R, H] output rows of one expert over an intermediate range, a program's operations in
    its order: per slice gate|up (+ bias), activation, x gate weight, quantised; one down matmul
    over the range (K = the range); + the down-bias matmul (BF16 parts of the weights x the bias).

    Args:
        p: the plan (slices, hidden). shape: the kernel's shape (act_fmt, activation).
        xq_rows: [R, H] quantised x rows. weights: (gate [H, I], up [H, I], down [I, H]) MXArrays.
        biases: (gate, up, down) bias vectors or None. gate_w: [R] weights (None: weight 1).
        slices: indices of the slices of the range. down_bias: add the down-bias term.
    """
    act_fmt = shape["act_fmt"]
    g, u, dn = weights
    rows = xq_rows.codes.shape[0] if isinstance(xq_rows, mx.MXArray) else xq_rows.shape[0]
    acts, i0 = [], p.slices[slices[0]][0]
    for j in slices:
        c0, w = p.slices[j]
        gu = _matmul_acc(jnp.zeros((rows, 2 * w), jnp.float32), xq_rows, weight_cols(g, u, c0, w), act_fmt)
        if biases is not None:
            gu = gu + jnp.asarray(np.concatenate([biases[0][c0:c0 + w], biases[1][c0:c0 + w]]))[None]
        a = activation_reference(gu[:, :w], gu[:, w:], shape["activation"])
        if gate_w is not None:
            a = a * jnp.asarray(gate_w)[:, None]
        acts.append(quant_reference(a, act_fmt))
    i1 = p.slices[slices[-1]][0] + p.slices[slices[-1]][1]
    d_w = mx.MXArray(codes=np.asarray(dn.codes)[i0:i1], scales=np.asarray(dn.scales)[i0 // 32:i1 // 32],
                     fmt="e2m1", axis=0, block_size=32)
    out = _matmul_acc(jnp.zeros((rows, p.h), jnp.float32), _concat_cols(acts), d_w, act_fmt)
    if down_bias:
        wall = np.zeros((rows, 32), np.float32)
        weight = gate_w if gate_w is not None else np.ones(rows, np.float32)
        wall[:, :BIAS_PARTS] = np.stack(bias_parts(weight), axis=1)
        b2all = np.zeros((32, p.h), np.float32)
        b2all[:BIAS_PARTS] = biases[2]
        out = inorder_jit(jnp.asarray(wall), jnp.asarray(b2all), out)
    return out


def _concat_cols(parts: list[Any]) -> Any:
    if isinstance(parts[0], mx.MXArray):
        return mx.MXArray(codes=np.concatenate([np.asarray(q.codes) for q in parts], axis=1),
                          scales=np.concatenate([np.asarray(q.scales) for q in parts], axis=1),
                          fmt=parts[0].fmt, axis=1, block_size=32)
    return jnp.concatenate(parts, axis=1)


def weight_specs(p: MoeLayout) -> list[TensorSpec]:
    """The weights every moe program reads, in its allocation order: the router panels [parts *
    hidden, cols] (+ its bias [1, E] and score bias [1, E]) and the packed experts [E, bytes]
    when there are routed experts; the packed shared experts [S, bytes] when there are any."""
    out: list[TensorSpec] = []
    h, e, rd = p.h, p.e, p.rd
    if e:
        out.append(TensorSpec("router", (p.router_parts * h, p.router_cols), "bf16", "weight"))
        if rd.router == "softmax_topk":
            out.append(TensorSpec("router_bias", (1, e), "bf16", "weight"))
        if rd.score_bias:
            out.append(TensorSpec("score_bias", (1, e), "f32", "weight"))
        out.append(TensorSpec("experts", (e, p.expert_bytes), "u8", "weight"))
    if p.s:
        out.append(TensorSpec("shared", (p.s, p.expert_bytes), "u8", "weight"))
    return out
