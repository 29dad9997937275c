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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from jalapeno_emu.chip import ChipSpec, load_preset
from jalapeno_emu.errors import CapacityExceeded, IllegalInstruction, InvalidArgumentError, InvalidTypeError
from jalapeno_emu.isa.program import Allocation, Engine, Instruction, Loop, Program, Tile
from jalapeno_emu.mx.formats import canonical_format, describe_formats

from .legality import check_instruction
from .loops import loops_from_iterations
from .operands import (
    BINARY_OPS,
    ISSUE_LAYOUTS,
    UNARY_OPS,
    IssueLayout,
    MXTensor,
    Semaphore,
    bind_operands,
    bind_short_form,
    operation_of,
    unknown_instruction_message,
)
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




_MATMUL_OPERANDS = ("acc", "a", "b", "a_scale", "b_scale", "mode")
_getframe = sys._getframe


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
            op = operation_of(TABLE, text.split(".")[-1])  # "vec.exp": an operation of vec.unary
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
            layout = ISSUE_LAYOUTS[row.mnemonic]
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
                    a = a + tail if tail is not None else bind_operands(engine, row, layout, a, k, source)
                return layout.issue(kb, engine, a, source)
        elif name in UNARY_OPS and "unary" in rows:
            unary = ISSUE_LAYOUTS[rows["unary"].mnemonic]

            # *a rather than (dst, src): a wrong call then fails as a project error that names
            # the instruction, not as a TypeError about this closure; the check costs one len().
            def method(*a: Any, **k: Any) -> Instruction:
                if k or len(a) != 2:
                    a = bind_short_form(engine, unary, name, a, k, _source_of_caller())
                frame = _getframe(1)
                code = frame.f_code
                hit = _SITES.get((id(code), frame.f_lasti))
                source = hit[1] if hit is not None and hit[0] is code else _source_of_caller()
                return unary.issue(kb, engine, (name, *a), source)
        elif name in BINARY_OPS and "binary" in rows:
            binary = ISSUE_LAYOUTS[rows["binary"].mnemonic]

            def method(*a: Any, **k: Any) -> Instruction:
                if k or len(a) != 3:
                    a = bind_short_form(engine, binary, name, a, k, _source_of_caller())
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
            raise AttributeError(unknown_instruction_message(engine, rows, name))
        kb = self._kb
        self.__dict__[name] = method
        return method

    def matmul_mx(self, acc: Tile, a: MXTensor | Tile, b: MXTensor | Tile,
                  mode: str = "accumulate") -> Instruction:
        """``mxu.matmul`` with MXTensor operands (codes and scales passed together)."""
        a_codes, a_scale = (a.codes, a.scales) if isinstance(a, MXTensor) else (a, None)
        b_codes, b_scale = (b.codes, b.scales) if isinstance(b, MXTensor) else (b, None)
        row = self._rows["matmul"]
        layout = ISSUE_LAYOUTS.get(row.mnemonic)
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
        wait = ISSUE_LAYOUTS["sem.wait"]
        covered = self._covered
        log = self.kb._fence_log
        for f in self.fences:
            if f not in covered:  # (a fence added later may imply an earlier one)
                ins = wait.issue(self.kb, engine, f, f"{self.name}:fence")
                if log is not None:
                    log.append(ins)

    def add_fences(self, fences: Any) -> None:
        """Add fence conditions; engines already in the region wait for the new ones now (their
        later instructions are the ones that may touch what the fences guard)."""
        new = self._take(fences)
        if not new:
            return
        if self.engines:
            if self.kb._region is not self:
                raise InvalidArgumentError(f"fences added to region {self.name!r} while it is not entered")
            wait = ISSUE_LAYOUTS["sem.wait"]
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
            signal = ISSUE_LAYOUTS["sem.signal"]
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
        self._fence_log: list[Instruction] | None = None  # fence waits issued, while repeat records
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
        layout = ISSUE_LAYOUTS.get(row.mnemonic)
        if layout is None or layout.row is not row:
            layout = IssueLayout(row)
        if kwargs or len(args) != len(layout.names):
            args = bind_operands(engine, row, layout, args, kwargs, source)
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
        a Python ``for`` loop would. They become one ``Loop`` per engine, so the program does not
        grow with ``count`` and the builder calls ``body`` three times (iterations 0, 1 and
        ``count - 1``), not ``count`` times. An engine's first instruction in a region brings the
        region's fences: those waits stay plain instructions before the loops. Where iteration 0
        differs from the others in more than that, it is issued as it is and iterations
        1..count-1 become the loops (``body`` then runs a fourth time, for iteration 2). For
        that, every operand that changes from one iteration to the next must change by the same
        step (tile offsets, wait values, semaphore ids): the steps are read from two consecutive
        iterations and checked against iteration ``count - 1``. ``body`` must depend on nothing
        but ``i`` (no counters it advances) and allocate no memory or semaphores: allocate before
        the loop.

        Legality is checked on every iteration issued (0, 1, ``count - 1``, and 2 when iteration
        0 stands apart). That covers all of them: operands are affine in ``i``, a bound (a tile
        inside its memory, a value in its field) holds between its first and last iteration if
        it holds at both ends, and an alignment holds for every iteration once it holds for two
        consecutive ones.

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
        start = len(self._instructions)
        outer, self._fence_log = self._fence_log, []
        fences = self._fence_log
        try:
            body(0)
        finally:
            self._fence_log = outer
        marks = (len(self._allocs), len(self._sems), len(self._regions), self._region)

        def probe(i: int) -> list[Instruction]:
            at = len(self._instructions)
            body(i)
            if (len(self._allocs), len(self._sems), len(self._regions), self._region) != marks:
                raise InvalidArgumentError(
                    f"the body of repeat({count}) allocates memory, semaphores or regions in "
                    f"iteration {i}; allocate them before the loop and index them by i")
            issued = self._instructions[at:]
            del self._instructions[at:]
            return issued

        first = self._instructions[start:]
        if fences:
            waits = {id(ins) for ins in fences}
            first = [ins for ins in first if id(ins) not in waits]
        second, last = probe(1), probe(count - 1)
        try:
            loops = loops_from_iterations(first, second, last, count)
        except (InvalidArgumentError, IllegalInstruction):  # (a step that overshoots: a Loop's error)
            # Iteration 0 differs in more than its fences: it stays as issued, the loops start at 1.
            loops = loops_from_iterations(second, probe(2), last, count - 1, first_index=1)
        else:
            del self._instructions[start:]
            self._instructions.extend(fences)
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
