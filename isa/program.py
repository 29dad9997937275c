"""``Program``: a kernel recorded once, as static instruction streams per engine queue.

Stage: ISA (installed as ``jalapeno_emu.isa.program``), below the emulator: the builder and the
assembler produce a Program; the emulator's checker, functional pass and timing pass read the
same one. It imports only the instruction table, so the ISA never imports the emulator
(``jalapeno_emu.emu.program`` re-exports these names for existing scripts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from jalapeno_emu.errors import IllegalInstruction

from .table import DTYPES, DType, InstrSpec, Space, by_mnemonic

__all__ = [
    "Allocation",
    "Engine",
    "HbmInit",
    "Instruction",
    "Loop",
    "Program",
    "Tile",
    "parse_engine",
]


@dataclass(frozen=True, order=True)
class Engine:
    """One in-order instruction queue.

    Attributes:
        core: core index (-1 for the chip-level link engine).
        unit: "dma", "mxu", "vpu" or "link".
        queue: DMA queue index (0 for other units).
    """

    core: int
    unit: str
    queue: int = 0

    def __str__(self) -> str:
        if self.unit == "link":
            return "link"
        return f"c{self.core}.{self.unit}{self.queue if self.unit == 'dma' else ''}"


_ENGINE_RE = re.compile(r"^c(\d+)\.(?:(dma)(\d+)|(mxu)|(vpu))$")


def parse_engine(text: str) -> Engine:
    """Parse "c3.dma1", "c0.mxu", "c0.vpu" or "link" into an Engine.

    Raises:
        IllegalInstruction: the text is not an engine name.
    """
    if text == "link":
        return Engine(-1, "link", 0)
    m = _ENGINE_RE.match(text)
    if not m:
        raise IllegalInstruction(
            f"{text!r} is not an engine; expected c<core>.dma<q>, c<core>.mxu, c<core>.vpu or link"
        )
    for number in (m.group(1), m.group(3) or "0"):
        # int() refuses more than 4,300 digits with a bare ValueError; no core or queue index has
        # more than 10 (the binary format stores them in 32 bits).
        if len(number.lstrip("0")) > 10:
            shown = repr(text) if len(text) <= 24 else f"{text[:16]!r}..."
            raise IllegalInstruction(f"engine {shown} has a core or queue number of "
                                     f"{len(number):,} digits (at most 10: they are 32-bit fields)")
    core = int(m.group(1))
    if m.group(2):
        return Engine(core, "dma", int(m.group(3)))
    return Engine(core, m.group(4) or m.group(5), 0)


_BITS: dict[str, int] = {name: d.bits for name, d in DTYPES.items()}
_new = object.__new__


@dataclass(frozen=True, init=False, slots=True)
class Tile:
    """A 2-D strided view of memory.

    Attributes:
        space: HBM, SRAM or ACC.
        core: owning core for SRAM/ACC (0 for HBM).
        offset: byte address of element [0, 0] (HBM: chip-global; SRAM/ACC: within the core).
        dtype: a name from ``isa.table.DTYPES``.
        rows, cols: shape in elements.
        stride: bytes from one row to the next (defaults to the packed row size).

    Raises:
        IllegalInstruction: unknown dtype, non-positive shape, rows that are not whole bytes,
            negative offset, or a stride smaller than a row.
    """

    space: Space
    core: int
    offset: int
    dtype: str
    rows: int
    cols: int
    stride: int = -1

    def __init__(self, space: Space, core: int, offset: int, dtype: str, rows: int, cols: int,
                 stride: int = -1) -> None:
        # Written out rather than generated: kernels create tens of thousands of tiles, and the
        # generated __init__ plus a __post_init__ reading the fields back cost twice as much.
        bits = _BITS.get(dtype)
        if bits is None:
            raise IllegalInstruction(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        if rows <= 0 or cols <= 0:
            raise IllegalInstruction(f"tile shape [{rows},{cols}] must be positive")
        if (cols * bits) % 8:
            raise IllegalInstruction(f"a {dtype} row of {cols} elements is not whole bytes")
        row_bytes = cols * bits // 8
        if stride < 0:
            stride = row_bytes
        if offset < 0:
            raise IllegalInstruction(f"tile offset {offset} is negative")
        if rows > 1 and stride < row_bytes:
            raise IllegalInstruction(
                f"row stride {stride} B is smaller than a row ({row_bytes} B): rows overlap"
            )
        # The fields through their slots' setters (what object.__setattr__, the frozen
        # dataclass way, ends up calling, without looking them up): kernels make a tile per
        # operand of most instructions.
        _SET_SPACE(self, space)
        _SET_CORE(self, core)
        _SET_OFFSET(self, offset)
        _SET_DTYPE(self, dtype)
        _SET_ROWS(self, rows)
        _SET_COLS(self, cols)
        _SET_STRIDE(self, stride)

    @property
    def dt(self) -> DType:
        """The DType row."""
        return DTYPES[self.dtype]

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols)."""
        return (self.rows, self.cols)

    @property
    def row_bytes(self) -> int:
        """Bytes in one row."""
        return DTYPES[self.dtype].row_bytes(self.cols)

    @property
    def nbytes(self) -> int:
        """Bytes of data (rows x row_bytes; gaps between rows excluded)."""
        return self.rows * self.row_bytes

    @property
    def end(self) -> int:
        """One past the last byte touched."""
        return self.offset + (self.rows - 1) * self.stride + self.row_bytes

    @property
    def contiguous(self) -> bool:
        """True when the rows are packed back to back."""
        return self.rows == 1 or self.stride == self.row_bytes

    def region(self) -> str:
        """Readable address range, e.g. "sram[c0]:0x100..0x300"."""
        where = "hbm" if self.space is Space.HBM else f"{self.space.value}[c{self.core}]"
        return f"{where}:{self.offset:#x}..{self.end:#x}"

    def sub(self, row: int, col: int, rows: int, cols: int) -> Tile:
        """The [rows, cols] sub-tile starting at element [row, col] (same stride)."""
        if row < 0 or col < 0 or row + rows > self.rows or col + cols > self.cols:
            raise IllegalInstruction(
                f"sub-tile [{row}:{row + rows}, {col}:{col + cols}] is outside [{self.rows},{self.cols}]"
            )
        dtype = self.dtype
        bits = _BITS[dtype]
        if (col * bits) % 8:
            raise IllegalInstruction(f"column {col} of a {dtype} tile is not byte aligned")
        stride = self.stride
        offset = self.offset + row * stride + col * bits // 8
        if rows <= 0 or cols <= 0 or (cols * bits) % 8:  # Tile() says what is wrong
            return Tile(self.space, self.core, offset, dtype, rows, cols, stride)
        # Inside a valid tile, with its dtype and stride, a region of whole bytes is a valid tile
        # (offset >= 0; a stride that held a wider row holds this one): no need to check again.
        t = _new(Tile)
        _SET_SPACE(t, self.space)
        _SET_CORE(t, self.core)
        _SET_OFFSET(t, offset)
        _SET_DTYPE(t, dtype)
        _SET_ROWS(t, rows)
        _SET_COLS(t, cols)
        _SET_STRIDE(t, stride)
        return t

    def __str__(self) -> str:
        where = "hbm" if self.space is Space.HBM else f"{self.space.value}[{self.core}]"
        text = f"{where}:{self.offset:#x}:{self.dtype}[{self.rows},{self.cols}]"
        return text if self.contiguous else f"{text}/{self.stride}"


