"""The functional pass: execute a Program's instructions in JAX and return the memory contents.

Stage: emulator. Memory is byte-addressed, exactly as the chip sees it: one flat uint8 buffer per
HBM allocation (so only what is allocated is backed by host memory), one per core's scratchpad
and one per core's accumulator memory. Each instruction is a pure function of those buffers,
defined once below. Instructions run in ``schedule.sequential_order``; each is one call of a
jitted function compiled once per *signature* (mnemonic, operand shapes and dtypes, buffer sizes)
with the byte offsets passed as data, so a kernel's loop body compiles once however many times it
is unrolled. Buffers are backed at rounded sizes, on-chip memory only where instructions touch
it (``memory_layout.py``), so that the same instruction on any core, or on buffers of nearby
sizes, is one signature; results come back at the allocations' sizes. Independent instructions of
one signature run as one call (``batching.py``); the inputs are checked and laid out by
``initial_memory.py``.

Uninitialised memory is zero, or, with ``debug=True``, 0xFF bytes: NaN in every float type and a
NaN E8M0 scale, so a read of memory nothing wrote shows up as NaN in the results.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jalapeno_emu.emu.batching import batch_schedule
from jalapeno_emu.emu.compile_cache import ensure_default_compile_cache
from jalapeno_emu.emu.executable_store import stored
from jalapeno_emu.emu.initial_memory import State, initial_state
from jalapeno_emu.emu.memory_layout import MemoryLayout
from jalapeno_emu.emu.progress import ProgressFn, report_interval, resolve_progress
from jalapeno_emu.emu.result import FunctionalResult, Readable, read_values
from jalapeno_emu.emu.schedule import link_key, sequential_order
from jalapeno_emu.emu.tile_bytes import decode, encode, land_all, read_bytes, write_bytes
from jalapeno_emu.emu.unit_math import inorder_block_matmul, sequential_row_sum
from jalapeno_emu.errors import InvalidArgumentError, OutOfBounds
from jalapeno_emu.isa.program import Engine, Instruction, Program, Tile
from jalapeno_emu.isa.table import DTYPES, Space, by_mnemonic
from jalapeno_emu.mx.array import MXArray
from jalapeno_emu.mx.matmul import _matmul_jit
from jalapeno_emu.mx.quantize import _quantize_jit

__all__ = ["FunctionalResult", "MemoryLayout", "Readable", "inorder_block_matmul", "run_functional",
           "sequential_row_sum"]


# --- instruction semantics ------------------------------------------------------------------
class _Exec:
    """The semantics of each instruction, as a function of byte buffers.

    ``locs`` maps each tile operand's name to (buffer key, byte offset); the offset may be a
    traced value, so one compiled function serves every instruction of the same shape.
    Data-dependent checks (gather indices) are recorded as error flags instead of raising, since
    they are only known inside the compiled function.
    """

    def __init__(self, ins: Instruction, locs: dict[str, tuple[str, Any]], *, capture: bool = False) -> None:
        self.ins = ins
        self.locs = locs
        self.flags: list[jax.Array] = []  # bool scalars; the messages are _flag_messages(ins)
        # capture: writes are recorded (operand name, bytes) instead of applied, for a batch
        # that reads the memory first and writes afterwards (every op reads before it writes).
        self.written: list[tuple[str, jax.Array]] | None = [] if capture else None

    def raw(self, state: State, name: str) -> jax.Array:
        key, off = self.locs[name]
        return read_bytes(state[key], off, self.ins.arg(name))

    def get(self, state: State, name: str) -> jax.Array:
        return decode(self.raw(state, name), self.ins.arg(name).dtype)

    def f32(self, state: State, name: str) -> jax.Array:
        return self.get(state, name).astype(jnp.float32)

    def put_raw(self, state: State, name: str, raw: jax.Array) -> None:
        if self.written is not None:
            self.written.append((name, raw))
            return
        key, off = self.locs[name]
        state[key] = write_bytes(state[key], off, self.ins.arg(name), raw)

    def put(self, state: State, name: str, values: jax.Array) -> None:
        self.put_raw(state, name, encode(values, self.ins.arg(name).dtype))

    def operand(self, state: State, name: str, scale_name: str, axis: int):
        """(MXArray, None) for an MX operand; (None, float32 values) for BF16."""
        tile = self.ins.arg(name)
        if tile.dtype == "bf16":
            return None, self.f32(state, name)
        q = MXArray(codes=self.get(state, name), scales=self.get(state, scale_name),
                    fmt=DTYPES[tile.dtype].mx_fmt, axis=axis, block_size=32)
        return q, None

    def run(self, state: State) -> None:
        getattr(self, "op_" + self.ins.mnemonic.replace(".", "_"))(state, self.ins)

    # DMA: bytes move unchanged
    def op_dma_load(self, state, ins):
        self.put_raw(state, "dst", self.raw(state, "src"))

    op_dma_store = op_dma_load
    op_dma_copy = op_dma_load

    def op_dma_gather(self, state, ins):
        n_src = ins.arg("src").rows
        ids = self.get(state, "idx")[:, 0]
        self.flags.append(jnp.any((ids < 0) | (ids >= n_src)))
        rows = self.raw(state, "src")
        self.put_raw(state, "dst", jnp.take(rows, jnp.clip(ids, 0, n_src - 1), axis=0))

    # Matrix unit: exactly mx.matmul_accumulate for MX operands
    def op_mxu_matmul(self, state, ins):
        a_q, a_f = self.operand(state, "a", "a_scale", axis=1)
        b_q, b_f = self.operand(state, "b", "b_scale", axis=0)
        acc0 = (jnp.zeros(ins.arg("acc").shape, jnp.float32) if ins.arg("mode") == "overwrite"
                else self.f32(state, "acc"))
        if a_q is not None and b_q is not None:
            out = _matmul_jit(a_q, b_q, acc0)
        else:
            a_vals = a_f if a_q is None else _dequant(a_q)
            b_vals = b_f if b_q is None else _dequant(b_q)
            out = inorder_block_matmul(a_vals, b_vals, acc0)
        self.put(state, "acc", out)

    def op_mxu_matmul_t(self, state, ins):
        """a @ b^T: b [N, K] (scales [N, K/32]) is transposed to a [K, N] operand blocked along K."""
        a_q, a_f = self.operand(state, "a", "a_scale", axis=1)
        b_q, b_f = self.operand(state, "b", "b_scale", axis=1)
        acc0 = (jnp.zeros(ins.arg("acc").shape, jnp.float32) if ins.arg("mode") == "overwrite"
                else self.f32(state, "acc"))
        if b_q is not None:
            b_q = MXArray(codes=b_q.codes.T, scales=b_q.scales.T, fmt=b_q.fmt, axis=0, block_size=32)
        if a_q is not None and b_q is not None:
            out = _matmul_jit(a_q, b_q, acc0)
        else:
            a_vals = a_f if a_q is None else _dequant(a_q)
            b_vals = b_f.T if b_q is None else _dequant(b_q)
            out = inorder_block_matmul(a_vals, b_vals, acc0)
        self.put(state, "acc", out)

    # Vector unit: FP32 arithmetic, rounded to the destination's dtype
    def op_vec_unary(self, state, ins):
        self.put(state, "dst", _UNARY[ins.arg("op")](self.f32(state, "src")))

    def op_vec_binary(self, state, ins):
        self.put(state, "dst", _BINARY[ins.arg("op")](self.f32(state, "a"), self.f32(state, "b")))

    def op_vec_clamp(self, state, ins):
        lo, hi = jnp.float32(ins.arg("lo")), jnp.float32(ins.arg("hi"))
        self.put(state, "dst", jnp.minimum(jnp.maximum(self.f32(state, "src"), lo), hi))

    def op_vec_scale(self, state, ins):
        self.put(state, "dst", self.f32(state, "src") * jnp.float32(ins.arg("factor")))

    def op_vec_reduce(self, state, ins):
        x = self.f32(state, "src")
        self.put(state, "dst", jnp.max(x, axis=1, keepdims=True) if ins.arg("op") == "max"
                 else sequential_row_sum(x))

    def op_vec_quantize(self, state, ins):
        codes, scales = _quantize_jit(
            self.f32(state, "src"), None, fmt=DTYPES[ins.arg("dst").dtype].mx_fmt, axis=1,
            block_size=32, scale_mode=ins.arg("scale_mode"), rounding="rne")
        self.put(state, "dst", codes)
        self.put(state, "dst_scale", scales)

    def op_vec_topk(self, state, ins):
        vals, ids = lax.top_k(self.f32(state, "src"), ins.arg("dst").cols)
        self.put(state, "dst", vals)
        self.put(state, "dst_idx", ids.astype(jnp.int32))

    def op_vec_acc_read(self, state, ins):
        self.put(state, "dst", self.f32(state, "src"))

    def op_vec_group(self, state, ins):
        ids = self.get(state, "src")  # int32 [R, k]
        w = self.f32(state, "w")
        u_rows = ins.arg("dst").rows
        ordered = jnp.sort(ids.reshape(-1))
        new = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
        count = jnp.sum(new)
        rank = jnp.cumsum(new) - 1  # which distinct value each sorted key is
        uniq = jnp.zeros((u_rows,), jnp.int32).at[jnp.where(new, rank, u_rows)].set(ordered, mode="drop")
        live = jnp.arange(u_rows) < count
        uniq = jnp.where(live, uniq, ordered[-1])
        self.flags.append(count > u_rows)
        out = jnp.zeros((u_rows, ids.shape[0]), jnp.float32)
        for j in range(ids.shape[1]):  # increasing j, as documented
            hit = (ids[None, :, j] == uniq[:, None]) & live[:, None]
            out = out + jnp.where(hit, w[None, :, j], jnp.float32(0))
        self.put(state, "dst", uniq[:, None])
        self.put(state, "dst_w", out)

    # Synchronisation orders instructions; the driver's order already honours it.
    def op_sem_signal(self, state, ins):
        pass

    op_sem_wait = op_sem_signal
    op_barrier = op_sem_signal


def _dequant(q: MXArray) -> jax.Array:
    from jalapeno_emu.mx.quantize import _dequantize_jit

    return _dequantize_jit(q, "float32")


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
_Signature = tuple


def _signature(ins: Instruction, layout: MemoryLayout, idx: int, spans: list | None = None
               ) -> tuple[_Signature, tuple[str, ...], np.ndarray]:
    """(compile key, buffer keys in slot order, byte offsets) of one instruction.

    Offsets are left out of the key: instructions that differ only in where their tiles sit
    share one compiled function. ``spans``: gets (buffer key, first byte, end, written) of each
    tile, as located here (what the batch schedule tracks).
    """
    slots: list[str] = []
    offsets: list[int] = []
    parts: list[Any] = [ins.mnemonic]
    sizes = layout.backing
    written = _written(ins.mnemonic)
    for name, value in ins.args:
        if isinstance(value, Tile):
            key, off = layout.locate(value, index=idx, ins=ins)
            if key not in slots:
                slots.append(key)
            offsets.append(off)
            parts.append((name, slots.index(key), sizes[key], _SPACE_TEXT[id(value.space)],
                          value.dtype, value.rows, value.cols, value.stride))
            if spans is not None:
                spans.append((key, off, off + (value.rows - 1) * value.stride + value.row_bytes,
                              name in written))
        else:
            parts.append((name, value))
    return tuple(parts), tuple(slots), np.asarray(offsets, np.int32)


_SPACE_TEXT = {id(space): space.value for space in Space}
"""A space's name by the member's identity: a signature holds the name (an enum member hashes in
Python code, and a fused step's plan hashes each signature about twice per instruction)."""


@functools.cache
def _written(mnemonic: str) -> frozenset[str]:
    """The tile operands an instruction of ``mnemonic`` writes (``Instruction.tiles``' flag, per
    row rather than per instruction)."""
    return frozenset(op.name for op in by_mnemonic(mnemonic).operands if op.kind == "tile" and op.writes)


def _compiled_instruction(sig: _Signature, ins: Instruction) -> Callable:
    """The jitted (buffers..., offsets) -> (buffers..., flags) of every instruction of ``sig``,
    ``ins`` one of them; the last ``_COMPILED_MAX`` signatures used are kept. (Keyed by the
    signature alone: a key holding an example instruction cost a third of a fused step's
    planning to hash.)"""
    return _recent(_by_signature, sig, lambda: _compile_instruction(sig, _canonical(ins)))


def _recent(table: dict, key: Any, make: Callable[[], Callable]) -> Callable:
    """``table[key]``, made by ``make()`` when missing; ``table`` keeps the last ``_COMPILED_MAX``
    keys used, least recent first."""
    fn = table.pop(key, None)
    if fn is None:
        if len(table) >= _COMPILED_MAX:
            del table[next(iter(table))]  # the least recently used
        fn = make()
    table[key] = fn  # (re-inserted: the most recently used comes last)
    return fn


def _compile_instruction(sig: _Signature, example: Instruction) -> Callable:
    """A jitted (buffers..., offsets) -> (buffers..., flags) for every instruction of ``sig``."""
    tile_names = [name for name, v in example.args if isinstance(v, Tile)]
    slot_of = {p[0]: p[1] for p in sig[1:] if isinstance(p, tuple) and len(p) == 8}
    n_slots = 1 + max(slot_of.values(), default=-1)

    def fn(buffers: tuple[jax.Array, ...], offsets: jax.Array):
        state = {f"s{i}": b for i, b in enumerate(buffers)}
        locs = {name: (f"s{slot_of[name]}", offsets[i]) for i, name in enumerate(tile_names)}
        ex = _Exec(example, locs)
        ex.run(state)
        flags = jnp.stack(ex.flags) if ex.flags else jnp.zeros((0,), bool)
        return tuple(state[f"s{i}"] for i in range(n_slots)), flags

    return stored(fn, ("instruction", sig), donate_argnums=0)


def _batched_instruction(sig: _Signature, ins: Instruction, size: int, disjoint: bool) -> Callable:
    """The jitted (buffers..., offsets[size, tiles]) -> (buffers..., flags[size, n]) running
    ``size`` instructions of ``sig`` (``ins`` one of them) as one batch: every one reads the
    buffers as they were, then their writes land in order (``emu.batching``); ``disjoint``: no
    two of them write a common byte, so their writes land at once."""
    return _recent(_by_batch, (sig, size, disjoint),
                   lambda: _compile_batched(sig, _canonical(ins), size, disjoint))


_MAPPED = frozenset({"mxu.matmul", "mxu.matmul_t"})
"""Batched one after another (``lax.map``) inside their call, not vectorised (``jax.vmap``): a
vectorised block matmul is a dot with two batch dimensions, which XLA's CPU backend runs 2-3x
slower than the same dots in turn (8 MXFP4 [128, 512] x [512, 128]: 9.3 ms vmapped, 2.8 ms mapped,
3.6 ms as 8 calls); vector and DMA work vectorises well."""


def _compile_batched(sig: _Signature, example: Instruction, size: int, disjoint: bool) -> Callable:
    tile_names = [name for name, v in example.args if isinstance(v, Tile)]
    slot_of = {p[0]: p[1] for p in sig[1:] if isinstance(p, tuple) and len(p) == 8}
    n_slots = 1 + max(slot_of.values(), default=-1)
    position = {name: i for i, name in enumerate(tile_names)}
    order: list[str] = []  # the operands one instruction writes, in its order (set when traced)

    def one(buffers: tuple[jax.Array, ...], offsets: jax.Array):
        state = {f"s{i}": b for i, b in enumerate(buffers)}
        locs = {name: (f"s{slot_of[name]}", offsets[i]) for i, name in enumerate(tile_names)}
        ex = _Exec(example, locs, capture=True)
        ex.run(state)
        order[:] = [name for name, _ in ex.written]
        flags = jnp.stack(ex.flags) if ex.flags else jnp.zeros((0,), bool)
        return tuple(raw for _, raw in ex.written), flags

    def fn(buffers: tuple[jax.Array, ...], offsets: jax.Array):
        if example.mnemonic in _MAPPED:
            raws, flags = lax.map(lambda o: one(buffers, o), offsets)
        else:
            raws, flags = jax.vmap(one, in_axes=(None, 0))(buffers, offsets)
        if disjoint:  # one scatter per operand: a landing loop doubled the compile time
            state = list(buffers[:n_slots])
            for name, raw in zip(order, raws, strict=True):
                s = slot_of[name]
                state[s] = land_all(state[s], offsets[:, position[name]], example.arg(name), raw)
            return tuple(state), flags

        def land(b, state):
            state = list(state)
            for name, raw in zip(order, raws, strict=True):
                s = slot_of[name]
                state[s] = write_bytes(state[s], offsets[b, position[name]], example.arg(name), raw[b])
            return tuple(state)

        return lax.fori_loop(0, size, land, tuple(buffers[:n_slots])), flags

    return stored(fn, ("batch", sig, size, disjoint), donate_argnums=0)


def _flag_messages(ins: Instruction) -> list[str]:
    if ins.mnemonic == "dma.gather":
        src = ins.arg("src")
        return [f"gather index outside [0, {src.rows}) of {src.region()}"]
    if ins.mnemonic == "vec.group":
        return [f"src holds more distinct values than the {ins.arg('dst').rows} rows of dst "
                f"{ins.arg('dst').region()} (the program was built for fewer)"]
    return []


COMPILE_MODES = ("instruction", "program")


def run_functional(program: Program, inputs: Mapping[str, Any] | None = None, *,
                   debug: bool = False, schedule_seed: int | None = None,
                   compile: str = "instruction", progress: ProgressFn | None = None,
                   batch: bool = True) -> FunctionalResult:
    """Execute ``program`` and return the memory contents.

    Args:
        program: the Program (from the builder or the assembler).
        inputs: HBM allocation name -> host data, exactly the tensor the program recorded for
            it (``Program.meta["tensors"]``): an array of its shape and of its element's numpy
            dtype (bf16: ``ml_dtypes.bfloat16``; fp4/fp8 elements and e8m0 scales: uint8 codes,
            one per element), nothing converted; for a byte tensor (u8, e8m0) also its raw
            bytes as a flat uint8 array of exactly its size; for an MX tensor also an
            ``MXArray`` of its format and shape, quantized along its axis (codes go to
            ``name``, scales to ``name.scales``). An allocation the program recorded no tensor
            for (an assembled program) takes any array, converted to bytes, up to its size.
        debug: fill memory nothing initialised with 0xFF bytes (NaN) instead of zeros.
        schedule_seed: run the engines in another legal interleaving (``sequential_order``'s
            seed); a program that passes ``check_program`` gives the same results under all.
        compile: "instruction" (default) compiles one function per instruction signature: a
            kernel's loop body compiles once, so the first run is quick. "program" traces the
            whole program into one function: compiling takes much longer (tens of seconds for
            thousands of instructions) but each further run is faster — for running one program
            many times. Both give the same bytes.
        progress: called with (instructions executed, total) about every 1% of the run, first
            with 0 and last with total; counts the instructions that move or compute data
            (semaphores and barriers only order them and cost nothing here). With
            compile="program" only at the start and the end (one call runs everything).
            Defaults to the enclosing ``emu.progress.reporting_progress`` callback, as pass
            ``"functional"``.
        batch: with compile="instruction", run ``BATCH_MIN`` or more independent instructions of
            one signature (a core's load, matmul, ... on many cores) as one call
            (``emu.batching``): the same bytes, far fewer calls on a many-core chip. False: one
            call per instruction.

    Returns:
        FunctionalResult with every buffer as a numpy uint8 array, and what each ``probe``
        recorded (``result.probes``: label -> arrays in issue order), in both compile modes.

    Raises:
        InvalidArgumentError: an input names no HBM allocation, or is not its recorded tensor
            (shape, dtype, MX format or axis; the message names the tensor, what it is and what
            was given), or is larger than its allocation; ``compile`` is unknown.
        Deadlock: no legal order exists.
        OutOfBounds: a tile is not backed by memory, or a gather index is out of range.
    """
    if compile not in COMPILE_MODES:
        raise InvalidArgumentError(f"compile={compile!r} is not one of {COMPILE_MODES}")
    ensure_default_compile_cache()
    layout, plan = _plan(program, schedule_seed)
    state: State = initial_state(program, layout, inputs or {}, debug)
    progress = resolve_progress(progress, "functional")
    total = len(plan)
    if progress is not None:
        progress(0, total)
    if compile == "program":
        fn, flag_at, probe_at = _whole_program(program, schedule_seed)
        state, flags, probed = fn(state)
        flags = np.asarray(flags)
        if progress is not None:
            progress(total, total)
        if flags.any():
            idx = flag_at[int(np.argmax(flags))]
            ins = program.instructions[idx]
            raise OutOfBounds(_flag_messages(ins)[0], index=idx, engine=str(ins.engine),
                              source=ins.source)
        return FunctionalResult(program, layout, _trimmed(layout, state, 0xFF if debug else 0),
                                *_probe_values(program, dict(zip(probe_at, probed, strict=True))))
    in_flight: dict[tuple[int, int], list[jax.Array]] = {}
    probed: dict[int, jax.Array] = {}
    every = report_interval(total)
    done = reported = 0
    for idx, fn, slots, offsets in _batched_plan(program, schedule_seed) if batch else plan:
        if progress is not None and done - reported >= every:
            # JAX dispatches asynchronously (on an accelerator, far ahead): waiting makes the
            # count say how far the work has run, not how far the host has queued it. One wait
            # per 1% cost nothing measurable on CPU (gemm 2048^3 on tiny: 3.3-4.5 s either way).
            jax.block_until_ready(state)
            progress(done, total)
            reported = done
        members = idx if type(idx) is tuple else (idx,)
        done += len(members)
        if fn is None:
            _run_link(program.instructions[idx], idx, layout, state, in_flight)
            continue
        if fn is _PROBE:
            probed[idx] = _probe_reader(slots)(state[offsets[0]], offsets[1])
            continue
        new, flags = fn(tuple(state[k] for k in slots), offsets)
        for k, b in zip(slots, new, strict=True):
            state[k] = b
        if flags.size and bool(np.asarray(flags).any()):
            hit = np.asarray(flags).reshape(len(offsets) if len(members) > 1 else 1, -1).any(axis=1)
            at = members[min(int(np.argmax(hit)), len(members) - 1)]
            ins = program.instructions[at]
            raise OutOfBounds(_flag_messages(ins)[0], index=at, engine=str(ins.engine),
                              source=ins.source)
    result = FunctionalResult(program, layout, _trimmed(layout, state, 0xFF if debug else 0),
                              *_probe_values(program, probed))
    if progress is not None:
        progress(total, total)
    return result


def _trimmed(layout: MemoryLayout, state: State, fill: int) -> dict[str, np.ndarray]:
    """Each buffer's bytes as a numpy array of its own size: an HBM buffer a view of its array
    (without the backing's rounding), a core's memory its runs in an array of ``fill`` bytes
    (what memory no instruction touched still holds; zeros cost no host memory until written)."""
    arrays = {k: np.asarray(v) for k, v in state.items()}
    out = {}
    for name, size in layout.sizes.items():
        if name.startswith("hbm:"):
            out[name] = arrays[name][:size]
            continue
        buf = np.zeros(size, np.uint8) if fill == 0 else np.full(size, fill, np.uint8)
        for key, lo, hi, at in layout.pieces(name):
            buf[at:at + hi - lo] = arrays[key][lo:hi]
        out[name] = buf
    return out


@functools.lru_cache(maxsize=32)  # a tiny model's decode step runs about 10 distinct programs
def _whole_program(program: Program, seed: int | None) -> tuple[Callable, list[int], list[int]]:
    """(jitted state -> (state, flags, probed values), instruction index of each flag, instruction
    index of each probed value): the whole program as one traced function, with every offset a
    constant. A probe's value is one more output (the bytes it read), so probes work here too."""
    layout, plan = _plan(program, seed)
    flag_at: list[int] = []
    probe_at: list[int] = []

    def run(state: State) -> tuple[State, jax.Array, tuple[jax.Array, ...]]:
        state = dict(state)
        in_flight: dict[tuple[int, int], list[jax.Array]] = {}
        flags = []
        probed = []
        flag_at.clear()
        probe_at.clear()
        for idx, fn, _, _ in plan:
            ins = program.instructions[idx]
            if fn is None:
                _run_link(ins, idx, layout, state, in_flight)
                continue
            if fn is _PROBE:
                t = ins.arg("src")
                buf, off = layout.locate(t, index=idx, ins=ins)
                probed.append(read_bytes(state[buf], off, t))
                probe_at.append(idx)
                continue
            locs = {name: layout.locate(v, index=idx, ins=ins) for name, v in ins.args
                    if isinstance(v, Tile)}
            ex = _Exec(ins, locs)
            ex.run(state)
            for f in ex.flags:
                flags.append(f)
                flag_at.append(idx)
        return state, (jnp.stack(flags) if flags else jnp.zeros((0,), bool)), tuple(probed)

    return jax.jit(run, donate_argnums=0), flag_at, probe_at


def _plan(program: Program, seed: int | None = None) -> tuple[MemoryLayout, list[tuple]]:
    """The memory layout and, per instruction in a legal order, (index, compiled fn or None for
    links, buffer keys, offsets). Cached: re-running a program skips all host-side preparation."""
    layout, plan, _, _ = _planned(program, seed)
    return layout, plan


@functools.lru_cache(maxsize=16)
def _planned(program: Program, seed: int | None = None
             ) -> tuple[MemoryLayout, list[tuple], list[_Signature | None], list[list[tuple]]]:
    """``_plan``'s layout and entries, with each entry's signature (None: a link or probe) and
    the tiles it touches as (buffer key, first byte, end, written): what ``_batched_plan`` needs
    besides, found once (locating 65k tiles took a fused step 0.2 s)."""
    layout = MemoryLayout.of(program)
    plan: list[tuple] = []
    sigs: list[_Signature | None] = []
    spans: list[list[tuple]] = []
    fns: dict[_Signature, Callable] = {}  # this plan's functions: one table lookup per signature
    for idx in sequential_order(program, seed=seed):
        ins = program.instructions[idx]
        if ins.mnemonic in _NO_DATA:
            continue
        if ins.mnemonic in ("link.send", "link.recv"):
            plan.append((idx, None, (), None))
            sigs.append(None)
            spans.append([])
            continue
        if ins.mnemonic == "probe":  # (the reader's template tile, (buffer key, byte offset))
            t = ins.arg("src")
            plan.append((idx, _PROBE, _template(t), layout.locate(t, index=idx, ins=ins)))
            sigs.append(None)
            spans.append([])
            continue
        touched: list[tuple] = []
        sig, slots, offsets = _signature(ins, layout, idx, touched)
        fn = fns.get(sig)
        if fn is None:
            fn = fns[sig] = _compiled_instruction(sig, ins)
        plan.append((idx, fn, slots, offsets))
        sigs.append(sig)
        spans.append(touched)
    return layout, plan, sigs, spans


_NO_DATA = frozenset({"sem.signal", "sem.wait", "barrier"})
_COMPILED_MAX = 1024
_by_signature: dict[_Signature, Callable] = {}  # signature -> compiled function, least recent first
_by_batch: dict[tuple[_Signature, int], Callable] = {}  # (signature, batch size) -> batched function
BATCH_MIN = 4
"""Independent same-signature instructions below this many run one call each: a batch compiles
a function of its own (per power-of-two size), which two instructions rarely earn back."""


def _batch_size(n: int) -> int:
    """The compiled batch size for n instructions: the next power of two (a batch is padded by
    repeating its last instruction, which reads and writes what it did: the same bytes again)."""
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=16)
def _batched_plan(program: Program, seed: int | None = None) -> list[tuple]:
    """``_plan``'s entries as calls: (index, fn, buffer keys, offsets) for one instruction as in
    ``_plan``, or (indices, batched fn, buffer keys, offsets[size, tiles]) for a batch of
    ``BATCH_MIN`` or more independent instructions of one signature (``emu.batching``)."""
    _, plan, sigs, spans = _planned(program, seed)
    arrays: dict[str, int] = {}
    groups: list[Any] = []
    reads: list[list[tuple[int, int, int]]] = []
    writes: list[list[tuple[int, int, int]]] = []
    for (_, fn, slots, _), sig, touched in zip(plan, sigs, spans, strict=True):
        r: list[tuple[int, int, int]] = []
        w: list[tuple[int, int, int]] = []
        matmul = sig is not None and sig[0] in ("mxu.matmul", "mxu.matmul_t")
        for key, lo, hi, writes_t in touched:
            span = (arrays.setdefault(key, len(arrays)), lo, hi)
            (w if writes_t else r).append(span)
            if writes_t and matmul:
                r.append(span)  # accumulate mode reads acc too
        reads.append(r)
        writes.append(w)
        groups.append((id(fn), slots) if sig is not None else None)
    out: list[tuple] = []
    for call in batch_schedule(groups, reads, writes):
        if len(call) < BATCH_MIN:
            out.extend(plan[e] for e in call)
            continue
        first = plan[call[0]]
        size = _batch_size(len(call))
        offsets = np.stack([plan[e][3] for e in call] + [plan[call[-1]][3]] * (size - len(call)))
        fn = _batched_instruction(sigs[call[0]], program.instructions[first[0]], size,
                                  _writes_disjoint([spans[e] for e in call]))
        out.append((tuple(plan[e][0] for e in call), fn, first[2], offsets))
    return out


