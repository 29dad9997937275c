"""The kernel builder: write kernels in Python, get a static ``Program``.

Stage: ISA (front end). Python loops unroll into the Program; every instruction remembers the
user's source line; legality is checked at issue time, so an illegal instruction fails where it
was written. Methods on engine handles are derived from the instruction table: ``dma.load`` is
``core.dma[0].load(dst, src)``, ``vec.unary`` is ``core.vpu.unary("exp", dst, src)`` (or the
short ``core.vpu.exp(dst, src)``), ``sem.signal`` is ``core.mxu.signal(sem)`` on any engine.

Example:
    >>> kb = KernelBuilder("copy", chip="tiny")
    >>> x = kb.hbm("x", (8, 64), "f32")
    >>> buf = kb.sram(0, "buf", (8, 64), "f32")
    >>> done = kb.semaphore("loaded")
    >>> c0 = kb.core(0)
    >>> _ = c0.dma[0].load(buf, x); _ = c0.dma[0].signal(done)
    >>> _ = c0.vpu.wait(done, 1); _ = c0.vpu.exp(buf, buf)
    >>> len(kb.build().instructions)
    4
"""

from __future__ import annotations

import difflib
import functools
import os
import sys
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from jalapeno_emu.chip import ChipSpec, load_preset
from jalapeno_emu.errors import CapacityExceeded, IllegalInstruction, InvalidArgumentError, InvalidTypeError
from jalapeno_emu.isa.program import Allocation, Engine, Instruction, Loop, Program, Tile
from jalapeno_emu.mx.formats import canonical_format, describe_formats

from .legality import check_instruction, cores_only_compared_with_cores, integer_points, operands_read
from .loops import loops_from_iterations
from .table import DTYPES, TABLE, InstrSpec, Space

__all__ = ["CoreHandle", "DmaQueues", "EngineHandle", "KernelBuilder", "MXTensor", "Region", "Semaphore",
           "unrolled_loops"]

# False inside ``unrolled_loops()``: every ``repeat`` issues all its iterations as instructions.
_LOOPS_ON = [True]


@contextmanager
def unrolled_loops() -> Iterator[None]:
    """Inside this block, ``KernelBuilder.repeat`` unrolls: every kernel built here is the same
    program with its loops written out, instruction by instruction (what tests compare a looped
    program with, and a way to rule loops out when chasing a problem)."""
    _LOOPS_ON.append(False)
    try:
        yield
    finally:
        _LOOPS_ON.pop()

_HBM_ALIGN = 4096  # allocations start on a page so that tiles map to channels predictably
_SRAM_ALIGN = 64
_THIS_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=256)
def _in_builder(filename: str) -> bool:
    return os.path.dirname(os.path.abspath(filename)) == _THIS_DIR


# File name -> its base name, for the files of user code seen so far (never for isa/ files).
_LABELS: dict[str, str] = {}


# (id of a code object, instruction offset) -> (the code object, "file:line"): a frame's line
# number is worked out from its code's line table, a scan that costs more than issuing the
# instruction in long kernel functions; a call site's line never changes. The code object is
# kept so that an id reused after it is freed cannot match.
_SITES: dict[tuple[int, int], tuple[Any, str]] = {}


def _site(frame: Any, label: str) -> str:
    """"label:line" of ``frame``'s current line, cached per call site."""
    code = frame.f_code
    key = (id(code), frame.f_lasti)
    hit = _SITES.get(key)
    if hit is not None and hit[0] is code:
        return hit[1]
    if len(_SITES) >= 1 << 16:  # generated code could make call sites without end
        _SITES.clear()
    text = f"{label}:{frame.f_lineno}"
    _SITES[key] = (code, text)
    return text