_SET_SPACE, _SET_CORE, _SET_OFFSET, _SET_DTYPE, _SET_ROWS, _SET_COLS, _SET_STRIDE = (
    Tile.__dict__[name].__set__ for name in ("space", "core", "offset", "dtype", "rows", "cols", "stride"))


@dataclass(frozen=True, slots=True)
class Instruction:
    """One instruction, issued to one engine.

    Attributes:
        mnemonic: the table row's mnemonic.
        engine: the queue it is issued to.
        args: operand values by name (Tile, int, float, str for enums; None for absent tiles).
        source: where it was built ("kernel.py:42") or assembled ("k.jasm:7"), or "".
    """

    mnemonic: str
    engine: Engine
    args: tuple[tuple[str, Any], ...]
    source: str = ""

    @property
    def spec(self) -> InstrSpec:
        """The instruction table row."""
        row = by_mnemonic(self.mnemonic)
        assert row is not None, self.mnemonic
        return row

    def arg(self, name: str) -> Any:
        """The value of operand ``name``."""
        for k, v in self.args:
            if k == name:
                return v
        raise KeyError(name)

    @property
    def kwargs(self) -> dict[str, Any]:
        """Operands as a dict."""
        return dict(self.args)

    def tiles(self) -> list[tuple[str, Tile, bool]]:
        """(operand name, tile, writes) for every tile operand present."""
        out = []
        for op in self.spec.operands:
            if op.kind == "tile":
                t = self.arg(op.name)
                if t is not None:
                    out.append((op.name, t, op.writes))
        return out


