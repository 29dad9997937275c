"""The emitter protocol: a kernel emits into a region of a builder, given where its tensors are.

Stage: kernels, between the ISA builder and every kernel family. A kernel is an *emitter*: a
generator function that takes an :class:`EmitCtx` (the builder, the chip, its :class:`Budget`),
its tensors as :class:`TensorRef` s and where its outputs should go (:class:`Out`). A stand-alone
launch (``KernelDef.build``) is the emitter with every tensor allocated in HBM; a fused layer or
step (``kernels/compose.py``) is a sequence of emitters sharing one builder, whose tensors are
other operators' outputs.

**Where a tensor is** (:class:`TensorRef`). Either in HBM (``base``: the whole tensor's tile,
MX codes with ``base_scales``), with pieces that only say *when* each region is ready, or on
chip, as pieces that each hold a region in some core's scratchpad (several pieces may hold the
same region on different cores: replicas). A piece's ``ready`` is a (semaphore id, value)
condition: an engine must wait for it before touching the region; ``None`` means ready when the
program starts (weights, the KV cache of earlier steps, a stand-alone kernel's inputs).

**How an emitter reads an input**: :func:`fetch` copies a region into the emitter's own SRAM
buffer (waiting for the pieces it overlaps, then one ``dma.load`` for HBM or a ``dma.copy`` per
on-chip piece), or :meth:`TensorRef.local` hands back a piece already on the emitter's core,
used in place (what makes a replicated activation free to consume).

**How an emitter writes an output**: ``Out.to(ref)`` stores into a given HBM tensor;
``Out.onchip()`` keeps each output tile in the scratchpad where it was made (allocated with
``keep=True``, so it outlives the emitter's region); ``Out.replicated(cores)`` asks for the whole
output on every listed core (the normalisations compute every row on every core that needs it,
so the matrix units read it in place). The emitter says which it honours; it returns the
:class:`TensorRef` of each output with a ``ready`` per piece.

**Two parts.** An emitter ``yield`` s once: everything before the ``yield`` is its *prefetch*
part, and the ``yield`` hands over its outputs' refs (placement and readiness are known before
the work is emitted). A fused program emits the prefetch parts of the next operators before the
rest of the current one, so their weights stream into free scratchpad while the current
operator computes. :func:`run_emitter` runs both parts back to back. The prefetch part may hold
only DMA loads of tensors ready at the start (weights, constants, the cached context), signals,
and DMA-queue waits on its own transfers: no matrix or vector instruction and no wait on an
input (those engines' earlier instructions are the current operator's; a wait there would
stall it, or deadlock).

**The kernel contract** (``KernelDef.emit`` / ``KernelDef.tensors_of``): ``emit(ctx, shape,
tensors, outs)`` with ``tensors`` a ref for every ``TensorSpec`` of the kernel (activations in
token-major shape, [tokens, features], which a stand-alone program may allocate under another
shape of the same bytes) and ``outs`` a placement per output. Constants are the emitter's own
(``EmitCtx.const``). Plans come from ``ctx.budget`` only, so the same shape plans the same way
fused or not.
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import EngineHandle, KernelBuilder, MXTensor
from jalapeno_emu.isa.program import Tile
from jalapeno_emu.isa.table import Space

from .planning import Budget

__all__ = ["EmitCtx", "Emitter", "Out", "Piece", "Ready", "TensorRef", "emit_copy", "emit_store", "fetch",
           "run_emitter"]

Ready = tuple[int, int]
"""(semaphore id, value): the condition an engine waits for before touching a region."""

Emitter = Generator[dict[str, "TensorRef"], None, dict[str, "TensorRef"]]
"""What an emitter function returns: yields its output refs once, returns them at the end."""


@dataclass(frozen=True)
class Piece:
    """One region of a tensor: rows [r0, r0+rows) x cols [c0, c0+cols).

    Attributes:
        r0, c0, rows, cols: the region, in the tensor's elements.
        tile: where it lives on chip (a [rows, cols] SRAM tile), or None for a readiness region
            of an HBM tensor (the bytes are in the ref's ``base``).
        scales: an on-chip MX piece's E8M0 scale tile (blocked as the tensor is).
        ready: the condition before which no engine may touch it (None: ready at start).
    """

    r0: int
    c0: int
    rows: int
    cols: int
    tile: Tile | None = None
    scales: Tile | None = None
    ready: Ready | None = None

    def overlaps(self, r0: int, c0: int, rows: int, cols: int) -> bool:
        """True when the piece shares an element with the region."""
        return (self.r0 < r0 + rows and r0 < self.r0 + self.rows
                and self.c0 < c0 + cols and c0 < self.c0 + self.cols)

    def covers(self, r0: int, c0: int, rows: int, cols: int) -> bool:
        """True when the region lies inside the piece."""
        return (self.r0 <= r0 and r0 + rows <= self.r0 + self.rows
                and self.c0 <= c0 and c0 + cols <= self.c0 + self.cols)

    @property
    def core(self) -> int | None:
        """The core whose scratchpad holds it (None for an HBM readiness region)."""
        return None if self.tile is None else self.tile.core


@dataclass(frozen=True)
class TensorRef:
    """Where a logical [rows, cols] tensor is, and when each part of it is ready.

    Attributes:
        name: for messages and traces.
        shape: (rows, cols) in elements.
        dtype: element dtype (an ISA dtype name; MX tensors: their code dtype).
        base: the HBM tile of the whole tensor (MX: its codes), or None for an on-chip tensor.
        base_scales: an MX HBM tensor's scales tile.
        mx_axis: the blocked axis of an MX tensor (None: not MX).
        pieces: HBM: readiness regions (regions without one are ready at start), and regions
            whose new bytes are also in a scratchpad tile (a piece with ``tile``: kv-append's
            kept rows); on chip: the regions each core holds (together they cover the tensor;
            replicas may repeat).
    """

    name: str
    shape: tuple[int, int]
    dtype: str
    base: Tile | None = None
    base_scales: Tile | None = None
    mx_axis: int | None = None
    pieces: tuple[Piece, ...] = ()

    # --- construction -----------------------------------------------------------------------
    @staticmethod
    def hbm(name: str, tensor: Tile | MXTensor, ready: Ready | None = None) -> TensorRef:
        """An HBM tensor (a builder tile or MX tensor), ready at start or at ``ready``."""
        if isinstance(tensor, MXTensor):
            codes = tensor.codes
            ref = TensorRef(name, codes.shape, codes.dtype, codes, tensor.scales, tensor.axis)
        else:
            if tensor.space is not Space.HBM:
                raise InvalidArgumentError(f"TensorRef.hbm({name!r}): {tensor} is not an HBM tile")
            ref = TensorRef(name, tensor.shape, tensor.dtype, tensor)
        if ready is not None:
            ref = ref.with_ready(0, 0, *ref.shape, ready)
        return ref

    @staticmethod
    def onchip(name: str, shape: tuple[int, int], dtype: str, pieces: Iterable[Piece],
               mx_axis: int | None = None) -> TensorRef:
        """An on-chip tensor made of ``pieces`` (each with its SRAM tile)."""
        pieces = tuple(pieces)
        regions = {(p.r0, p.c0, p.rows, p.cols) for p in pieces}
        ordered = sorted(regions)
        for i, a in enumerate(ordered):  # replicas repeat a region whole; others are disjoint
            for b in ordered[i + 1:]:
                if b[0] >= a[0] + a[2]:
                    break
                if Piece(*a).overlaps(*b):
                    raise InvalidArgumentError(f"on-chip tensor {name!r}: pieces {a} and {b} overlap "
                                               "without being replicas of one region")
        for p in pieces:
            if p.tile is None or p.tile.space is Space.HBM:
                raise InvalidArgumentError(f"on-chip tensor {name!r}: piece {p} has no scratchpad tile")
            if p.tile.shape != (p.rows, p.cols):
                raise InvalidArgumentError(f"on-chip tensor {name!r}: piece tile {p.tile.shape} is not "
                                           f"its region [{p.rows}, {p.cols}]")
        return TensorRef(name, shape, dtype, None, None, mx_axis, pieces)

    @staticmethod
    def hconcat(name: str, parts: Sequence[TensorRef]) -> TensorRef:
        """On-chip tensors side by side along columns (same rows and dtype): their pieces,
        re-based (MLA's [c_kv | k_pe] row from two producers)."""
        if not parts or any(p.in_hbm for p in parts):
            raise InvalidArgumentError(f"hconcat({name}): only on-chip tensors can be joined")
        rows, dtype = parts[0].shape[0], parts[0].dtype
        if any(p.shape[0] != rows or p.dtype != dtype or p.is_mx for p in parts):
            raise InvalidArgumentError(f"hconcat({name}): parts must share rows and a non-MX dtype")
        pieces, c0 = [], 0
        for p in parts:
            pieces += [replace(pc, c0=pc.c0 + c0) for pc in p.pieces]
            c0 += p.shape[1]
        return TensorRef.onchip(name, (rows, c0), dtype, pieces)

    def with_ready_of(self, other: TensorRef, r0: int = 0, c0: int = 0) -> TensorRef:
        """This HBM tensor with the readiness regions of ``other`` (a writer's view of its region
        at [r0, c0]) added, shifted to this tensor's coordinates."""
        ref = self
        for p in other.pieces:
            if p.ready is not None:
                ref = ref.with_ready(p.r0 + r0, p.c0 + c0, p.rows, p.cols, p.ready)
        return ref

    def with_ready(self, r0: int, c0: int, rows: int, cols: int, ready: Ready) -> TensorRef:
        """This HBM tensor with region [r0:r0+rows, c0:c0+cols] ready only at ``ready`` (a writer
        updated it: a KV-cache append, an output stored tile by tile)."""
        if self.base is None:
            raise InvalidArgumentError(f"{self.name}: readiness regions are for HBM tensors")
        return replace(self, pieces=(*self.pieces, Piece(r0, c0, rows, cols, None, None, ready)))

    def region(self, r0: int, c0: int, rows: int, cols: int, name: str | None = None) -> TensorRef:
        """The [rows, cols] sub-tensor at [r0, c0] as a tensor of its own (pieces clipped and
        re-based; an MX tensor's region must be block aligned along its blocked axis)."""
        self._check_region(r0, c0, rows, cols)
        name = name or f"{self.name}[{r0}:{r0 + rows},{c0}:{c0 + cols}]"
        pieces = []
        for p in self.pieces:
            if not p.overlaps(r0, c0, rows, cols):
                continue
            a0, b0 = max(r0, p.r0), max(c0, p.c0)
            a1, b1 = min(r0 + rows, p.r0 + p.rows), min(c0 + cols, p.c0 + p.cols)
            tile = scales = None
            if p.tile is not None:
                if self.is_mx:
                    mx = MXTensor(p.tile, p.scales, self.mx_axis).sub(a0 - p.r0, b0 - p.c0, a1 - a0, b1 - b0)
                    tile, scales = mx.codes, mx.scales
                else:
                    tile = p.tile.sub(a0 - p.r0, b0 - p.c0, a1 - a0, b1 - b0)
            pieces.append(Piece(a0 - r0, b0 - c0, a1 - a0, b1 - b0, tile, scales, p.ready))
        if self.base is None:
            return TensorRef(name, (rows, cols), self.dtype, None, None, self.mx_axis, tuple(pieces))
        view = self.hbm_view(r0, c0, rows, cols)
        if self.is_mx:
            return TensorRef(name, (rows, cols), self.dtype, view.codes, view.scales, self.mx_axis,
                             tuple(pieces))
        return TensorRef(name, (rows, cols), self.dtype, view, None, None, tuple(pieces))

    # --- reading ----------------------------------------------------------------------------
    @property
    def in_hbm(self) -> bool:
        """True for an HBM tensor."""
        return self.base is not None

    @property
    def is_mx(self) -> bool:
        """True for an MX tensor (codes with E8M0 scales)."""
        return self.mx_axis is not None

    def _check_region(self, r0: int, c0: int, rows: int, cols: int) -> None:
        if r0 < 0 or c0 < 0 or rows < 1 or cols < 1 or r0 + rows > self.shape[0] or c0 + cols > self.shape[1]:
            raise InvalidArgumentError(f"region [{r0}:{r0 + rows}, {c0}:{c0 + cols}] is outside "
                                       f"{self.name} {list(self.shape)}")

    def waits(self, r0: int = 0, c0: int = 0, rows: int | None = None,
              cols: int | None = None) -> list[Ready]:
        """The distinct ready conditions of the readiness regions a region of an HBM tensor
        overlaps (in piece order)."""
        rows = self.shape[0] - r0 if rows is None else rows
        cols = self.shape[1] - c0 if cols is None else cols
        out: list[Ready] = []
        pieces = self.pieces
        for k in self._overlapping(r0, c0, rows, cols):
            ready = pieces[k].ready
            if ready is not None and ready not in out:
                out.append(ready)
        return out

    @functools.cached_property
    def _bounds(self) -> np.ndarray:
        """[pieces, 4] int64: r0, r1, c0, c1 of each piece (a tensor is queried many times, and
        a fused layer's tensors have thousands of pieces)."""
        b = np.array([(p.r0, p.r0 + p.rows, p.c0, p.c0 + p.cols) for p in self.pieces], dtype=np.int64)
        return b.reshape(-1, 4)

    def _overlapping(self, r0: int, c0: int, rows: int, cols: int) -> list[int]:
        """Indices of the pieces sharing an element with the region, in piece order."""
        if len(self.pieces) < 16:
            return [k for k, p in enumerate(self.pieces) if p.overlaps(r0, c0, rows, cols)]
        b = self._bounds
        hit = (b[:, 0] < r0 + rows) & (r0 < b[:, 1]) & (b[:, 2] < c0 + cols) & (c0 < b[:, 3])
        return np.flatnonzero(hit).tolist()

    def hbm_view(self, r0: int, c0: int, rows: int, cols: int) -> Tile | MXTensor:
        """The HBM tile (MX: MXTensor with its scales) of a region of an HBM tensor."""
        if self.base is None:
            raise InvalidArgumentError(f"{self.name} is on chip, not in HBM")
        self._check_region(r0, c0, rows, cols)
        if self.is_mx:
            return MXTensor(self.base, self.base_scales, self.mx_axis).sub(r0, c0, rows, cols)
        return self.base.sub(r0, c0, rows, cols)

    def local(self, core: int, r0: int = 0, c0: int = 0, rows: int | None = None,
              cols: int | None = None) -> tuple[Tile | MXTensor, Ready | None] | None:
        """(the region's tile in ``core``'s scratchpad, its ready condition) when one on-chip piece
        on that core covers it, else None (then :func:`fetch` it)."""
        rows = self.shape[0] - r0 if rows is None else rows
        cols = self.shape[1] - c0 if cols is None else cols
        for p in self.pieces:
            if p.tile is not None and p.tile.core == core and p.covers(r0, c0, rows, cols):
                tile = p.tile.sub(r0 - p.r0, c0 - p.c0, rows, cols)
                if self.is_mx:
                    mx = MXTensor(p.tile, p.scales, self.mx_axis).sub(r0 - p.r0, c0 - p.c0, rows, cols)
                    return mx, p.ready
                return tile, p.ready
        return None

    def sources(self, r0: int, c0: int, rows: int, cols: int, near: int | None = None
                ) -> list[tuple[Piece, int, int, int, int]]:
        """On-chip pieces that together hold a region, as (piece, r0, c0, rows, cols) of the
        part each contributes: pieces on core ``near`` first, then in order; the region must be
        covered (replicas are used once)."""
        self._check_region(r0, c0, rows, cols)
        candidates = [self.pieces[k] for k in self._overlapping(r0, c0, rows, cols)]
        order = sorted(candidates, key=lambda p: p.core != near) if near is not None else candidates
        # Each piece in turn is taken when its part of the region shares no element with the
        # parts taken before it (a replica of a region already taken is skipped; pieces are
        # disjoint otherwise), until the parts taken cover the region. ``_cover`` does it
        # without a numpy call per piece (a grid of the region cost several per cent of a fused
        # step's build) and is defined at the end of this module, below every emitter.
        #
        # Why there: kernels record the source line of every instruction they issue
        # ("emit.py:364"), and a Program is compared whole, sources included. A helper
        # added above the emitters would move their lines, and so change every Program
        # built with them, for no change in what they do. Helpers of this module go
        # below the emitters for that reason.
        out = _cover(order, r0, c0, rows, cols)
        if out is not None:
            return out
        raise InvalidArgumentError(f"the pieces of {self.name} do not cover region "
                                   f"[{r0}:{r0 + rows}, {c0}:{c0 + cols}]")


def fetch(qs: EngineHandle | Sequence[EngineHandle], dst: Tile | MXTensor, src: TensorRef, r0: int = 0,
          c0: int = 0, *, waited: dict[Any, set[Ready]] | None = None, scales_first: bool = True,
          after: Sequence[Ready] = ()) -> list[EngineHandle]:
    """Copy region [r0:r0+R, c0:c0+C] of ``src`` (R, C: ``dst``'s shape) into ``dst``.

    HBM: the first queue of ``qs`` waits for every ready condition the region overlaps, then one
    ``dma.load`` (MX: scales, then codes, when ``scales_first``). On chip: the contributing pieces
    are dealt to the queues in turn (a queue keeps only ``dma.max_outstanding_per_queue``
    transfers in flight, each paying its set-up), each queue waiting for a piece's ready
    condition before its ``dma.copy``. Conditions in ``waited[engine]`` are not waited for again
    (the dict is updated). ``after``: conditions every queue used waits for before its first
    transfer (e.g. "the previous user of ``dst`` is done": a destination reused by copies spread
    over several queues must be free on each of them). The caller then signals on every queue
    returned: a DMA queue's ``sem.signal`` lands once its transfers have.

    Returns:
        The queues that issued transfers (in first-use order).
    """
    queues = [qs] if isinstance(qs, EngineHandle) else list(qs)
    if not queues:
        raise InvalidArgumentError("fetch needs at least one DMA queue")
    mx = isinstance(dst, MXTensor)
    rows, cols = (dst.codes if mx else dst).shape
    seen = waited if waited is not None else {}

    def wait(q: EngineHandle, r: Ready | None) -> None:
        done = seen.setdefault(q.engine, set())
        if r is not None and r not in done:
            q.wait(*r)
            done.add(r)

    if src.in_hbm:
        q = queues[0]
        for r in (*after, *src.waits(r0, c0, rows, cols)):
            wait(q, r)
        view = src.hbm_view(r0, c0, rows, cols)
        if mx:
            pairs = [(dst.scales, view.scales), (dst.codes, view.codes)]
            for d, s in pairs if scales_first else pairs[::-1]:
                q.load(d, s)
        else:
            q.load(dst, view)
        return [q]
    used: list[EngineHandle] = []
    sources = src.sources(r0, c0, rows, cols, near=queues[0].engine.core)
    for n, (piece, a0, b0, nr, nc) in enumerate(sources):
        q = queues[n % len(queues)]
        if q not in used:
            for r in after:
                q.wait(*r)  # each time: the destination is reused, whatever was waited for before
        wait(q, piece.ready)
        if mx:
            s_mx = MXTensor(piece.tile, piece.scales, src.mx_axis).sub(a0 - piece.r0, b0 - piece.c0, nr, nc)
            d_mx = dst.sub(a0 - r0, b0 - c0, nr, nc)
            q.copy(d_mx.scales, s_mx.scales)
            q.copy(d_mx.codes, s_mx.codes)
        else:
            q.copy(dst.sub(a0 - r0, b0 - c0, nr, nc), piece.tile.sub(a0 - piece.r0, b0 - piece.c0, nr, nc))
        if q not in used:
            used.append(q)
    return used


@dataclass(frozen=True)
class Out:
    """Where an emitter should put an output.

    Attributes:
        ref: store into this HBM tensor (its region [0:rows, 0:cols]); None: on chip.
        cores: on chip: replicate the whole output on these cores (None: keep each tile where it
            was made).
    """

    ref: TensorRef | None = None
    cores: tuple[int, ...] | None = None

    @staticmethod
    def to(ref: TensorRef) -> Out:
        """Store into the HBM tensor ``ref``."""
        if not ref.in_hbm:
            raise InvalidArgumentError(f"Out.to({ref.name}): the destination must be an HBM tensor")
        return Out(ref=ref)

    @staticmethod
    def onchip() -> Out:
        """Keep each output tile in the scratchpad of the core that made it."""
        return Out()

    @staticmethod
    def replicated(cores: Iterable[int]) -> Out:
        """The whole output on each of ``cores`` (emitters that support it compute it there)."""
        return Out(cores=tuple(sorted(set(cores))))

    @property
    def in_hbm(self) -> bool:
        """True when the output goes to HBM."""
        return self.ref is not None


@dataclass
class EmitCtx:
    """What an emitter is given besides its tensors.

    Attributes:
        kb: the builder (inside the emitter's region when it runs in a fused program).
        spec: the chip.
        budget: scratchpad/accumulator bytes per core and cores it may use.
        consts: HBM constant tensors the emitter allocated (name as recorded -> host value),
            filled in by whoever runs the program functionally.
    """

    kb: KernelBuilder
    spec: ChipSpec
    budget: Budget
    consts: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def standalone(kb: KernelBuilder) -> EmitCtx:
        """The context of a stand-alone launch: the whole chip's budget."""
        return EmitCtx(kb, kb.chip, Budget.of(kb.chip))

    def const(self, name: str, value: np.ndarray, dtype: str) -> Tile:
        """Allocate an HBM constant tensor (2-D ``value`` of ``dtype``) and remember its value."""
        value = np.asarray(value)
        if value.ndim != 2:
            raise InvalidArgumentError(f"constant {name!r} must be 2-D, got shape {value.shape}")
        tile = self.kb.hbm(name, value.shape, dtype)
        self.consts[self.kb._scoped(name)] = value
        return tile


def run_emitter(gen: Emitter) -> dict[str, TensorRef]:
    """Run an emitter's two parts back to back (a stand-alone launch); its output refs."""
    try:
        first = next(gen)
    except StopIteration as stop:  # an emitter with nothing to prefetch may return at once
        return stop.value or {}
    try:
        next(gen)
    except StopIteration as stop:
        return stop.value if stop.value is not None else first
    raise InvalidArgumentError("an emitter must yield exactly once (after its prefetch part)")


def emit_store(ctx: EmitCtx, src: TensorRef, out: Out) -> Emitter:
    """Store an on-chip tensor into the HBM tensor ``out.ref`` (a fused layer's result, which the
    next launch reads from HBM): each region once, by the core holding it (replicas skipped), on
    that core's last DMA queue. Yields/returns ``{"y": ...}`` with each region ready when its
    store has landed. An HBM ``src`` is returned as it is (nothing to move)."""
    if src.in_hbm:
        yield {"y": src}
        return {"y": src}
    if not out.in_hbm or out.ref.shape != src.shape:
        raise InvalidArgumentError(f"emit_store: {src.name} {list(src.shape)} needs an HBM destination of "
                                   "the same shape")
    kb = ctx.kb
    ref = out.ref
    seen: set[tuple[int, int, int, int]] = set()
    plan: list[tuple[Piece, Any]] = []
    sems: dict[int, Any] = {}
    count: dict[int, int] = {}
    for p in src.pieces:
        key = (p.r0, p.c0, p.rows, p.cols)
        if key in seen:
            continue
        seen.add(key)
        core = p.tile.core
        if core not in sems:
            sems[core], count[core] = kb.semaphore(f"c{core}.stored"), 0
        count[core] += 1
        plan.append((p, count[core]))
        ref = ref.with_ready(p.r0, p.c0, p.rows, p.cols, (sems[core].id, count[core]))
    outs = {"y": ref}
    yield outs
    for p, _ in plan:
        q = kb.core(p.tile.core).dma[-1]
        if p.ready is not None:
            q.wait(*p.ready)
        q.store(out.ref.hbm_view(p.r0, p.c0, p.rows, p.cols), p.tile)
        q.signal(sems[p.tile.core])
    return outs


def emit_copy(ctx: EmitCtx, src: TensorRef, out: Out) -> Emitter:
    """Copy ``src`` (HBM or on chip) into the HBM tensor ``out.ref`` of the same shape: rows split
    over the budget's cores, each core bringing its rows into its scratchpad in tiles and storing
    them (a prefill chunk's [c_kv | k_pe] rows assembled from two producers). Yields/returns
    ``{"y": ...}``, each core's rows ready when its stores have landed."""
    if not out.in_hbm or out.ref.shape != src.shape or out.ref.dtype != src.dtype or src.is_mx:
        raise InvalidArgumentError(f"emit_copy: {src.name} {list(src.shape)} needs an HBM destination of the "
                                   "same shape and dtype (not MX)")
    kb = ctx.kb
    rows, cols = src.shape
    row_bytes = out.ref.base.row_bytes
    cores = min(ctx.budget.cores, rows)
    per = -(-rows // cores)
    tile_rows = max(1, min(per, ctx.budget.sram_bytes // 2 // max(row_bytes, 1)))
    ref = out.ref
    plan = []
    for c in range(cores):
        lo, hi = c * per, min(rows, (c + 1) * per)
        if lo >= hi:
            continue
        sem = kb.semaphore(f"c{c}.copied")
        plan.append((c, lo, hi, sem))
        ref = ref.with_ready(lo, 0, hi - lo, cols, (sem.id, -(-(hi - lo) // tile_rows)))
    outs = {"y": ref}
    yield outs
    for c, lo, hi, sem in plan:
        core = kb.core(c)
        bufs = [kb.sram(c, f"rows{b}", (tile_rows, cols), src.dtype) for b in range(2)]
        put = kb.semaphore(f"c{c}.put")
        waited: dict[Any, set[Ready]] = {}
        st = core.dma[-1]
        for i, r0 in enumerate(range(lo, hi, tile_rows)):
            n = min(tile_rows, hi - r0)
            buf = bufs[i % 2].sub(0, 0, n, cols)
            free = [(put.id, i - 1)] if i >= 2 else []  # the store that last read this buffer is done
            qs = core.dma[0] if src.in_hbm else core.dma[:-1]
            used = fetch(qs, buf, src, r0, 0, waited=waited, after=free)
            got = kb.semaphore(f"c{c}.got{i}")
            for q in used:
                q.signal(got)
            st.wait(got, len(used))
            st.store(out.ref.hbm_view(r0, 0, n, cols), buf)
            st.signal(put)
            st.signal(sem)
    return outs


def _cover(order: Sequence[Piece], r0: int, c0: int, rows: int, cols: int
           ) -> list[tuple[Piece, int, int, int, int]] | None:
    """``TensorRef.sources``' choice: (piece, r0, c0, rows, cols) of the part of region
    [r0:r0+rows, c0:c0+cols] each piece of ``order`` contributes, taking a piece when its part
    shares no element with the parts taken before it, until they cover the region; None when
    they never do.

    Parts taken are disjoint, so the region is covered when their areas add up to it. When the
    parts are bands (all span the same columns, or all the same rows) that do not overlap, which
    is what the emitters' tensors give, every part is taken in turn; otherwise a part is tested
    against the parts taken before it while they are few, on a grid of the region after that
    (the test the grid alone made, a numpy call per piece, cost more than the rest)."""
    out: list[tuple[Piece, int, int, int, int]] = []
    r1, c1 = r0 + rows, c0 + cols
    parts = [(p, max(r0, p.r0), min(r1, p.r0 + p.rows), max(c0, p.c0), min(c1, p.c0 + p.cols))
             for p in order if p.tile is not None]
    left = rows * cols
    if _bands_apart(parts):
        for p, a0, a1, b0, b1 in parts:
            out.append((p, a0, b0, a1 - a0, b1 - b0))
            left -= (a1 - a0) * (b1 - b0)
            if left <= 0:
                return out
        return None
    taken: list[tuple[int, int, int, int]] = []
    need = None
    for p, a0, a1, b0, b1 in parts:
        if need is None:
            if any(x0 < a1 and a0 < x1 and y0 < b1 and b0 < y1 for x0, x1, y0, y1 in taken):
                continue
            taken.append((a0, a1, b0, b1))
            if len(taken) > 32:
                need = np.zeros((rows, cols), dtype=bool)
                for x0, x1, y0, y1 in taken:
                    need[x0 - r0:x1 - r0, y0 - c0:y1 - c0] = True
        else:
            part = need[a0 - r0:a1 - r0, b0 - c0:b1 - c0]
            if part.any():
                continue
            part[...] = True
        out.append((p, a0, b0, a1 - a0, b1 - b0))
        left -= (a1 - a0) * (b1 - b0)
        if left <= 0:
            return out
    return None


def _bands_apart(parts: Sequence[tuple[Any, int, int, int, int]]) -> bool:
    """True when the (piece, r0, r1, c0, c1) parts all span the same columns and their rows do
    not overlap, or all span the same rows and their columns do not overlap (then no two share
    an element). False says nothing."""
    if len(parts) < 2:
        return True
    _, a0, a1, b0, b1 = parts[0]
    if all(p[3] == b0 and p[4] == b1 for p in parts):
        spans = sorted((p[1], p[2]) for p in parts)
    elif all(p[1] == a0 and p[2] == a1 for p in parts):
        spans = sorted((p[3], p[4]) for p in parts)
    else:
        return False
    return all(spans[k][0] >= spans[k - 1][1] for k in range(1, len(spans)))