def _writes_disjoint(spans: list[list[tuple]]) -> bool:
    """True when no two of these entries' written ranges (``_planned``'s spans: buffer key,
    first byte, end, written) share a byte, one entry's own outputs included."""
    written = sorted((key, lo, hi) for entry in spans for key, lo, hi, w in entry if w)
    return all(a[0] != b[0] or b[1] >= a[2] for a, b in itertools.pairwise(written))


_PROBE = "probe"  # the plan's marker for a probe (its entry: index, _PROBE, template, location)


def _template(t: Tile) -> Tile:
    """``t`` at offset 0 of core 0: what a reader of its bytes depends on besides the offset."""
    return Tile(t.space, 0, 0, t.dtype, t.rows, t.cols, t.stride)


@functools.lru_cache(maxsize=256)
def _probe_reader(template: Tile) -> Callable:
    """A jitted (buffer, byte offset) -> uint8[rows, row_bytes] reading a tile like ``template``."""
    return jax.jit(lambda buf, off: read_bytes(buf, off, template))


def _probe_values(program: Program, probed: Mapping[int, Any]
                  ) -> tuple[dict[str, list[np.ndarray]], dict[str, list[tuple[int, str, str]]]]:
    """(label -> decoded values, label -> (index, engine, source)) of the probes in ``probed``
    (instruction index -> the bytes read), each label's in issue order."""
    values: dict[str, list[np.ndarray]] = {}
    sites: dict[str, list[tuple[int, str, str]]] = {}
    for idx in sorted(probed):
        ins = program.instructions[idx]
        t, label = ins.arg("src"), ins.arg("label")
        values.setdefault(label, []).append(read_values(np.asarray(probed[idx]), t.dtype, t.shape))
        sites.setdefault(label, []).append((idx, str(ins.engine), ins.source))
    return values, sites