@dataclass(frozen=True)
class Loop:
    """A hardware loop: ``body`` issued ``count`` times in a row to one engine, with affine operands.

    Iteration ``i`` (0-based) is the body with every operand named in ``steps`` advanced by ``i``
    times its step: a tile's ``offset`` by that many bytes, an integer operand (``imm`` or ``sem``:
    a ``sem.wait`` value, a semaphore id, a barrier id, a link tag) by that much. Everything else
    is the same in every iteration. This is what a Pallas grid or a DSP's zero-overhead loop
    expresses, and what keeps a program's size independent of its problem size: a K loop of a
    GEMM is one Loop per engine however deep K is.

    The loop means exactly its unrolled instructions (``expand``): the checker, the functional
    pass and the assembler may read it unrolled; the timing pass reads the body once and derives
    the iterations' costs as arrays.

    Attributes:
        engine: the queue every body instruction is issued to.
        body: iteration 0's instructions, all on ``engine``.
        count: iterations (at least 1).
        steps: per body instruction, ``(operand name, step)`` pairs; integers.

    Raises:
        IllegalInstruction: an empty body, a count below 1, a body instruction on another engine,
            steps that do not match the body, a step on an operand that is not a tile or an
            integer, or a last iteration whose tile offsets or integers would be negative.
    """

    engine: Engine
    body: tuple[Instruction, ...]
    count: int
    steps: tuple[tuple[tuple[str, int], ...], ...]

    def __post_init__(self) -> None:
        if type(self.count) is not int or self.count < 1:
            raise IllegalInstruction(f"a loop runs at least once; count {self.count!r}",
                                     engine=str(self.engine))
        if not self.body:
            raise IllegalInstruction("a loop needs at least one instruction in its body",
                                     engine=str(self.engine))
        if len(self.steps) != len(self.body):
            raise IllegalInstruction(f"a loop of {len(self.body)} body instructions has steps for "
                                     f"{len(self.steps)}", engine=str(self.engine))
        last = self.count - 1
        for ins, steps in zip(self.body, self.steps, strict=True):
            if ins.engine != self.engine:
                raise IllegalInstruction(f"a loop on {self.engine} holds a {ins.mnemonic} for {ins.engine}",
                                         engine=str(self.engine), source=ins.source or None)
            args = dict(ins.args)
            for name, step in steps:
                value = args.get(name, _ABSENT)
                if type(step) is not int:
                    raise IllegalInstruction(f"loop step of {ins.mnemonic} operand {name!r} is "
                                             f"{step!r}; steps are integers", engine=str(self.engine),
                                             source=ins.source or None)
                if isinstance(value, Tile):
                    end = value.offset + last * step
                elif type(value) is int:
                    end = value + last * step
                else:
                    raise IllegalInstruction(
                        f"{ins.mnemonic} has no tile or integer operand {name!r} to step in a loop",
                        engine=str(self.engine), source=ins.source or None)
                if end < 0:
                    raise IllegalInstruction(
                        f"loop iteration {last} of {ins.mnemonic} would take operand {name!r} to {end}",
                        engine=str(self.engine), source=ins.source or None)

    @property
    def size(self) -> int:
        """Instructions the loop stands for (count x body length)."""
        return self.count * len(self.body)

    def iteration(self, i: int) -> tuple[Instruction, ...]:
        """Iteration ``i``'s instructions (0 <= i < count)."""
        if not 0 <= i < self.count:
            raise IndexError(f"iteration {i} of a {self.count}-iteration loop")
        if i == 0:
            return self.body
        return tuple(_advanced(ins, steps, i) if steps else ins
                     for ins, steps in zip(self.body, self.steps, strict=True))

    def expand(self) -> list[Instruction]:
        """Every iteration's instructions, in issue order."""
        out: list[Instruction] = []
        for i in range(self.count):
            out.extend(self.iteration(i))
        return out