def _caller_source() -> str:
    """"file:line" of the first frame outside the builder (the user's kernel code)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not _in_builder(name):
            label = _LABELS.get(name)
            if label is None:
                label = _LABELS[name] = os.path.basename(name)
            return _site(frame, label)
        frame = frame.f_back
    return ""


def _source_of_caller() -> str:
    """``_caller_source()`` for an issue method: its caller's frame is usually the kernel's, whose
    file is then known."""
    frame = sys._getframe(2)
    code = frame.f_code
    hit = _SITES.get((id(code), frame.f_lasti))
    if hit is not None and hit[0] is code:
        return hit[1]
    label = _LABELS.get(code.co_filename)
    return _site(frame, label) if label is not None else _caller_source()


@dataclass(frozen=True)
class Semaphore:
    """A semaphore handle: its id and name."""

    id: int
    name: str

    def __index__(self) -> int:
        return self.id


@dataclass(frozen=True, slots=True)
class MXTensor:
    """An MX tensor in memory: element codes and their E8M0 scales, blocked by 32 along ``axis``.

    Attributes:
        codes: [R, C] tile of element codes (fp4 packed two per byte, fp8 one per byte).
        scales: [R, C/32] (axis 1) or [R/32, C] (axis 0) tile of E8M0 bytes.
        axis: the blocked axis.
    """

    codes: Tile
    scales: Tile
    axis: int

    def sub(self, row: int, col: int, rows: int, cols: int) -> MXTensor:
        """The [rows, cols] block-aligned sub-tensor at element [row, col], with its scales."""
        if self.axis == 1:
            if col % 32 or cols % 32:
                raise IllegalInstruction(f"columns {col}..{col + cols} of an MX tensor blocked along "
                                         "columns must be multiples of 32")
            scales = self.scales.sub(row, col // 32, rows, cols // 32)
        else:
            if row % 32 or rows % 32:
                raise IllegalInstruction(f"rows {row}..{row + rows} of an MX tensor blocked along "
                                         "rows must be multiples of 32")
            scales = self.scales.sub(row // 32, col, rows // 32, cols)
        out = _new(MXTensor)  # the fields of a valid tensor's parts: set, not checked again
        _SET_MX_CODES(out, self.codes.sub(row, col, rows, cols))
        _SET_MX_SCALES(out, scales)
        _SET_MX_AXIS(out, self.axis)
        return out


_new = object.__new__
_SET_MX_CODES, _SET_MX_SCALES, _SET_MX_AXIS = (
    MXTensor.__dict__[name].__set__ for name in ("codes", "scales", "axis"))


_MATMUL_OPERANDS = ("acc", "a", "b", "a_scale", "b_scale", "mode")
_getframe = sys._getframe
_UNARY_OPS = TABLE[[s.mnemonic for s in TABLE].index("vec.unary")].operand("op").choices
_BINARY_OPS = TABLE[[s.mnemonic for s in TABLE].index("vec.binary")].operand("op").choices


class EngineHandle:
    """Issues instructions to one engine queue; its methods come from the instruction table."""

    def __init__(self, builder: KernelBuilder, engine: Engine) -> None:
        # A weak reference back to the builder (and methods that do not capture the handle): the
        # builder owns its handles, so a strong one would put the builder, and every instruction
        # it recorded, in a reference cycle that only the cyclic collector frees, after walking
        # them all (a tenth of a sweep's time); this way a dropped build is freed at once.
        self._kb = weakref.proxy(builder)
        self.engine = engine
        self._rows = {s.mnemonic.split(".")[-1]: s for s in TABLE
                      if s.unit in (engine.unit, "any")}

    def __repr__(self) -> str:
        return f"EngineHandle({self.engine})"

    def issue(self, mnemonic: str, *args: Any, **kwargs: Any) -> Instruction:
        """Issue ``mnemonic`` with operands given positionally (table order) or by name."""
        row = next((s for s in TABLE if s.mnemonic == mnemonic), None)
        if row is None:
            text = str(mnemonic)
            op = _operation_of(TABLE, text.split(".")[-1])  # "vec.exp": an operation of vec.unary
            near = ([f'{op.mnemonic} with {op.operands[0].name}="{text.split(".")[-1]}"'] if op
                    else difflib.get_close_matches(text, [s.mnemonic for s in TABLE], n=3))
            raise IllegalInstruction(f"unknown instruction {mnemonic!r}"
                                     + (f"; did you mean {' or '.join(near)}?" if near else ""),
                                     engine=str(self.engine), source=_caller_source())
        return self._kb._issue(self.engine, row, args, kwargs, _caller_source())

    def __getattr__(self, name: str) -> Any:
        # Only called for names not in the instance: the method is made once per handle and name
        # and kept in the instance, so later calls find it directly (kernels issue through the
        # same few methods tens of thousands of times).
        rows = self.__dict__.get("_rows", {})
        engine = self.__dict__.get("engine")
        if name in rows:
            row = rows[name]
            layout = _LAYOUTS[row.mnemonic]
            n_operands = len(layout.names)
            pads = layout.pads

            def method(*a: Any, **k: Any) -> Instruction:
                # _source_of_caller's cache hit, inline: one call fewer per instruction
                frame = _getframe(1)
                code = frame.f_code
                hit = _SITES.get((id(code), frame.f_lasti))
                source = hit[1] if hit is not None and hit[0] is code else _source_of_caller()
                if k or len(a) != n_operands:
                    tail = None if k else pads.get(len(a))
                    a = a + tail if tail is not None else _bind(engine, row, layout, a, k, source)
                return layout.issue(kb, engine, a, source)
        elif name in _UNARY_OPS and "unary" in rows:
            unary = _LAYOUTS[rows["unary"].mnemonic]

            # *a rather than (dst, src): a wrong call then fails as a project error that names
            # the instruction, not as a TypeError about this closure; the check costs one len().
            def method(*a: Any, **k: Any) -> Instruction:
                if k or len(a) != 2:
                    a = _bind_short(engine, unary, name, a, k, _source_of_caller())
                frame = _getframe(1)
                code = frame.f_code
                hit = _SITES.get((id(code), frame.f_lasti))
                source = hit[1] if hit is not None and hit[0] is code else _source_of_caller()
                return unary.issue(kb, engine, (name, *a), source)
        elif name in _BINARY_OPS and "binary" in rows:
            binary = _LAYOUTS[rows["binary"].mnemonic]

            def method(*a: Any, **k: Any) -> Instruction:
                if k or len(a) != 3:
                    a = _bind_short(engine, binary, name, a, k, _source_of_caller())
                frame = _getframe(1)
                code = frame.f_code
                hit = _SITES.get((id(code), frame.f_lasti))
                source = hit[1] if hit is not None and hit[0] is code else _source_of_caller()
                return binary.issue(kb, engine, (name, *a), source)
        elif name.startswith("_") or not rows:
            # Protocol probes (copy's __deepcopy__, pickle's __getstate__) and a half-built
            # handle: the plain error, at once.
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        else:
            raise AttributeError(_unknown_instruction(engine, rows, name))
        kb = self._kb
        self.__dict__[name] = method
        return method

    def matmul_mx(self, acc: Tile, a: MXTensor | Tile, b: MXTensor | Tile,
                  mode: str = "accumulate") -> Instruction:
        """``mxu.matmul`` with MXTensor operands (codes and scales passed together)."""
        a_codes, a_scale = (a.codes, a.scales) if isinstance(a, MXTensor) else (a, None)
        b_codes, b_scale = (b.codes, b.scales) if isinstance(b, MXTensor) else (b, None)
        row = self._rows["matmul"]
        layout = _LAYOUTS.get(row.mnemonic)
        if layout is not None and layout.row is row and layout.names == _MATMUL_OPERANDS:
            # every operand given in table order: what binding them by name would produce
            return layout.issue(self._kb, self.engine, (acc, a_codes, b_codes, a_scale, b_scale, mode),
                                _source_of_caller())
        return self._kb._issue(self.engine, row, (acc, a_codes, b_codes),
                               {"a_scale": a_scale, "b_scale": b_scale, "mode": mode},
                               _caller_source())


class DmaQueues(list):
    """A core's DMA queue handles, ``core.dma[q]``: a list whose out-of-range index is the
    project's error, naming how many queues the chip has (a bare ``IndexError`` named neither)."""

    __slots__ = ("chip", "core")

    def __init__(self, handles: list[EngineHandle], chip: str, core: int) -> None:
        super().__init__(handles)
        self.chip, self.core = chip, core

    def __getitem__(self, index: Any) -> Any:
        try:
            return list.__getitem__(self, index)
        except IndexError:
            n = len(self)
            raise InvalidArgumentError(
                f"dma[{index}] does not exist: core {self.core} of {self.chip} has {n} DMA queues, "
                f"dma[0]..dma[{n - 1}]", hint="the count is the preset's dma.queues_per_core; "
                "len(core.dma) gives it") from None
        except TypeError:
            raise InvalidTypeError(f"dma[{index!r}]: a DMA queue index must be an integer (or a "
                                   f"slice), not {type(index).__name__}") from None


