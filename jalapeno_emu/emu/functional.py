"""The functional pass: execute a Program's instructions in JAX and return the memory contents.

Stage: emulator. Memory is byte-addressed, exactly as the chip sees it: one flat uint8 buffer per
HBM allocation (so only what is allocated is backed by host memory), one per core's scratchpad
and one per core's accumulator memory. Each instruction is a pure function of those buffers,
defined once below; the whole program traces into one jitted function, cached by the program's
fingerprint, and instructions run in ``schedule.sequential_order``.

Uninitialised memory is zero, or, with ``debug=True``, 0xFF bytes: NaN in every float type and a
NaN E8M0 scale, so a read of memory nothing wrote shows up as NaN in the results.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jalapeno_emu.isa.table import DTYPES, Space
from jax import lax

from jalapeno_emu.emu.program import Allocation, Instruction, Program, Tile
from jalapeno_emu.emu.schedule import link_key, sequential_order
from jalapeno_emu.errors import InvalidArgumentError, OutOfBounds
from jalapeno_emu.mx.array import MXArray
from jalapeno_emu.mx.matmul import _matmul_jit
from jalapeno_emu.mx.quantize import _quantize_jit

__all__ = ["FunctionalResult", "MemoryLayout", "run_functional"]

State = dict[str, jax.Array]


# --- where each tile's bytes live -----------------------------------------------------------
@dataclass(frozen=True)
class MemoryLayout:
    """Which flat buffer backs each address range.

    Attributes:
        hbm: HBM allocations, sorted by offset (each its own buffer "hbm:NAME").
        sram_bytes: per core, the scratchpad bytes backed ("sram:C").
        acc_bytes: per core, the accumulator bytes backed ("acc:C").
    """

    hbm: tuple[Allocation, ...]
    sram_bytes: tuple[tuple[int, int], ...]
    acc_bytes: tuple[tuple[int, int], ...]

    @staticmethod
    def of(program: Program) -> MemoryLayout:
        """The layout a program needs: its HBM allocations, and SRAM/ACC up to the highest byte used."""
        hbm = tuple(sorted((a for a in program.allocations if a.space is Space.HBM),
                           key=lambda a: a.offset))
        need: dict[tuple[Space, int], int] = {}
        for a in program.allocations:
            if a.space is not Space.HBM:
                need[(a.space, a.core)] = max(need.get((a.space, a.core), 0), a.end)
        for ins in program.instructions:
            for _, t, _ in ins.tiles():
                if t.space is not Space.HBM:
                    need[(t.space, t.core)] = max(need.get((t.space, t.core), 0), t.end)
        sram = tuple(sorted((c, n) for (s, c), n in need.items() if s is Space.SRAM))
        acc = tuple(sorted((c, n) for (s, c), n in need.items() if s is Space.ACC))
        return MemoryLayout(hbm, sram, acc)

    def buffers(self) -> dict[str, int]:
        """Buffer name -> size in bytes."""
        out = {f"hbm:{a.name}": a.nbytes for a in self.hbm}
        out.update({f"sram:{c}": n for c, n in self.sram_bytes})
        out.update({f"acc:{c}": n for c, n in self.acc_bytes})
        return out

    def locate(self, tile: Tile, *, index: int | None = None, ins: Instruction | None = None
               ) -> tuple[str, int]:
        """(buffer name, offset within it) of ``tile``; raises OutOfBounds if it is not backed."""
        if tile.space is Space.HBM:
            for a in self.hbm:
                if a.offset <= tile.offset and tile.end <= a.end:
                    return f"hbm:{a.name}", tile.offset - a.offset
            raise OutOfBounds(
                "HBM tile is not inside one allocation", index=index,
                engine=str(ins.engine) if ins else None, source=ins.source if ins else None,
                addresses=(tile.region(),), hint="allocate the tensor first (.alloc / kb.hbm)")
        return f"{tile.space.value}:{tile.core}", tile.offset


# --- bytes <-> values -----------------------------------------------------------------------
def _read_bytes(buf: jax.Array, off: int, tile: Tile) -> jax.Array:
    """uint8[rows, row_bytes] of a strided tile at static offset ``off``."""
    rb, rows, stride = tile.row_bytes, tile.rows, tile.stride
    if tile.contiguous:
        return lax.slice(buf, (off,), (off + rows * rb,)).reshape(rows, rb)
    full = rows - 1
    body = lax.slice(buf, (off,), (off + full * stride,)).reshape(full, stride)[:, :rb]
    last = lax.slice(buf, (off + full * stride,), (off + full * stride + rb,))[None]
    return jnp.concatenate([body, last], axis=0)


def _write_bytes(buf: jax.Array, off: int, tile: Tile, data: jax.Array) -> jax.Array:
    rb, rows, stride = tile.row_bytes, tile.rows, tile.stride
    data = data.astype(jnp.uint8).reshape(rows, rb)
    if tile.contiguous:
        return lax.dynamic_update_slice(buf, data.reshape(-1), (off,))
    full = rows - 1
    body = lax.slice(buf, (off,), (off + full * stride,)).reshape(full, stride)
    body = body.at[:, :rb].set(data[:full])
    buf = lax.dynamic_update_slice(buf, body.reshape(-1), (off,))
    return lax.dynamic_update_slice(buf, data[full], (off + full * stride,))


def _decode(raw: jax.Array, dtype: str) -> jax.Array:
    """Values [rows, cols] from bytes [rows, row_bytes]: floats/ints typed, MX codes as uint8."""
    dt = DTYPES[dtype]
    if dtype == "fp4":
        return jnp.stack([raw & 0xF, raw >> 4], axis=-1).reshape(raw.shape[0], -1)
    if dt.bits == 8:
        return raw
    rows = raw.shape[0]
    jdt = jnp.dtype(dt.numpy)
    return lax.bitcast_convert_type(raw.reshape(rows, -1, dt.bits // 8), jdt)


def _encode(values: jax.Array, dtype: str) -> jax.Array:
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


# --- instruction semantics ------------------------------------------------------------------
class _Exec:
    """Runs instructions on a state dict; records data-dependent checks as error flags."""

    def __init__(self, program: Program, layout: MemoryLayout) -> None:
        self.program = program
        self.layout = layout
        self.flags: list[tuple[int, str, jax.Array]] = []
        self.in_flight: dict[tuple[int, int], list[jax.Array]] = {}

    def read(self, state: State, tile: Tile, idx: int) -> jax.Array:
        key, off = self.layout.locate(tile, index=idx, ins=self.program.instructions[idx])
        return _decode(_read_bytes(state[key], off, tile), tile.dtype)

    def read_raw(self, state: State, tile: Tile, idx: int) -> jax.Array:
        key, off = self.layout.locate(tile, index=idx, ins=self.program.instructions[idx])
        return _read_bytes(state[key], off, tile)

    def write(self, state: State, tile: Tile, values: jax.Array, idx: int) -> None:
        key, off = self.layout.locate(tile, index=idx, ins=self.program.instructions[idx])
        state[key] = _write_bytes(state[key], off, tile, _encode(values, tile.dtype))

    def write_raw(self, state: State, tile: Tile, raw: jax.Array, idx: int) -> None:
        key, off = self.layout.locate(tile, index=idx, ins=self.program.instructions[idx])
        state[key] = _write_bytes(state[key], off, tile, raw)

    def f32(self, state: State, tile: Tile, idx: int) -> jax.Array:
        return self.read(state, tile, idx).astype(jnp.float32)

    def mx_operand(self, state: State, codes: Tile, scales: Tile | None, idx: int, axis: int):
        """(MXArray, None) for MX operands; (None, float32 values) for BF16."""
        if codes.dtype == "bf16":
            return None, self.f32(state, codes, idx)
        fmt = DTYPES[codes.dtype].mx_fmt
        q = MXArray(codes=self.read(state, codes, idx), scales=self.read(state, scales, idx),
                    fmt=fmt, axis=axis, block_size=32)
        return q, None

    def run(self, state: State, idx: int) -> None:
        ins = self.program.instructions[idx]
        getattr(self, "op_" + ins.mnemonic.replace(".", "_"))(state, ins, idx)

    # DMA
    def op_dma_load(self, state, ins, idx):
        self.write_raw(state, ins.arg("dst"), self.read_raw(state, ins.arg("src"), idx), idx)

    op_dma_store = op_dma_load
    op_dma_copy = op_dma_load

    def op_dma_gather(self, state, ins, idx):
        src, dst, idx_tile = ins.arg("src"), ins.arg("dst"), ins.arg("idx")
        rows = self.read_raw(state, src, idx)
        ids = self.read(state, idx_tile, idx)[:, 0]
        bad = jnp.any((ids < 0) | (ids >= src.rows))
        self.flags.append((idx, f"gather index outside [0, {src.rows}) of {src.region()}", bad))
        self.write_raw(state, dst, jnp.take(rows, jnp.clip(ids, 0, src.rows - 1), axis=0), idx)

    # Matrix unit
    def op_mxu_matmul(self, state, ins, idx):
        acc_t = ins.arg("acc")
        a_q, a_f = self.mx_operand(state, ins.arg("a"), ins.arg("a_scale"), idx, axis=1)
        b_q, b_f = self.mx_operand(state, ins.arg("b"), ins.arg("b_scale"), idx, axis=0)
        acc0 = (jnp.zeros(acc_t.shape, jnp.float32) if ins.arg("mode") == "overwrite"
                else self.f32(state, acc_t, idx))
        if a_q is not None and b_q is not None:
            out = _matmul_jit(a_q, b_q, acc0)
        else:
            a_vals = a_f if a_q is None else _dequant(a_q)
            b_vals = b_f if b_q is None else _dequant(b_q)
            out = _sequential_block_matmul(acc0, a_vals, b_vals)
        self.write(state, acc_t, out, idx)

    # Vector unit
    def op_vec_unary(self, state, ins, idx):
        x = self.f32(state, ins.arg("src"), idx)
        self.write(state, ins.arg("dst"), _UNARY[ins.arg("op")](x), idx)

    def op_vec_binary(self, state, ins, idx):
        a = self.f32(state, ins.arg("a"), idx)
        b = self.f32(state, ins.arg("b"), idx)
        self.write(state, ins.arg("dst"), _BINARY[ins.arg("op")](a, b), idx)

    def op_vec_clamp(self, state, ins, idx):
        x = self.f32(state, ins.arg("src"), idx)
        lo, hi = jnp.float32(ins.arg("lo")), jnp.float32(ins.arg("hi"))
        self.write(state, ins.arg("dst"), jnp.minimum(jnp.maximum(x, lo), hi), idx)

    def op_vec_scale(self, state, ins, idx):
        x = self.f32(state, ins.arg("src"), idx)
        self.write(state, ins.arg("dst"), x * jnp.float32(ins.arg("factor")), idx)

    def op_vec_reduce(self, state, ins, idx):
        x = self.f32(state, ins.arg("src"), idx)
        r = jnp.max(x, axis=1, keepdims=True) if ins.arg("op") == "max" else _sequential_sum(x)
        self.write(state, ins.arg("dst"), r, idx)

    def op_vec_quantize(self, state, ins, idx):
        x = self.f32(state, ins.arg("src"), idx)
        dst = ins.arg("dst")
        codes, scales = _quantize_jit(x, None, fmt=DTYPES[dst.dtype].mx_fmt, axis=1, block_size=32,
                                      scale_mode=ins.arg("scale_mode"), rounding="rne")
        self.write(state, dst, codes, idx)
        self.write(state, ins.arg("dst_scale"), scales, idx)

    def op_vec_topk(self, state, ins, idx):
        x = self.f32(state, ins.arg("src"), idx)
        vals, ids = lax.top_k(x, ins.arg("dst").cols)
        self.write(state, ins.arg("dst"), vals, idx)
        self.write(state, ins.arg("dst_idx"), ids.astype(jnp.int32), idx)

    def op_vec_acc_read(self, state, ins, idx):
        self.write(state, ins.arg("dst"), self.f32(state, ins.arg("src"), idx), idx)

    # Synchronisation: ordering only, no data
    def op_sem_signal(self, state, ins, idx):
        pass

    op_sem_wait = op_sem_signal
    op_barrier = op_sem_signal

    # Links (single chip: a send to peer p pairs with a receive from peer p with the same tag)
    def op_link_send(self, state, ins, idx):
        self.in_flight.setdefault(link_key(ins), []).append(self.read_raw(state, ins.arg("src"), idx))

    def op_link_recv(self, state, ins, idx):
        raw = self.in_flight[link_key(ins)].pop(0)
        dst = ins.arg("dst")
        if raw.shape != (dst.rows, dst.row_bytes):
            raise OutOfBounds(f"link.recv tile {dst.rows}x{dst.row_bytes} B does not match the "
                              f"sent {raw.shape[0]}x{raw.shape[1]} B", index=idx,
                              engine=str(ins.engine), source=ins.source)
        self.write_raw(state, dst, raw, idx)


def _dequant(q: MXArray) -> jax.Array:
    from jalapeno_emu.mx.quantize import _dequantize_jit

    return _dequantize_jit(q, "float32")


def _sequential_block_matmul(acc0: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """BF16 (or mixed) operands: products in FP32, each 32-block summed in increasing k, then added.

    Every product of a BF16 value and an MX or BF16 value is exact in FP32 (at most 8 x 8
    significant bits) barring over- or underflow, so the only roundings are the in-order sums.
    """
    m, k = a.shape
    n = b.shape[1]
    a_blocks = a.reshape(m, k // 32, 32).transpose(1, 2, 0)  # [nb, 32, M]
    b_blocks = b.reshape(k // 32, 32, n)  # [nb, 32, N]

    def block(acc, ab):
        a_j, b_j = ab

        def step(s, kk):
            return s + a_j[kk][:, None] * b_j[kk][None, :], None

        blk, _ = lax.scan(step, jnp.zeros((m, n), jnp.float32), jnp.arange(32))
        return acc + blk, None

    acc, _ = lax.scan(block, acc0, (a_blocks, b_blocks))
    return acc


def _sequential_sum(x: jax.Array) -> jax.Array:
    """Row sums in FP32, accumulated in increasing column order (the vector unit's order)."""
    s, _ = lax.scan(lambda acc, col: (acc + col, None), jnp.zeros((x.shape[0],), jnp.float32), x.T)
    return s[:, None]


_UNARY: dict[str, Callable[[jax.Array], jax.Array]] = {
    "copy": lambda x: x,
    "exp": jnp.exp,
    "rsqrt": lax.rsqrt,
    "sigmoid": jax.nn.sigmoid,
    "silu": lambda x: x * jax.nn.sigmoid(x),
    "neg": jnp.negative,
    "abs": jnp.abs,
    "recip": lambda x: jnp.float32(1) / x,
    "square": jnp.square,
}
_BINARY: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "max": jnp.maximum, "min": jnp.minimum,
}