_ABSENT = object()


def _advanced(ins: Instruction, steps: tuple[tuple[str, int], ...], i: int) -> Instruction:
    """``ins`` with each stepped operand advanced ``i`` steps."""
    by_name = dict(steps)
    args = []
    for name, value in ins.args:
        step = by_name.get(name)
        if step is not None:
            if isinstance(value, Tile):
                value = Tile(value.space, value.core, value.offset + i * step, value.dtype, value.rows,
                             value.cols, value.stride)
            else:
                value = value + i * step
        args.append((name, value))
    return Instruction(ins.mnemonic, ins.engine, tuple(args), ins.source)


@dataclass(frozen=True)
class Allocation:
    """A named region of memory.

    Attributes:
        name: unique within its space and core; ``region/name`` inside a builder region
            (``KernelBuilder.region``), see ``scope``.
        space: HBM, SRAM or ACC.
        core: owning core for SRAM/ACC (0 for HBM).
        offset: first byte.
        nbytes: size in bytes.
        source: where it was allocated ("kernel.py:42", "k.jasm:3"), or "" (for messages; not
            encoded, not compared).
    """

    name: str
    space: Space
    core: int
    offset: int
    nbytes: int
    source: str = field(default="", compare=False)

    @property
    def end(self) -> int:
        """One past the last byte."""
        return self.offset + self.nbytes

    @property
    def scope(self) -> str:
        """The region that made it: the part of ``name`` before its first ``/`` ("" if none).

        A fused program reuses a core's scratchpad and accumulators from one operator to the
        next, so allocations of two *different* regions may overlap (the checker's race
        detector proves that the reuse is ordered); allocations of one region, or made
        outside any region, never overlap.
        """
        head, sep, _ = self.name.partition("/")
        return head if sep else ""


@dataclass(frozen=True)
class HbmInit:
    """Initial contents of an HBM allocation, for programs that bring their own data (assembly).

    Attributes:
        name: the allocation.
        kind: "zeros", "ones" or "normal" (seeded standard normal, as float32/bf16 per dtype).
        dtype: element type to fill with.
        seed: seed for "normal".
    """

    name: str
    kind: str
    dtype: str = "f32"
    seed: int = 0


