"""What a functional run leaves: memory by allocation, probe values, and how to read them back.

Stage: emulator (``functional.py`` runs a Program and returns a :class:`FunctionalResult`). The
result finds an allocation by name (with the core and space when a name is on several), decodes
its bytes as the builder recorded them or as asked, and lists what can be read.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.program import Allocation, Program
from jalapeno_emu.isa.table import DTYPES, Space

if TYPE_CHECKING:
    from jalapeno_emu.emu.memory_layout import MemoryLayout

__all__ = ["FunctionalResult", "Readable", "host_dtype", "read_values"]


@dataclass(frozen=True)
class Readable:
    """One allocation ``FunctionalResult.read`` can read back.

    Attributes:
        name: the allocation's name (``region/name`` inside a builder region).
        space: HBM, SRAM or ACC.
        core: the owning core for SRAM/ACC, None for HBM (chip-global).
        nbytes: its size in bytes.
        dtype, shape: what the builder recorded for it (None for an assembled program, which
            records only names and sizes: pass ``dtype=`` and ``shape=`` to ``read``).
    """

    name: str
    space: Space
    core: int | None
    nbytes: int
    dtype: str | None = None
    shape: tuple[int, int] | None = None

    def __str__(self) -> str:
        where = "hbm" if self.space is Space.HBM else f"{self.space.value}[{self.core}]"
        what = f" {self.dtype}[{self.shape[0]},{self.shape[1]}]" if self.dtype and self.shape else ""
        return f"{where} {self.name}{what} ({self.nbytes:,} B)"


@dataclass
class FunctionalResult:
    """Memory after a functional run, and the values its probes recorded.

    Attributes:
        program: the program that ran.
        layout: the buffers' layout.
        buffers: buffer name -> uint8 numpy array (HBM per allocation, SRAM/ACC per core).
        probes: probe label -> the values recorded by every ``probe`` instruction with that
            label, one numpy array [rows, cols] per probe in issue order (for one engine, its
            program order), decoded like :meth:`read` (fp4 as unpacked uint8 codes, fp8 codes and
            E8M0 scales as uint8, floats and ints in their numpy dtype).
        probe_sites: probe label -> (instruction index, engine, source) of each of those probes,
            in the same order.
    """

    program: Program
    layout: MemoryLayout
    buffers: dict[str, np.ndarray]
    probes: dict[str, list[np.ndarray]] = field(default_factory=dict)
    probe_sites: dict[str, list[tuple[int, str, str]]] = field(default_factory=dict)

    def names(self, *, space: Space | str | None = None, core: int | None = None) -> list[Readable]:
        """Every allocation that :meth:`read` can read, HBM first, then by core, space and name.

        Args:
            space: only this space ("hbm", "sram", "acc" or a ``Space``).
            core: only this core's scratchpad and accumulators (HBM is chip-global and listed
                whatever ``core`` is).

        ``str()`` of an entry reads e.g. ``sram[0] rowmax f32[8,1] (32 B)``.
        """
        space, core = _space_arg(space), _core_arg(core)
        out = [r for r in _readables(self.program)
               if (space is None or r.space is space) and (core is None or r.core in (None, core))]
        return sorted(out, key=lambda r: (r.core is not None, r.core or 0, r.space.value, r.name))

    def read_bytes(self, name: str, *, core: int | None = None,
                   space: Space | str | None = None) -> np.ndarray:
        """Raw bytes (uint8[nbytes]) of the allocation called ``name``, as the run left them.

        Args:
            name: an HBM, scratchpad or accumulator allocation (``names()`` lists them).
            core: the core whose scratchpad/accumulators hold it, when the name is on several
                (HBM is chip-global and ignores ``core``).
            space: "hbm", "sram" or "acc" (or a ``Space``), when the name is in several. Without
                it, the name of an HBM tensor means the tensor (as ``read`` always has; a kernel
                often names a tensor's scratchpad tile after it) unless ``core`` is given, which
                asks for that core's buffer.

        Raises:
            InvalidArgumentError: no such allocation (the message lists those that exist), or
                the name is on several cores or in several spaces and ``core``/``space`` do not
                say which (the message lists them).
        """
        alloc = _find_alloc(self.program, name, core, space)
        if alloc.space is Space.HBM:
            return self.buffers[f"hbm:{alloc.name}"]
        return self.buffers[f"{alloc.space.value}:{alloc.core}"][alloc.offset:alloc.end]

    def read(self, name: str, dtype: str | None = None, shape: tuple[int, ...] | None = None, *,
             core: int | None = None, space: Space | str | None = None) -> np.ndarray:
        """Contents of the allocation ``name`` (HBM, scratchpad or accumulators) as values.

        Args:
            name: allocation name (``names()`` lists them).
            dtype, shape: element type and shape; default to what the builder recorded for the
                allocation (an assembled program records none: give both).
            core, space: which one, when the name is on several cores or in several spaces
                (see :meth:`read_bytes`).

        Returns:
            numpy array of ``shape``: floats and ints in their numpy dtype (bf16 as
            ``ml_dtypes.bfloat16``), MX element codes and E8M0 scales as uint8 (fp4 unpacked to
            one code per element). Scratchpad and accumulators hold what the run left there: in
            a fused program, memory an arena gave to a later region holds that region's data
            (a ``probe`` records a value at a point of the program instead).

        Raises:
            InvalidArgumentError: see :meth:`read_bytes`; also no recorded dtype/shape and none
                given, an unknown dtype, or a shape larger than the allocation.
        """
        alloc = _find_alloc(self.program, name, core, space)
        recorded = _recorded(self.program, alloc)
        if dtype is None or shape is None:
            if recorded is None:
                raise InvalidArgumentError(f"give dtype= and shape= to read {name!r}; the program "
                                           "did not record them")
            dtype, shape = dtype or recorded[0], shape or recorded[1]
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
        shape = tuple(shape)
        n = int(np.prod(shape))
        need = -(-n * DTYPES[dtype].bits // 8)
        raw = self.read_bytes(name, core=alloc.core, space=alloc.space)
        if need > raw.size:
            raise InvalidArgumentError(f"reading {name!r} as {dtype} {shape} needs {need:,} B; the "
                                       f"allocation holds {raw.size:,} B")
        return read_values(raw, dtype, shape)


def read_values(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The first prod(shape) elements of ``dtype`` in the bytes ``raw``, as an array of ``shape``."""
    n = int(np.prod(shape))
    raw = np.ascontiguousarray(raw).reshape(-1)
    if dtype == "fp4":
        codes = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(-1)
        return codes[:n].reshape(shape)
    np_dt = host_dtype(dtype)
    return raw[: n * np_dt.itemsize].view(np_dt).reshape(shape)


def _space_arg(space: Space | str | None) -> Space | None:
    """``space=`` as a Space (None stays None)."""
    if space is None or isinstance(space, Space):
        return space
    names = {s.value: s for s in Space}
    if isinstance(space, str) and space.lower() in names:
        return names[space.lower()]
    raise InvalidArgumentError(f"space={space!r} is not one of {', '.join(names)} (or an isa.table.Space)")


def _core_arg(core: Any) -> int | None:
    """``core=`` checked: None or a non-negative int."""
    if core is None or (isinstance(core, (int, np.integer)) and not isinstance(core, bool) and core >= 0):
        return None if core is None else int(core)
    raise InvalidArgumentError(f"core={core!r} is not a core number (a non-negative integer)")


def _cores_text(cores: list[int]) -> str:
    """"0..7", "0, 2, 5" or "3"."""
    cores = sorted(set(cores))
    if len(cores) > 2 and cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}..{cores[-1]}"
    return ", ".join(map(str, cores))