def _canonical(ins: Instruction) -> Instruction:
    """The instruction with tile offsets zeroed and no source: one cache entry per signature."""
    args = tuple((n, Tile(v.space, 0, 0, v.dtype, v.rows, v.cols, v.stride) if isinstance(v, Tile)
                  else v) for n, v in ins.args)
    return Instruction(ins.mnemonic, Engine(0, ins.engine.unit), args, "")


def _run_link(ins, idx, layout, state, in_flight) -> None:
    """Single-chip loopback: a send to peer p pairs with the next receive from p with its tag."""
    key = link_key(ins)
    if ins.mnemonic == "link.send":
        t = ins.arg("src")
        buf, off = layout.locate(t, index=idx, ins=ins)
        in_flight.setdefault(key, []).append(read_bytes(state[buf], off, t))
        return
    t = ins.arg("dst")
    raw = in_flight[key].pop(0)
    if raw.shape != (t.rows, t.row_bytes):
        raise OutOfBounds(f"link.recv tile of {t.rows}x{t.row_bytes} B does not match the "
                          f"{raw.shape[0]}x{raw.shape[1]} B that were sent", index=idx,
                          engine=str(ins.engine), source=ins.source)
    buf, off = layout.locate(t, index=idx, ins=ins)
    state[buf] = write_bytes(state[buf], off, t, raw)