@dataclass(frozen=True, init=False)
class Program:
    """A recorded kernel.

    Attributes:
        name: the kernel's name.
        items: what was issued, in issue order: instructions and ``Loop``s (each engine runs its
            own subsequence in order). A program without loops has ``items == instructions``.
        allocations: named HBM, SRAM and accumulator regions.
        preset: the chip preset the program was built for.
        semaphores: names of semaphore ids (id -> name), for messages and traces.
        inits: initial HBM contents (used by ``run`` on assembly files).
        meta: what the builder recorded beyond the instructions (not encoded, not compared):
            "tensors" (HBM name -> (dtype, (rows, cols))), "buffers" ((space value, core, name)
            -> (dtype, (rows, cols)) of each scratchpad and accumulator allocation) and
            "regions" (name -> [start, end) ranges of ``instructions`` indices);
            ``FunctionalResult.read`` reads values back with these.

    The constructor's ``instructions`` takes the items (plain instructions, loops or both); the
    ``instructions`` attribute is every instruction with the loops unrolled, made when first
    read. Two programs are equal when their items are: a loop and its unrolled form are two
    representations of one program (compare ``instructions`` to compare what they do).
    """

    name: str
    items: tuple[Instruction | Loop, ...]
    allocations: tuple[Allocation, ...] = ()
    preset: str = "tiny"
    semaphores: tuple[tuple[int, str], ...] = ()
    inits: tuple[HbmInit, ...] = ()
    meta: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    def __init__(self, name: str, instructions: tuple[Instruction | Loop, ...] | Any = _ABSENT,
                 allocations: tuple[Allocation, ...] = (), preset: str = "tiny",
                 semaphores: tuple[tuple[int, str], ...] = (), inits: tuple[HbmInit, ...] = (),
                 meta: tuple[tuple[str, Any], ...] = (), *,
                 items: tuple[Instruction | Loop, ...] | None = None) -> None:
        # ``items=`` is the field's own name, which ``dataclasses.replace`` always passes: an
        # ``instructions=`` given beside it is the change asked for
        items = tuple(instructions if instructions is not _ABSENT else items or ())
        for attr, value in (("name", name), ("items", items), ("allocations", allocations),
                            ("preset", preset), ("semaphores", semaphores), ("inits", inits),
                            ("meta", meta)):
            object.__setattr__(self, attr, value)
        if Loop not in map(type, items):
            self.__dict__["instructions"] = items  # nothing to unroll: the same tuple

    @cached_property
    def instructions(self) -> tuple[Instruction, ...]:
        """Every instruction, loops unrolled, in issue order."""
        out: list[Instruction] = []
        for item in self.items:
            if type(item) is Loop:
                out.extend(item.expand())
            else:
                out.append(item)
        return tuple(out)

    def __hash__(self) -> int:
        # Programs key the functional pass's caches, which look one up on every run: hashing a
        # fused step's 30k instructions each time cost 0.1 s a run (tiny-gpt-oss, 2 cores). The
        # fields never change, so the hash is made once.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.name, self.items, self.allocations, self.preset, self.semaphores, self.inits))
            self.__dict__["_hash"] = h
        return h

    def __getstate__(self) -> dict[str, Any]:
        # A string's hash differs between processes (hash randomisation): a pickled program
        # makes its own hash where it lands.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def loops(self) -> tuple[Loop, ...]:
        """The loops among the items."""
        return tuple(item for item in self.items if type(item) is Loop)

    @property
    def n_instructions(self) -> int:
        """``len(instructions)``, without unrolling the loops."""
        if "instructions" in self.__dict__:
            return len(self.__dict__["instructions"])
        return sum(item.size if type(item) is Loop else 1 for item in self.items)

    def engines(self) -> list[Engine]:
        """Engines with at least one instruction, sorted."""
        return sorted({i.engine for i in self.items})

    def streams(self) -> dict[Engine, list[int]]:
        """Instruction indices per engine, in issue order."""
        out: dict[Engine, list[int]] = {}
        for idx, ins in enumerate(self.instructions):
            out.setdefault(ins.engine, []).append(idx)
        return out

    def allocation(self, name: str, space: Space | None = None, core: int | None = None) -> Allocation:
        """The allocation called ``name`` (optionally in ``space`` / on ``core``)."""
        for a in self.allocations:
            if a.name == name and (space is None or a.space is space) and (core is None or a.core == core):
                return a
        raise KeyError(name)