# --- running a program ----------------------------------------------------------------------
@dataclass
class FunctionalResult:
    """Memory after a functional run.

    Attributes:
        program: the program that ran.
        layout: the buffers' layout.
        buffers: buffer name -> uint8 numpy array (HBM per allocation, SRAM/ACC per core).
    """

    program: Program
    layout: MemoryLayout
    buffers: dict[str, np.ndarray]

    def read_bytes(self, name: str) -> np.ndarray:
        """Raw bytes of HBM allocation ``name``."""
        return self.buffers[f"hbm:{_hbm_alloc(self.program, name).name}"]

    def read(self, name: str, dtype: str | None = None, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Contents of HBM allocation ``name`` as values.

        Args:
            name: allocation name.
            dtype, shape: element type and shape; default to what the builder recorded.

        Returns:
            numpy array; MX element allocations come back as uint8 codes (unpacked for fp4).
        """
        tensors = dict(dict(self.program.meta).get("tensors", {}))
        if dtype is None or shape is None:
            if name not in tensors:
                raise InvalidArgumentError(f"give dtype= and shape= to read {name!r}; the program "
                                           "did not record them")
            dtype, shape = dtype or tensors[name][0], shape or tensors[name][1]
        raw = self.read_bytes(name)
        dt = DTYPES[dtype]
        n = int(np.prod(shape))
        if dtype == "fp4":
            codes = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(-1)
            return codes[:n].reshape(shape)
        np_dt = np.dtype(ml_dtypes.bfloat16) if dt.numpy == "bfloat16" else np.dtype(dt.numpy or "uint8")
        return raw[: n * np_dt.itemsize].view(np_dt).reshape(shape)


def _hbm_alloc(program: Program, name: str) -> Allocation:
    for a in program.allocations:
        if a.space is Space.HBM and a.name == name:
            return a
    names = sorted(a.name for a in program.allocations if a.space is Space.HBM)
    raise InvalidArgumentError(f"no HBM allocation named {name!r}; the program has {names}")


def _to_bytes(value: Any, dtype: str | None) -> np.ndarray:
    """Host value -> bytes for an allocation of ``dtype`` (None: raw bytes expected)."""
    if isinstance(value, np.ndarray) and value.dtype == np.uint8 and dtype in (None, "u8", "e8m0"):
        return value.reshape(-1)
    if dtype == "fp4":
        codes = np.asarray(value, np.uint8).reshape(value.shape[0], -1)
        return ((codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)).reshape(-1)
    dt = DTYPES[dtype or "u8"]
    np_dt = np.dtype(ml_dtypes.bfloat16) if dt.numpy == "bfloat16" else np.dtype(dt.numpy or "uint8")
    return np.ascontiguousarray(np.asarray(value).astype(np_dt)).view(np.uint8).reshape(-1)


def _initial_buffers(program: Program, layout: MemoryLayout, inputs: Mapping[str, Any],
                     debug: bool) -> dict[str, np.ndarray]:
    fill = 0xFF if debug else 0
    bufs = {k: np.full(n, fill, np.uint8) for k, n in layout.buffers().items()}
    tensors = dict(dict(program.meta).get("tensors", {}))
    for init in program.inits:
        alloc = _hbm_alloc(program, init.name)
        dt = DTYPES[init.dtype]
        count = alloc.nbytes * 8 // dt.bits
        if init.kind == "normal":
            vals = np.random.default_rng(init.seed).standard_normal(count).astype(np.float32)
        else:
            vals = np.full(count, 1.0 if init.kind == "ones" else 0.0, np.float32)
        data = _to_bytes(vals.reshape(1, -1) if init.dtype == "fp4" else vals, init.dtype)
        bufs[f"hbm:{alloc.name}"][: data.size] = data
    for name, value in inputs.items():
        if isinstance(value, MXArray):
            _write_input(program, bufs, tensors, name, np.asarray(value.codes))
            _write_input(program, bufs, tensors, f"{name}.scales", np.asarray(value.scales))
        else:
            _write_input(program, bufs, tensors, name, value)
    return bufs


def _write_input(program, bufs, tensors, name, value) -> None:
    alloc = _hbm_alloc(program, name)
    dtype = tensors.get(name, (None, None))[0]
    data = _to_bytes(value, dtype)
    if data.size > alloc.nbytes:
        raise InvalidArgumentError(f"input {name!r} has {data.size:,} B but its allocation holds "
                                   f"{alloc.nbytes:,} B")
    bufs[f"hbm:{alloc.name}"][: data.size] = data


@functools.lru_cache(maxsize=32)
def _compiled(program: Program, order: tuple[int, ...]):
    """(jitted state -> (state, flags), flag descriptions) for one program and order."""
    layout = MemoryLayout.of(program)
    flag_info: list[tuple[int, str]] = []

    def run(state: State) -> tuple[State, jax.Array]:
        state = dict(state)
        ex = _Exec(program, layout)
        for idx in order:
            ex.run(state, idx)
        flag_info[:] = [(i, msg) for i, msg, _ in ex.flags]
        flags = jnp.stack([f for _, _, f in ex.flags]) if ex.flags else jnp.zeros((0,), bool)
        return state, flags

    return jax.jit(run, donate_argnums=0), flag_info


def run_functional(program: Program, inputs: Mapping[str, Any] | None = None, *,
                   debug: bool = False) -> FunctionalResult:
    """Execute ``program`` and return the memory contents.

    Args:
        program: the Program (from the builder or the assembler).
        inputs: HBM allocation name -> host data: a numpy array (converted to the allocation's
            recorded dtype), raw uint8 bytes, or an ``MXArray`` (codes go to ``name``, scales to
            ``name.scales``).
        debug: fill memory nothing initialised with 0xFF bytes (NaN) instead of zeros.

    Returns:
        FunctionalResult with every buffer as a numpy uint8 array.

    Raises:
        Deadlock: no legal order exists.
        OutOfBounds: a tile is not backed by memory, or a gather index is out of range.
    """
    order = tuple(sequential_order(program))
    layout = MemoryLayout.of(program)
    bufs = _initial_buffers(program, layout, inputs or {}, debug)
    fn, flag_info = _compiled(program, order)
    state, flags = fn({k: jnp.asarray(v) for k, v in bufs.items()})
    flags = np.asarray(flags)
    if flags.any():
        idx, msg = flag_info[int(np.argmax(flags))]
        ins = program.instructions[idx]
        raise OutOfBounds(msg, index=idx, engine=str(ins.engine), source=ins.source)
    return FunctionalResult(program, layout, {k: np.asarray(v) for k, v in state.items()})