class CoreHandle:
    """The engines of one core: ``dma[q]``, ``mxu``, ``vpu``."""

    def __init__(self, builder: KernelBuilder, core: int, queues: int) -> None:
        self.index = core
        self.dma = DmaQueues([EngineHandle(builder, Engine(core, "dma", q)) for q in range(queues)],
                             builder.chip.name, core)
        self.mxu = EngineHandle(builder, Engine(core, "mxu"))
        self.vpu = EngineHandle(builder, Engine(core, "vpu"))


class Region:
    """A named part of a program being built; see :meth:`KernelBuilder.region`.

    Attributes:
        name: the region's name (the prefix of its allocations and semaphores).
        arena: where its scratchpad/accumulator memory comes from (None: the builder's).
        fences: (semaphore id, value) each of its engines waits for before its first instruction.
        engines: every engine that issued an instruction in the region, in first-use order.
        ranges: [start, end) instruction indices of each time the region was entered.
        done: after :meth:`close`, (semaphore, count): the count the semaphore reaches once
            every engine of the region has finished everything it issued in the region.
    """

    def __init__(self, kb: KernelBuilder, name: str, arena: Any, fences: tuple[tuple[int, int], ...]) -> None:
        # weak, like EngineHandle's: the builder keeps its regions
        self.kb, self.name, self.arena = weakref.proxy(kb), name, arena
        self.fences: list[tuple[int, int]] = []
        self.engines: dict[Engine, None] = {}
        # id -> Engine object already in ``engines`` (kept: its id is not reused): the issue
        # functions test this on every instruction, cheaper than hashing the Engine.
        self._seen: dict[int, Engine] = {}
        self.ranges: list[tuple[int, int]] = []
        self.done: tuple[Semaphore, int] | None = None
        self._start = -1
        self._outer: Region | None = None
        # Fences another fence of the region implies (a closed region's done condition implies
        # every fence it waited for): waiting for them again orders nothing. Without this, a fused
        # step's regions collected the done conditions of every earlier region that had used
        # their memory, on every core, and each engine waited for all of them (gpt-oss-120b:
        # 192 waits in layer 0's first norm, 8,192 in layer 5's second).
        self._covered: set[tuple[int, int]] = set()
        self._take(fences)

    def _take(self, fences: Any) -> list[tuple[int, int]]:
        """Add the fences that neither the region's nor each other's imply; returns those added."""
        implied = self.kb._implied
        new = [f for f in dict.fromkeys(fences) if f not in self.fences]
        for f in new:
            self._covered.update(implied.get(f, ()))
        new = [f for f in new if f not in self._covered]
        self.fences.extend(new)
        return new

    def __enter__(self) -> Region:
        if self.done is not None:
            raise InvalidArgumentError(f"region {self.name!r} is closed")
        if self.kb._region is not None:
            raise InvalidArgumentError(f"region {self.name!r} entered inside region {self.kb._region.name!r}")
        self.kb._region = self
        self._start = len(self.kb._instructions)
        return self

    def __exit__(self, *exc: object) -> None:
        self.kb._region = None
        end = len(self.kb._instructions)
        if end > self._start:
            self.ranges.append((self._start, end))

    def _enter(self, engine: Engine) -> None:
        """Before an instruction of an Engine object not seen in the region yet."""
        if engine not in self.engines:
            self._first_use(engine)
        self._seen[id(engine)] = engine

    def _first_use(self, engine: Engine) -> None:
        """Before the engine's first instruction in the region: wait for every fence."""
        self.engines[engine] = None
        wait = _LAYOUTS["sem.wait"]
        covered = self._covered
        for f in self.fences:
            if f not in covered:  # (a fence added later may imply an earlier one)
                wait.issue(self.kb, engine, f, f"{self.name}:fence")

    def add_fences(self, fences: Any) -> None:
        """Add fence conditions; engines already in the region wait for the new ones now (their
        later instructions are the ones that may touch what the fences guard)."""
        new = self._take(fences)
        if not new:
            return
        if self.engines:
            if self.kb._region is not self:
                raise InvalidArgumentError(f"fences added to region {self.name!r} while it is not entered")
            wait = _LAYOUTS["sem.wait"]
            for engine in self.engines:
                for sem, value in new:
                    wait.issue(self.kb, engine, (sem, value), f"{self.name}:fence")

    def close(self) -> tuple[Semaphore, int]:
        """End the region: every engine of it signals one semaphore, whose count reaching the
        number of engines means the region is done (a DMA queue's signal lands when its
        transfers have). Returns (semaphore, count); (semaphore, 0) for an empty region."""
        if self.done is not None:
            return self.done
        with self:
            sem = self.kb.semaphore("done")
            signal = _LAYOUTS["sem.signal"]
            for engine in list(self.engines):
                signal.issue(self.kb, engine, (sem.id, 1), f"{self.name}:done")
        self.done = (sem, len(self.engines))
        if self.engines:  # every engine signals after waiting for every fence: done implies them
            self.kb._implied[(sem.id, len(self.engines))] = frozenset(self._covered.union(self.fences))
        return self.done