def _where_text(allocs: list[Allocation]) -> str:
    """Where allocations of one name are: "hbm", "sram on cores 0..7", "hbm and acc on core 1"."""
    parts = []
    for sp in Space:
        cores = [a.core for a in allocs if a.space is sp]
        if cores:
            parts.append("hbm" if sp is Space.HBM else
                         f"{sp.value} on core{'s' if len(set(cores)) > 1 else ''} {_cores_text(cores)}")
    return " and ".join(parts)


def _find_alloc(program: Program, name: str, core: Any, space: Any) -> Allocation:
    """The one allocation called ``name`` in ``space`` / on ``core``; raises InvalidArgumentError
    naming the candidates when there is none or more than one.

    Without ``space``, a name that is an HBM tensor means the tensor when ``core`` is not given
    either (what ``read(name)`` has always meant; kernels often name a tensor's scratchpad tile
    after it), and the core's own buffer when ``core`` is given.
    """
    space, core = _space_arg(space), _core_arg(core)
    if not isinstance(name, str):
        raise InvalidArgumentError(f"an allocation name is a str, not {type(name).__name__}")
    named = [a for a in program.allocations if a.name == name]
    found = [a for a in named if (space is None or a.space is space)
             and (core is None or a.space is Space.HBM or a.core == core)]
    if space is None and len(found) > 1:
        hbm = [a for a in found if a.space is Space.HBM]
        found = hbm if core is None and hbm else [a for a in found if a.space is not Space.HBM]
    if len(found) == 1:
        return found[0]
    if found:
        spaces = [sp for sp in Space if any(a.space is sp for a in found)]
        if len(spaces) > 1:
            several_cores = any(sum(a.space is sp for a in found) > 1 for sp in spaces)
            raise InvalidArgumentError(f"{name!r} exists in {_where_text(found)}; pass space= ("
                                       f"{', '.join(sp.value for sp in spaces)})"
                                       + (" and core=" if several_cores else ""))
        sp = found[0].space
        raise InvalidArgumentError(f"{sp.value} {name!r} exists on cores "
                                   f"{_cores_text([a.core for a in found])}; pass core=")
    wanted = f"{space.value + ' ' if space else ''}allocation named {name!r}"
    if core is not None:
        wanted += f" on core {core}"
    if named:
        raise InvalidArgumentError(f"no {wanted}; {name!r} is in {_where_text(named)}")
    listing = [str(r) for r in _readables(program)]
    shown = listing[:12]
    more = f" and {len(listing) - len(shown)} more (FunctionalResult.names() lists them all)" \
        if len(listing) > len(shown) else ""
    close = difflib.get_close_matches(name, sorted({a.name for a in program.allocations}), n=3)
    raise InvalidArgumentError(
        f"no {wanted}; the program has " + ("; ".join(shown) if shown else "no allocations") + more,
        hint=f"did you mean {' or '.join(map(repr, close))}?" if close else None)


def _recorded(program: Program, alloc: Allocation) -> tuple[str, tuple[int, int]] | None:
    """(dtype, shape) the builder recorded for ``alloc``, or None."""
    meta = dict(program.meta)
    if alloc.space is Space.HBM:
        return dict(meta.get("tensors", ())).get(alloc.name)
    return dict(meta.get("buffers", ())).get((alloc.space.value, alloc.core, alloc.name))


def _readables(program: Program) -> list[Readable]:
    """A ``Readable`` per allocation of ``program``, in allocation order."""
    meta = dict(program.meta)
    tensors, buffers = dict(meta.get("tensors", ())), dict(meta.get("buffers", ()))
    out = []
    for a in program.allocations:
        rec = tensors.get(a.name) if a.space is Space.HBM else buffers.get((a.space.value, a.core, a.name))
        out.append(Readable(a.name, a.space, None if a.space is Space.HBM else a.core, a.nbytes,
                            *(rec if rec is not None else (None, None))))
    return out


def host_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a host array of ``dtype`` elements has (MX element codes and E8M0: uint8)."""
    dt = DTYPES[dtype]
    return np.dtype(ml_dtypes.bfloat16) if dt.numpy == "bfloat16" else np.dtype(dt.numpy or "uint8")