class KernelBuilder:
    """Records a kernel as a Program.

    Args:
        name: kernel name.
        chip: a ChipSpec or a preset name (capacities, cores and DMA queues come from it).
    """

    def __init__(self, name: str, chip: ChipSpec | str = "tiny") -> None:
        self.name = name
        self.chip = load_preset(chip) if isinstance(chip, str) else chip
        self.preset = chip if isinstance(chip, str) else self.chip.name
        self._instructions: list[Instruction | Loop] = []
        self._allocs: list[Allocation] = []
        self._alloc_names: set[tuple[Space, int, str]] = set()
        self._legal: set[tuple] = set()  # instruction signatures already found legal
        self._next: dict[tuple[Space, int], int] = {}
        self._sems: list[Semaphore] = []
        self._cores: dict[int, CoreHandle] = {}
        self._tensors: dict[str, tuple[str, tuple[int, int]]] = {}
        # On-chip buffers as allocated, (space, core, name) -> (dtype, shape), for reading back.
        self._buffers: dict[tuple[str, int, str], tuple[str, tuple[int, int]]] = {}
        self._region: Region | None = None  # the region being emitted into, if any
        self._regions: list[Region] = []
        # A closed region's done condition -> every fence condition it implies (Region._take).
        self._implied: dict[tuple[int, int], frozenset[tuple[int, int]]] = {}
        self.link = EngineHandle(self, Engine(-1, "link"))

    # --- regions --------------------------------------------------------------------------
    def region(self, name: str, *, arena: Any = None, fences: tuple[tuple[int, int], ...] = ()) -> Region:
        """A named region of the program (one operator of a fused program); enter it with ``with``.

        Inside it, allocation and semaphore names get the prefix ``name/`` (so a kernel's code
        runs unchanged in a region of a larger program), scratchpad and accumulator offsets come
        from ``arena`` when one is given (memory reused from earlier regions), and every engine
        that issues an instruction first waits for each ``fences`` condition (semaphore id,
        value): what makes reused memory safe to write. A region may be entered several times
        (a prefetch part, then the rest); :meth:`Region.close` ends it.

        Args:
            name: unique in the program, no ``/``.
            arena: an object with ``alloc(space, core, nbytes, align, region, keep) -> (offset,
                fences)`` (``kernels.compose.Arena``), or None for the builder's own bump
                allocation.
            fences: (semaphore id, value) every engine of the region waits for first.
        """
        if not name or "/" in name:
            raise InvalidArgumentError(f"region name {name!r} must be non-empty and contain no '/'")
        if any(r.name == name for r in self._regions):
            raise InvalidArgumentError(f"region {name!r} already exists in this program")
        reg = Region(self, name, arena, fences)
        self._regions.append(reg)
        return reg

    # --- memory ---------------------------------------------------------------------------
    def _alloc(self, space: Space, core: int, name: str, nbytes: int, align: int, keep: bool = False) -> int:
        reg = self._region
        if reg is not None:
            name = f"{reg.name}/{name}"
        key = (space, core if space is not Space.HBM else 0, name)
        if key in self._alloc_names:
            raise InvalidArgumentError(f"allocation {name!r} already exists in {space.value}")
        if space is not Space.HBM and not 0 <= core < self.chip.core.count:
            raise InvalidArgumentError(
                f"core {core} does not exist: {self.chip.name} has {self.chip.core.count} cores")
        source = _caller_source()
        if reg is not None and reg.arena is not None and space is not Space.HBM:
            start, fences = reg.arena.alloc(space, core, nbytes, align, reg, keep)
            reg.add_fences(fences)
            self._allocs.append(Allocation(name, space, core, start, nbytes, source))
            self._alloc_names.add(key)
            return start
        # capacities read here: an arena's allocations (most of a fused program's) never need them
        capacity = {Space.HBM: self.chip.hbm.capacity_bytes,
                    Space.SRAM: self.chip.sram.scratchpad_bytes,
                    Space.ACC: self.chip.sram.accumulator_bytes}[space]
        start = -(-self._next.get((space, core), 0) // align) * align
        if start + nbytes > capacity:
            where = "HBM" if space is Space.HBM else f"{space.value} of core {core}"
            raise CapacityExceeded(
                f"allocating {name!r} ({nbytes:,} B) in {where}: {capacity - start:,} B of "
                f"{capacity:,} B are free", source=source or None,
                hint="use smaller tiles or reuse buffers")
        self._next[(space, core)] = start + nbytes
        self._allocs.append(Allocation(name, space, core if space is not Space.HBM else 0,
                                       start, nbytes, source))
        self._alloc_names.add(key)
        return start

    def _tile(self, space: Space, core: int, name: str, shape: tuple[int, int], dtype: str,
              align: int, keep: bool = False) -> Tile:
        if dtype not in DTYPES:
            # The MX spellings ("e2m1", "e4m3", "bfloat16") name the same stored types.
            canonical = canonical_format(dtype, DTYPES)
            if canonical is None:
                raise InvalidArgumentError(
                    f"dtype={dtype!r} is not one of {describe_formats(sorted(DTYPES))}")
            dtype = canonical
        rows, cols = shape
        nbytes = rows * DTYPES[dtype].row_bytes(cols)
        off = self._alloc(space, core, name, nbytes, align, keep)
        if space is Space.HBM:
            self._tensors[self._scoped(name)] = (dtype, (rows, cols))
        else:
            self._buffers[(space.value, core, self._scoped(name))] = (dtype, (rows, cols))
        return Tile(space, core if space is not Space.HBM else 0, off, dtype, rows, cols)

    def hbm(self, name: str, shape: tuple[int, int], dtype: str) -> Tile:
        """Allocate a named [rows, cols] tensor in HBM; returns its whole tile."""
        return self._tile(Space.HBM, 0, name, shape, dtype, _HBM_ALIGN)

    def hbm_mx(self, name: str, shape: tuple[int, int], fmt: str = "fp4", axis: int = 1) -> MXTensor:
        """Allocate an MX tensor in HBM: ``name`` (codes) and ``name.scales``."""
        return self._mx(Space.HBM, 0, name, shape, fmt, axis, _HBM_ALIGN)

    def _scoped(self, name: str) -> str:
        """``name`` as recorded: prefixed by the current region's name, if any."""
        return name if self._region is None else f"{self._region.name}/{name}"

    def sram(self, core: int, name: str, shape: tuple[int, int], dtype: str, *, keep: bool = False) -> Tile:
        """Allocate a named tile in ``core``'s scratchpad.

        ``keep``: inside a region with an arena, the tile outlives the region (an output that
        later regions read; the arena frees it when its readers are done)."""
        return self._tile(Space.SRAM, core, name, shape, dtype, _SRAM_ALIGN, keep)

    def sram_mx(self, core: int, name: str, shape: tuple[int, int], fmt: str = "fp4",
                axis: int = 1, *, keep: bool = False) -> MXTensor:
        """Allocate an MX tile (codes + scales) in ``core``'s scratchpad (``keep``: see ``sram``)."""
        return self._mx(Space.SRAM, core, name, shape, fmt, axis, _SRAM_ALIGN, keep)

    def acc(self, core: int, name: str, shape: tuple[int, int]) -> Tile:
        """Allocate FP32 accumulators in ``core``'s accumulator memory."""
        return self._tile(Space.ACC, core, name, shape, "f32", _SRAM_ALIGN)

    def _mx(self, space, core, name, shape, fmt, axis, align, keep: bool = False) -> MXTensor:
        mx_dtypes = [d.name for d in DTYPES.values() if d.mx_fmt is not None]
        canonical = canonical_format(fmt, mx_dtypes)  # "e2m1" is "fp4", "e4m3" is "fp8e4"
        if canonical is None:
            raise InvalidArgumentError(
                f"fmt={fmt!r} is not an MX element dtype ({describe_formats(mx_dtypes)})")
        fmt = canonical
        rows, cols = shape
        if axis not in (0, 1) or shape[axis] % 32:
            raise InvalidArgumentError(f"axis={axis}: MX tensors of shape {shape} need that axis "
                                       "to be 0 or 1 and a multiple of 32")
        codes = self._tile(space, core, name, shape, fmt, align, keep)
        sshape = (rows, cols // 32) if axis == 1 else (rows // 32, cols)
        scales = self._tile(space, core, f"{name}.scales", sshape, "e8m0", align, keep)
        return MXTensor(codes, scales, axis)

    def semaphore(self, name: str) -> Semaphore:
        """A new semaphore (counter starting at 0); named ``region/name`` inside a region."""
        sem = Semaphore(len(self._sems), self._scoped(name))
        self._sems.append(sem)
        return sem

    # --- engines --------------------------------------------------------------------------
    def core(self, index: int) -> CoreHandle:
        """Handles for the engines of core ``index``."""
        if not 0 <= index < self.chip.core.count:
            raise InvalidArgumentError(
                f"core {index} does not exist: {self.chip.name} has {self.chip.core.count} cores")
        if index not in self._cores:
            self._cores[index] = CoreHandle(self, index, self.chip.dma.queues_per_core)
        return self._cores[index]

    def _issue(self, engine: Engine, row: InstrSpec, args: tuple, kwargs: dict,
               source: str) -> Instruction:
        layout = _LAYOUTS.get(row.mnemonic)
        if layout is None or layout.row is not row:
            layout = _Layout(row)
        if kwargs or len(args) != len(layout.names):
            args = _bind(engine, row, layout, args, kwargs, source)
        return layout.issue(self, engine, args, source)

    def _check_new(self, ins: Instruction, key: tuple | None) -> None:
        """Check ``ins`` against the table; remember ``key`` as legal if it passes."""
        check_instruction(ins, index=len(self._instructions))
        if key is not None:
            self._legal.add(key)

    # --- loops ----------------------------------------------------------------------------
    def repeat(self, count: int, body: Callable[[int], Any]) -> tuple[Loop, ...]:
        """Issue ``body(i)`` for ``i`` in ``range(count)``, as hardware loops.

        ``body(i)`` issues iteration ``i``'s instructions, on any engines, exactly as the body of
        a Python ``for`` loop would. Iteration 0 is issued as it is (an engine's first
        instruction in a region brings the region's fences); iterations 1..count-1 become one
        ``Loop`` per engine, so the program does not grow with ``count`` and the builder calls
        ``body`` four times, not ``count`` times. For that, every operand that changes from one
        iteration to the next must change by the same step (tile offsets, wait values,
        semaphore ids): the steps are read from iterations 1 and 2 and checked against
        iteration ``count - 1``. ``body`` must depend on nothing but ``i`` (no counters it
        advances) and allocate no memory or semaphores: allocate before the loop.

        Legality is checked on iterations 0, 1, 2 and ``count - 1``. That covers all of them:
        operands are affine in ``i``, a bound (a tile inside its memory, a value in its field)
        holds between its first and last iteration if it holds at both ends, and an alignment
        holds for every iteration once it holds for two consecutive ones.

        Inside ``unrolled_loops()`` every iteration is issued as plain instructions: the same
        program with each engine's instructions in the same order.

        Args:
            count: iterations (0: nothing is issued).
            body: issues iteration ``i``.

        Returns:
            The loops recorded (empty when ``count`` is at most 3 or loops are unrolled: then
            ``body`` ran for every ``i``).

        Raises:
            InvalidArgumentError: ``count`` is negative or not an integer, the body allocates
                memory or semaphores, or its iterations differ in more than affine operands.
        """
        if type(count) is not int or count < 0:
            raise InvalidArgumentError(f"repeat count {count!r} must be a non-negative integer")
        if count <= 3 or not _LOOPS_ON[-1]:
            for i in range(count):
                body(i)
            return ()
        body(0)
        marks = (len(self._allocs), len(self._sems), len(self._regions), self._region)
        probes = []
        for i in (1, 2, count - 1):
            start = len(self._instructions)
            body(i)
            if (len(self._allocs), len(self._sems), len(self._regions), self._region) != marks:
                raise InvalidArgumentError(
                    f"the body of repeat({count}) allocates memory, semaphores or regions in "
                    f"iteration {i}; allocate them before the loop and index them by i")
            probes.append(self._instructions[start:])
            del self._instructions[start:]
        loops = loops_from_iterations(probes[0], probes[1], probes[2], count - 1, first_index=1)
        self._instructions.extend(loops)
        return tuple(loops)

    def build(self) -> Program:
        """The recorded Program."""
        items = tuple(self._instructions)
        regions = tuple((r.name, tuple(r.ranges)) for r in self._regions)
        if Loop in map(type, items):
            # Region ranges were taken as item positions; the program's are instruction indices.
            flat_start, flat = [], 0
            for item in items:
                flat_start.append(flat)
                flat += item.size if type(item) is Loop else 1
            flat_start.append(flat)
            regions = tuple((name, tuple((flat_start[a], flat_start[b]) for a, b in ranges))
                            for name, ranges in regions)
        return Program(
            name=self.name,
            instructions=items,
            allocations=tuple(self._allocs),
            preset=self.preset,
            semaphores=tuple((s.id, s.name) for s in self._sems),
            meta=(("tensors", tuple(self._tensors.items())),
                  ("buffers", tuple(self._buffers.items())),
                  ("regions", regions)),
        )


_MISSING = object()
_U64_MAX = 2**64 - 1  # binary field widths (isa/encoding.py), checked by legality
_U32_MAX = 2**32 - 1
_I32_MAX = 2**31 - 1


def _usage(row: InstrSpec) -> str:
    """How ``row`` is called: ``vec.unary(op, dst, src)``, ``sem.signal(sem, count=1)``."""
    operands = (op.name if not op.optional else f"{op.name}={op.default!r}" for op in row.operands)
    return f"{row.mnemonic}({', '.join(operands)})"


def _bind(engine: Engine, row: InstrSpec, layout: _Layout, args: tuple, kwargs: dict,
          source: str) -> list:
    """Operand values in table order from positional and keyword arguments (_MISSING where absent)."""
    names = layout.names
    if len(args) > len(names):
        raise IllegalInstruction(f"{row.mnemonic} takes at most {len(names)} operands, "
                                 f"got {len(args)}: {_usage(row)}", engine=str(engine), source=source)
    values = list(args) + [_MISSING] * (len(names) - len(args))
    for name, value in kwargs.items():
        if name not in names:
            raise IllegalInstruction(f"{row.mnemonic} has no operand {name!r}; it takes {names}: "
                                     f"{_usage(row)}", engine=str(engine), source=source)
        i = names.index(name)
        if values[i] is not _MISSING:
            raise IllegalInstruction(f"operand {name!r} given twice: {_usage(row)}", engine=str(engine),
                                     source=source)
        values[i] = value
    return values


def _bind_short(engine: Engine, layout: _Layout, op: str, args: tuple, kwargs: dict,
                source: str) -> tuple:
    """The operands after ``op`` of a short form (``vpu.exp(dst, src)`` is
    ``vec.unary("exp", dst, src)``) from positional and keyword arguments, for the calls the
    short form's fast path does not take; a wrong call raises naming both spellings."""
    row, names = layout.row, layout.names[1:]
    values = list(args[:len(names)]) + [_MISSING] * (len(names) - len(args))
    problem = f"got {len(args)} operands" if len(args) > len(names) else None
    for name, value in kwargs.items():
        if problem is not None:
            break
        if name not in names:
            problem = (f"the operation is {op!r} already" if name == row.operands[0].name
                       else f"it has no operand {name!r}")
        elif values[names.index(name)] is not _MISSING:
            problem = f"operand {name!r} given twice"
        else:
            values[names.index(name)] = value
    missing = [n for n, v in zip(names, values, strict=True) if v is _MISSING]
    if problem is None and missing:
        problem = f"operand {', '.join(map(repr, missing))} missing"
    if problem is not None:
        listed = ", ".join(names)
        raise IllegalInstruction(
            f'{engine.unit}.{op}({listed}), short for {row.mnemonic}("{op}", {listed}): {problem}',
            engine=str(engine), source=source)
    return tuple(values)


def _operation_of(rows: Any, name: str) -> InstrSpec | None:
    """The row among ``rows`` whose first operand is an operation ``name`` can be (``sum`` of
    ``vec.reduce``), or None."""
    for row in rows:
        first = row.operands[0] if row.operands else None
        if first is not None and first.kind == "enum" and name in first.choices:
            return row
    return None


def _unknown_instruction(engine: Engine, rows: dict[str, InstrSpec], name: str) -> str:
    """The message for ``engine.<name>`` that is no instruction of the engine: what to write
    instead when ``name`` is an operation of one (``vpu.sum`` is ``reduce("sum", dst, src)``) or
    an instruction of another unit, else the close spellings. Only the error path pays for it."""
    text = f"engine {engine} has no instruction {name!r}"
    row = _operation_of(rows.values(), name)
    if row is not None:
        rest = ", ".join(op.name for op in row.operands[1:])
        short = row.mnemonic.split(".")[-1]
        return f'{text}; {name!r} is an operation of {row.mnemonic}: write {short}("{name}", {rest})'
    units = sorted({r.unit for r in TABLE if r.mnemonic.split(".")[-1] == name
                    and r.unit not in (engine.unit, "any")})
    if units:
        where = " or ".join("core.dma[q]" if u == "dma" else "kb.link" if u == "link" else f"core.{u}"
                            for u in units)
        return f"{text}; {name} is an instruction of the {'/'.join(units)} unit: {where}.{name}(...)"
    names = [*rows, "issue"]
    names += [*_UNARY_OPS] if "unary" in rows else []
    names += [*_BINARY_OPS] if "binary" in rows else []
    names += ["matmul_mx"] if "matmul" in rows else []
    near = difflib.get_close_matches(name, names, n=3)
    if near:
        return f"{text}; did you mean {' or '.join(near)}? It takes {sorted(rows)}"
    return f"{text}; it takes {sorted(rows)}"


def _operand(layout: _Layout, i: int, v: Any, engine: Engine, source: str, base: int) -> tuple[Any, Any]:
    """Operand ``i``'s value as recorded (default filled in, a Semaphore as its id) and its part of
    the legality key (None: check the instruction on its own); tile cores are keyed relative to
    ``base``. The generated issue functions call this for any value that is not of the type the
    operand usually takes."""
    row, name = layout.row, layout.names[i]
    if type(v) is Tile:
        c, o, r, cl, st = v.core, v.offset, v.rows, v.cols, v.stride
        if type(c) is type(o) is type(r) is type(cl) is type(st) is int and o <= _U64_MAX \
                and 0 <= c <= _U32_MAX:
            rel = c - base if name in layout.cores_read else None
            return v, (id(v.space), rel, c == 0, v.dtype, r, cl, st, o if layout.with_offset else None)
        return v, None
    if v is _MISSING:
        v = layout.defaults[i]
        if v is _MISSING:
            raise IllegalInstruction(f"{row.mnemonic} needs operand {name!r}: {_usage(row)}",
                                     engine=str(engine), source=source)
    cls = type(v)
    if cls is Semaphore:
        v = v.id
        cls = type(v)
    elif cls is MXTensor:
        raise IllegalInstruction(f"operand {name!r} got an MXTensor; pass .codes/.scales or use matmul_mx",
                                 engine=str(engine), source=source)
    points = layout.points[i]
    if cls is int and points is not None:
        j = bisect_left(points, v)
        return v, 2 * j + (j < len(points) and points[j] == v)
    if cls is str or cls is int:
        return v, v
    return v, (cls, v)


def _issue_source(layout: _Layout) -> str:
    """Python source of the row's issue function: ``_operand`` unrolled over the operands, with
    the common type of each operand tested first, then the instruction and its legality check."""
    lines = ["def issue(kb, engine, values, source):",
             "    reg = kb._region",
             "    if reg is not None and reg._seen.get(id(engine)) is not engine:",
             "        reg._enter(engine)",
             f"    {', '.join(f'v{i}' for i in range(len(layout.names)))}, = values",
             "    base = engine.core"]
    if layout.relative_cores:
        lines += ["    if type(base) is int and 0 <= base <= I32:",
                  "        ekey = True",
                  "    else:",
                  "        ekey, base = (type(base), base), 0"]
    else:
        lines += ["    ekey, base = (type(base), base), 0"]
    for i, op in enumerate(layout.row.operands):
        v, k = f"v{i}", f"k{i}"
        slow = f"        {v}, {k} = _operand(layout, {i}, {v}, engine, source, base)"
        if op.kind == "tile":
            offset = "o" if layout.with_offset else "None"
            rel = "c - base" if op.name in layout.cores_read else "None"
            lines += [f"    if type({v}) is Tile:",
                      f"        c, o, r, cl, st = {v}.core, {v}.offset, {v}.rows, {v}.cols, {v}.stride",
                      "        if type(c) is type(o) is type(r) is type(cl) is type(st) is int and o <= U64 "
                      "and 0 <= c <= U32:",
                      f"            {k} = (id({v}.space), {rel}, c == 0, {v}.dtype, r, cl, st, {offset})",
                      "        else:",
                      f"            {k} = None"]
        elif op.kind in ("imm", "sem") and layout.points[i] is not None:
            lines += [f"    if type({v}) is Semaphore and type({v}.id) is int:",
                      f"        {v} = {v}.id",
                      f"    if type({v}) is int:",
                      f"        j = bisect_left(P{i}, {v})",
                      f"        {k} = 2 * j + (j < {len(layout.points[i])} and P{i}[j] == {v})"]
        else:
            common = {"enum": "str", "label": "str", "fimm": "float"}.get(op.kind, "int")
            lines += [f"    if type({v}) is {common}:",
                      f"        {k} = {v}" if common != "float" else f"        {k} = (float, {v})"]
        lines += ["    else:", slow]
    n = len(layout.names)
    args = ", ".join(f"({name!r}, v{i})" for i, name in enumerate(layout.names))
    keys = " and ".join(f"k{i} is not None" for i in range(n))
    # The Instruction's fields through its slots' setters (a frozen dataclass's __init__ looks
    # each up through object.__setattr__): the operands were bound above, the engine is the
    # handle's own.
    lines += ["    ins = new(Instruction)",
              "    SET_MNEMONIC(ins, MNEMONIC)",
              "    SET_ENGINE(ins, engine)",
              f"    SET_ARGS(ins, ({args},))",
              "    SET_SOURCE(ins, source)",
              f"    if {keys}:",
              f"        key = (ekey, engine.unit, engine.queue, MNEMONIC, "
              f"{', '.join(f'k{i}' for i in range(n))})",
              "        try:",
              "            hit = key in kb._legal",
              "        except TypeError:  # an unhashable operand: the check says what is wrong with it",
              "            hit, key = False, None",
              "        if not hit:",
              "            kb._check_new(ins, key)",
              "    else:",
              "        kb._check_new(ins, None)",
              "    kb._instructions.append(ins)",
              "    return ins"]
    return "\n".join(lines) + "\n"


class _Layout:
    """What issuing one table row needs, worked out once per row, including its issue function.

    Legality (``check_instruction``) is checked once per distinct *key*, which holds exactly what
    the checks read:

    - the engine's unit and queue, and whether its core is a valid core number;
    - per tile: its space, dtype, rows, cols and stride (the offset too if a rule reads it), its
      core relative to the engine's if a rule reads it, and whether it is 0 (HBM tiles must be on
      core 0). Keying cores relative to the engine's is exact because the rules only compare cores
      with cores (``legality.cores_only_compared_with_cores``, else cores are keyed as they are),
      so one check covers every core. A tile with a field that is not a plain int (a float, a numpy integer)
      or outside its binary field makes the key None: the instruction is checked on its own;
    - per integer operand that the rules only compare with constants (``value >= 1``), its
      position among those constants and its field's bounds (``legality.integer_points``):
      ``sem.wait``'s value differs on almost every call, its verdict on none;
    - per other operand, its value (with its type unless it is an int or str: ``True == 1`` but
      only one of them is a legal count).
    """

    __slots__ = ("cores_read", "defaults", "issue", "names", "pads", "points", "relative_cores", "row",
                 "with_offset")

    def __init__(self, row: InstrSpec) -> None:
        self.row = row
        self.names = tuple(op.name for op in row.operands)
        self.defaults = tuple(op.default if op.optional else _MISSING for op in row.operands)
        self.with_offset = any("offset" in rule for rule in row.rules)
        # Defaults of trailing optional operands: ``signal(sem)`` is ``signal(sem, 1)``.
        self.pads = {k: self.defaults[k:] for k in range(len(self.names))
                     if _MISSING not in self.defaults[k:]}
        points = integer_points(row)
        self.points = tuple(points.get(name) for name in self.names)
        self.relative_cores = cores_only_compared_with_cores(row)
        self.cores_read = operands_read(row, "core")
        scope = {"Tile": Tile, "Semaphore": Semaphore, "Instruction": Instruction, "new": object.__new__,
                 **{f"SET_{name.upper()}": Instruction.__dict__[name].__set__
                    for name in ("mnemonic", "engine", "args", "source")},
                 "U64": _U64_MAX,
                 "U32": _U32_MAX, "I32": _I32_MAX,
                 "bisect_left": bisect_left, "_operand": _operand, "layout": self,
                 "MNEMONIC": row.mnemonic, **{f"P{i}": p for i, p in enumerate(self.points)}}
        exec(compile(_issue_source(self), f"<issue {row.mnemonic}>", "exec"), scope)
        self.issue = scope["issue"]


_LAYOUTS = {row.mnemonic: _Layout(row) for row in TABLE}
