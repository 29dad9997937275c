"""Fused programs: a sequence of emitters composed into one persistent Program.

Stage: kernels, above the emitters (``kernels/emit.py``), below the model (``model/fused.py``
composes a layer or a whole step with it). A :class:`Composer` takes operators in program order
(each an emitter with its inputs bound to earlier operators' outputs) and emits them into one
builder, each in its own builder region (``KernelBuilder.region``), so that:

- **operator boundaries are semaphore edges**: an operator's engines wait for exactly the pieces
  of its inputs they touch (``TensorRef`` readiness), not for the whole previous kernel, and the
  launch cost is paid once for the program;
- **activations stay on chip** where the emitters keep them (``Out.onchip``/``Out.replicated``):
  the next operator copies them scratchpad to scratchpad or reads them in place;
- **the weights of the next operators stream while the current one computes**: the prefetch parts
  of up to ``lookahead`` operators ahead are emitted before the rest of the current one (on every
  engine queue, what comes first in the program runs first), as far as free memory allows;
- **memory is reused across operators**: each core's scratchpad and accumulators are an
  :class:`Arena`. An operator's buffers are freed when it is done, its outputs when their last
  reader is; an operator that reuses freed memory first waits, on every engine it uses, for the
  regions that last held it to be done (its region's *fences*). Reuse is only ever of memory
  freed by operators whose whole program was emitted before, so a fence never waits on
  something behind it in a queue (no deadlock), and the checker's race detector proves each
  reuse ordered.

**Plans do not change with fusion.** Every operator plans with the stand-alone budget
(``Budget.of(spec)``), so a fused program does exactly the arithmetic of the launches it
replaces, only scheduled differently. When the prefetch of an operator does not fit beside the
operators still running, it waits until more of them are done (in the limit, until the
operator before it is: no lookahead). At its own turn, when its buffers do not fit with the
arena's preference for memory released longest ago (which only serves prefetch overlap), it is
placed again by plain first fit over all free memory. Only when it does not fit even then,
beside the values still live on chip, is it re-planned within what they leave
(``FusedOp.replanned``; its tiling, and for kernels whose arithmetic follows the tiling its
results, may then differ from the stand-alone launch's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, NamedTuple

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.isa.builder import KernelBuilder, Region
from jalapeno_emu.isa.table import Space

from .emit import EmitCtx, Emitter, Out, Ready, TensorRef
from .planning import SRAM_SHARE, Budget, DoesNotFit

__all__ = ["Arena", "ArenaFull", "Composer", "FusedOp"]


class ArenaFull(DoesNotFit):
    """No free memory of the size asked for (the composer defers the operator, or gives up)."""


class _Segment(NamedTuple):
    """A run of free memory [start, end) and the fences a new occupant waits for (a named tuple:
    the allocator unpacks tens of them per allocation)."""

    start: int
    end: int
    fences: frozenset[Ready]


_segment_start = itemgetter(0)


class Arena:
    """The scratchpad and accumulator memory of every core of a fused program, reused over time.

    Free memory is a sorted list of segments per (space, core), each with the fences (region
    done conditions) a new occupant must wait for. ``alloc`` takes the first run of adjacent
    free segments that holds the bytes (the last such run, from the top, for a kept output),
    preferring memory whose last occupants finished longest ago (unless ``first_fit``, or for a
    kept output when such memory is only in the lower half); ``release`` returns a region's
    memory with the region's done condition as its fence.
    """

    def __init__(self, spec: ChipSpec) -> None:
        self.caps = {Space.SRAM: spec.sram.scratchpad_bytes, Space.ACC: spec.sram.accumulator_bytes}
        self._free: dict[tuple[Space, int], list[_Segment]] = {}
        self._held: dict[str, list[tuple[Space, int, int, int]]] = {}  # region -> scratch blocks
        self._kept: dict[str, list[tuple[Space, int, int, int]]] = {}  # region -> output blocks
        self._age: dict[Ready, int] = {}  # fence -> release sequence number
        self._releases = 0
        self._recent: dict[frozenset[Ready], bool] = {}  # fence set -> released recently (until a release)
        # Plain first fit, recent memory included: an operator's last try before a re-plan.
        self.first_fit = False

    def _segments(self, space: Space, core: int) -> list[_Segment]:
        key = (space, core)
        if key not in self._free:
            self._free[key] = [_Segment(0, self.caps[space], frozenset())]
        return self._free[key]

    def alloc(self, space: Space, core: int, nbytes: int, align: int, region: Region,
              keep: bool) -> tuple[int, frozenset[Ready]]:
        """(offset, fences) of ``nbytes`` for ``region``; ArenaFull when no run of free memory fits."""
        segs = self._segments(space, core)
        best = None
        # memory released at least two releases ago first (its fences are likely passed already)
        for recent in (True,) if self.first_fit else (False, True):
            find = self._find_top if keep else self._find
            best = find(segs, nbytes, align, allow_recent=recent)
            if best is not None and keep and not recent and best[2] < self.caps[space] // 2:
                # Old memory only low in the scratchpad: a kept output there would split the
                # free memory as badly as first fit did, so it takes the top, fenced on a
                # recent region (Kimi K2.5's layer-1 MoE at batch 80 did not fit otherwise).
                best = None
            if best is not None:
                break
        if best is None:
            free = sum(s.end - s.start for s in segs)
            raise ArenaFull(f"region {region.name!r}: {nbytes:,} B of {space.value} on core {core} do not "
                            f"fit ({free:,} B free in pieces)")
        i, j, start = best
        fences = frozenset().union(*(s.fences for s in segs[i:j + 1]))
        end = start + nbytes
        keep_segs = []
        if segs[i].start < start:
            keep_segs.append(_Segment(segs[i].start, start, segs[i].fences))
        if end < segs[j].end:
            keep_segs.append(_Segment(end, segs[j].end, segs[j].fences))
        segs[i:j + 1] = keep_segs
        (self._kept if keep else self._held).setdefault(region.name, []).append((space, core, start, end))
        return start, fences

    def _released_recently(self, fences: frozenset[Ready]) -> bool:
        """Whether memory behind ``fences`` was released in the last two releases (segments share
        few fence sets: each is tested once per release)."""
        hit = self._recent.get(fences)
        if hit is None:
            horizon = self._releases - 1
            hit = self._recent[fences] = any(self._age.get(f, 0) >= horizon for f in fences)
        return hit

    def _find(self, segs: list[_Segment], nbytes: int, align: int, allow_recent: bool
              ) -> tuple[int, int, int] | None:
        """(i, j, start): the first run of adjacent free segments ``segs[i..j]`` (none released
        recently unless ``allow_recent``) holding ``nbytes`` from ``segs[i].start`` aligned up to
        ``align``, with the least j; None when none does.

        One pass: a run that starts at segment i and does not fit cannot fit from any later
        segment of the same maximal run either (same end, a later start), so only the first
        segment of each maximal run of adjacent usable segments is a candidate start."""
        recent = not allow_recent
        i = -1
        start = end = 0
        for j, (s_start, s_end, fences) in enumerate(segs):
            if recent and fences and self._released_recently(fences):
                i = -1
                continue
            if i < 0 or s_start != end:
                i = j
                start = -(-s_start // align) * align
            end = s_end
            if end - start >= nbytes:
                return i, j, start
        return None

    def _find_top(self, segs: list[_Segment], nbytes: int, align: int, allow_recent: bool
                  ) -> tuple[int, int, int] | None:
        """Like :meth:`_find`, from the top: the highest run of adjacent free segments that holds
        ``nbytes`` ending at its top (start aligned down), as (i, j, start) with segs[i] the
        segment holding start; None when none does. Kept outputs go here: they outlive the
        operators around them, and scattered over the middle of the scratchpad they left no run
        large enough for a later operator's buffers (DeepSeek-R1's layer-3 MoE at batch 32 was
        re-planned beside two 14 KB norm outputs, 638 us against 408 us)."""
        recent = not allow_recent
        j = -1
        start = end = 0
        for i in range(len(segs) - 1, -1, -1):
            s_start, s_end, fences = segs[i]
            if recent and fences and self._released_recently(fences):
                j = -1
                continue
            if j < 0 or s_end != start:  # a new run: segs[i] is its top
                j, end = i, s_end
            start = s_start
            top = (end - nbytes) // align * align
            if top >= start:
                while segs[i].end <= top:
                    i += 1
                return i, j, top
        return None

    def release(self, region: str, fences: frozenset[Ready], *, kept: bool = False) -> None:
        """Free a region's scratch memory (or, ``kept``, its outputs) behind ``fences``."""
        blocks = (self._kept if kept else self._held).pop(region, [])
        self._releases += 1
        self._recent = {}
        for f in fences:
            self._age[f] = self._releases
        touched: dict[tuple[Space, int], list[_Segment]] = {}
        for space, core, start, end in blocks:
            touched.setdefault((space, core), []).append(_Segment(start, end, fences))
        for (space, core), new in touched.items():
            segs = self._segments(space, core)
            segs.extend(new)
            segs.sort(key=_segment_start)
            merged: list[_Segment] = []
            last_end, last_fences = -1, None
            for s in segs:  # merge neighbours with the same fences
                s_start, s_end, fences = s
                if s_start == last_end and fences == last_fences:
                    merged[-1] = _Segment(merged[-1][0], s_end, fences)
                else:
                    merged.append(s)
                last_end, last_fences = s_end, fences
            segs[:] = merged

    def largest_free(self, cores: int) -> dict[Space, int]:
        """Per space, the smallest over ``cores`` cores of each core's largest run of free bytes."""
        out = {}
        for space in (Space.SRAM, Space.ACC):
            best = []
            for c in range(cores):
                runs, run, end = [], 0, None
                for seg in self._segments(space, c):
                    run = run + (seg.end - seg.start) if end == seg.start else seg.end - seg.start
                    end = seg.end
                    runs.append(run)
                best.append(max(runs, default=0))
            out[space] = min(best)
        return out

    def snapshot(self) -> Any:
        """State to :meth:`restore` (when an operator's emission is rolled back)."""
        # Segments are immutable and the block tuples too, so copying the containers is enough
        # (a deep copy of every core's lists was a sixth of a 36-layer step's build time).
        return ({k: list(v) for k, v in self._free.items()}, {k: list(v) for k, v in self._held.items()},
                {k: list(v) for k, v in self._kept.items()}, dict(self._age), self._releases)

    def restore(self, state: Any) -> None:
        """Go back to a :meth:`snapshot` (which stays usable: it is copied again)."""
        free, held, kept, age, self._releases = state
        self._recent = {}
        self._free = {k: list(v) for k, v in free.items()}
        self._held = {k: list(v) for k, v in held.items()}
        self._kept = {k: list(v) for k, v in kept.items()}
        self._age = dict(age)


@dataclass
class FusedOp:
    """One operator of a fused program.

    Attributes:
        label: its name (the builder region's name: unique, no ``/``).
        emit: (ctx, **inputs) -> the emitter generator.
        inputs: emitter argument -> the value name it reads (an earlier output or an external value).
        outputs: emitter output name -> the value name it is bound to.
        kind: what it is for reports (the kernel name).
        region: the builder region once started; done: its (semaphore, count) once closed.
        hbm: for ``add_kernel`` operators, each tensor it allocated -> its recorded HBM name
            (what a functional run binds data to).
    """

    label: str
    emit: Callable[..., Emitter]
    inputs: dict[str, str]
    outputs: dict[str, str]
    kind: str = ""
    region: Region | None = None
    done: tuple[Any, int] | None = None
    gen: Emitter | None = field(default=None, repr=False)
    hbm: dict[str, str] = field(default_factory=dict)  # kernel tensor -> recorded HBM name
    replanned: bool = False  # planned within the memory live values left, not the stand-alone budget


class Composer:
    """Emits operators into one Program (see the module docstring).

    Args:
        kb: the builder of the fused program.
        spec: the chip.
        lookahead: operators whose prefetch part may run ahead of the current one.
        budget: the budget each operator plans with (default: the stand-alone one, so plans match
            the stand-alone launches').
    """

    def __init__(self, kb: KernelBuilder, spec: ChipSpec, *, lookahead: int = 2,
                 budget: Budget | None = None) -> None:
        self.kb, self.spec = kb, spec
        self.lookahead = max(0, lookahead)
        self.arena = Arena(spec)
        self.ctx = EmitCtx(kb, spec, budget or Budget.of(spec))
        self.values: dict[str, TensorRef] = {}
        self.ops: list[FusedOp] = []
        self._producer: dict[str, int] = {}
        self._views: dict[str, tuple[tuple[str, ...], Callable[..., TensorRef]]] = {}
        self._reader_lists: dict[int, list[int]] | None = None

    def value(self, name: str, ref: TensorRef) -> None:
        """An external value (an HBM tensor the program starts with)."""
        if name in self.values or name in self._producer:
            raise DoesNotFit(f"value {name!r} defined twice")
        self.values[name] = ref

    def view(self, name: str, of: str, r0: int, c0: int, rows: int, cols: int) -> None:
        """A value that is region [r0:r0+rows, c0:c0+cols] of value ``of`` (the q, k and v columns
        of a QKV projection), readable once ``of`` is produced."""
        self.derive(name, (of,), lambda ref: ref.region(r0, c0, rows, cols, name=name))

    def derive(self, name: str, of: tuple[str, ...], fn: Callable[..., TensorRef]) -> None:
        """A value computed from the refs of values ``of`` by ``fn`` (a view or a join of them: no
        instructions), readable once they are produced."""
        if name in self.values or name in self._producer or name in self._views:
            raise DoesNotFit(f"value {name!r} defined twice")
        for src in of:
            if src not in self.values and src not in self._producer and src not in self._views:
                raise DoesNotFit(f"derived value {name!r}: value {src!r} is not defined before it")
        self._views[name] = (tuple(of), fn)

    def _resolve(self, name: str) -> TensorRef:
        if name in self._views:
            of, fn = self._views[name]
            return fn(*(self._resolve(src) for src in of))
        return self.values[name]

    def _sources(self, name: str) -> set[str]:
        """The produced (or external) values a name reads: itself, or what it is derived from."""
        if name not in self._views:
            return {name}
        return set().union(*(self._sources(src) for src in self._views[name][0]))

    def add(self, label: str, emit: Callable[..., Emitter], inputs: Mapping[str, str] | None = None,
            outputs: Mapping[str, str] | None = None, *, kind: str = "") -> FusedOp:
        """Append an operator; its inputs must be external values or earlier operators' outputs."""
        op = FusedOp(label, emit, dict(inputs or {}), dict(outputs or {}), kind)
        for arg, name in op.inputs.items():
            if name not in self.values and name not in self._producer and name not in self._views:
                raise DoesNotFit(f"operator {label!r}: input {arg}={name!r} is not produced before it")
        for name in op.outputs.values():
            if name in self.values or name in self._producer or name in self._views:
                raise DoesNotFit(f"operator {label!r}: value {name!r} is produced twice")
            self._producer[name] = len(self.ops)
        self.ops.append(op)
        return op

    def add_kernel(self, label: str, kernel: str, shape: Mapping[str, Any], *,
                   inputs: Mapping[str, str] | None = None, outputs: Mapping[str, str] | None = None,
                   outs: Mapping[str, Out] | None = None) -> FusedOp:
        """Append a registered kernel as an operator.

        Args:
            label: the operator's name.
            kernel: a registered kernel with an emitter (``KernelDef.emit``).
            shape: its full shape (``KernelDef.shape``).
            inputs: kernel tensor name -> the value it reads (an earlier output or external).
                Every other tensor of ``KernelDef.tensors_of`` is allocated in HBM inside the
                operator's region (``label/name``): weights, caches, scratch, and outputs that
                have no ``outs`` placement (stored there).
            outputs: kernel output name -> the value name it is bound to.
            outs: kernel output name -> where it goes (default: the allocated HBM tensor).
        """
        from .registry import get_kernel

        kdef = get_kernel(kernel)
        if kdef.emit is None or kdef.tensors_of is None:
            raise DoesNotFit(f"kernel {kernel} has no emitter: it cannot run in a fused program")
        shape = dict(shape)
        # Types and limits first: tensors_of plans with the shape, and an absurd size would plan
        # (and then emit) without end. HBM is the builder's to check, as some tensors may be on chip.
        kdef.check_shape(shape)
        specs = kdef.tensors_of(shape, self.spec)
        bound = dict(inputs or {})
        placements = dict(outs or {})
        unknown = (set(bound) | set(placements) | set(outputs or {})) - {t.name for t in specs}
        if unknown:
            raise DoesNotFit(f"operator {label!r} ({kernel}): no tensors named {sorted(unknown)}")
        hbm_names: dict[str, str] = {}

        def emit(ctx: EmitCtx, **refs: TensorRef) -> Emitter:
            tensors = dict(refs)
            for ts in specs:
                if ts.name in tensors:
                    continue
                if ts.role == "output" and ts.name in placements:
                    continue
                tile = (ctx.kb.hbm_mx(ts.name, ts.shape, ts.dtype, ts.mx_axis) if ts.mx_axis is not None
                        else ctx.kb.hbm(ts.name, ts.shape, ts.dtype))
                hbm_names[ts.name] = ctx.kb._scoped(ts.name)
                tensors[ts.name] = TensorRef.hbm(ts.name, tile)
            out_places = {ts.name: placements.get(ts.name) or Out.to(tensors[ts.name])
                          for ts in specs if ts.role in ("output", "inout")}
            return kdef.emit(ctx, shape, tensors, out_places)

        op = self.add(label, emit, bound, outputs, kind=kernel)
        op.hbm = hbm_names
        return op

    # --- emission ---------------------------------------------------------------------------
    def _checkpoint(self) -> tuple:
        kb = self.kb
        return (len(kb._instructions), len(kb._allocs), len(kb._sems), len(kb._regions), dict(kb._next),
                set(self.ctx.consts), self.arena.snapshot())

    def _rollback(self, cp: tuple) -> None:
        kb = self.kb
        n_ins, n_alloc, n_sem, n_reg, nxt, consts, arena = cp
        for a in kb._allocs[n_alloc:]:
            kb._alloc_names.discard((a.space, a.core, a.name))
            kb._tensors.pop(a.name, None)
        del kb._instructions[n_ins:], kb._allocs[n_alloc:], kb._sems[n_sem:], kb._regions[n_reg:]
        for ready in [r for r in kb._implied if r[0] >= n_sem]:  # ids the next semaphores reuse
            del kb._implied[ready]
        kb._next = nxt
        kb._region = None
        for k in set(self.ctx.consts) - consts:
            del self.ctx.consts[k]
        self.arena.restore(arena)

    def _start(self, j: int, *, may_defer: bool, budget: Budget | None = None) -> bool:
        """Emit operator j's prefetch part; False (rolled back) when its memory does not fit yet."""
        op = self.ops[j]
        cp = self._checkpoint()
        base_budget = self.ctx.budget
        if budget is not None:
            self.ctx.budget = budget
        region = self.kb.region(op.label, arena=self.arena)
        try:
            with region:
                inputs = {arg: self._resolve(name) for arg, name in op.inputs.items()}
                gen = op.emit(self.ctx, **inputs)
                try:
                    refs = next(gen)
                except StopIteration:
                    raise DoesNotFit(f"operator {op.label!r}: its emitter must yield after its prefetch "
                                     "part to run in a fused program") from None
        except ArenaFull as exc:
            self._rollback(cp)
            if may_defer:
                return False
            if budget is not None:
                raise DoesNotFit(f"operator {op.label!r} does not fit beside the values still live "
                                 f"on chip, even re-planned within {budget.sram_bytes:,} B per core: "
                                 f"{exc.message}") from None
            if not self.arena.first_fit:
                # The preference for old memory scatters small blocks over the scratchpad, so a
                # large buffer can fail where plain first fit places it: try that before a
                # re-plan, which can cost far more than a fence on a recent region (Kimi K2.5's
                # MoE at batch 64: 1,529 us re-planned against 623 us planned as stand-alone).
                self.arena.first_fit = True
                try:
                    return self._start(j, may_defer=False)
                finally:
                    self.arena.first_fit = False
            # Every earlier operator is done: what is left is the live values. Re-plan this one
            # within the memory they leave (its plan then differs from the stand-alone one's).
            free = self.arena.largest_free(self.spec.core.count)
            budget = Budget(int(free[Space.SRAM] * SRAM_SHARE), free[Space.ACC], self.ctx.budget.cores)
            op.replanned = True
            return self._start(j, may_defer=False, budget=budget)
        finally:
            self.ctx.budget = base_budget
        op.region, op.gen = region, gen
        for out, name in op.outputs.items():
            if out not in refs:
                raise DoesNotFit(f"operator {op.label!r} did not produce output {out!r} "
                                 f"(it produces {sorted(refs)})")
            self.values[name] = refs[out]
        return True

    def _finish(self, j: int) -> None:
        op = self.ops[j]
        assert op.region is not None and op.gen is not None
        with op.region:
            try:
                next(op.gen)
            except StopIteration:
                pass
            else:
                raise DoesNotFit(f"operator {op.label!r}: an emitter must yield exactly once")
        sem, count = op.region.close()
        op.done = (sem, count)
        done = frozenset({(sem.id, count)}) if count else frozenset()
        self.arena.release(op.label, done)
        self._release_outputs(j)

    def _readers(self, j: int) -> list[int]:
        if self._reader_lists is None:  # producer -> the operators reading any of its outputs
            lists: dict[int, list[int]] = {}
            for k, op in enumerate(self.ops):
                for p in sorted({self._producer[n] for name in op.inputs.values()
                                 for n in self._sources(name) if n in self._producer}):
                    lists.setdefault(p, []).append(k)
            self._reader_lists = lists
        return self._reader_lists.get(j, [])

    def _done_fence(self, k: int) -> frozenset[Ready]:
        done = self.ops[k].done
        return frozenset({(done[0].id, done[1])}) if done and done[1] else frozenset()

    def _release_outputs(self, closed: int) -> None:
        """Free the kept outputs of every producer whose readers are all done now."""
        sources = set().union(*(self._sources(n) for n in self.ops[closed].inputs.values()))
        producers = {self._producer[n] for n in sources if n in self._producer}
        producers.add(closed)
        for p in sorted(producers):
            if self.ops[p].done is None:
                continue
            readers = self._readers(p)
            if all(self.ops[k].done is not None for k in readers):
                fences = self._done_fence(p).union(*(self._done_fence(k) for k in readers))
                self.arena.release(self.ops[p].label, fences, kept=True)

    def build(self) -> dict[str, TensorRef]:
        """Emit every operator; returns every value (external and produced) by name.

        Raises:
            DoesNotFit: an operator does not fit even with every earlier one done.
        """
        n = len(self.ops)
        started = 0
        for j in range(n):
            if started <= j:
                self._start(j, may_defer=False)
                started = j + 1
            # Prefetch parts of the next operators go before the rest of this one.
            while started < min(n, j + 1 + self.lookahead):
                if not self._start(started, may_defer=True):
                    break
                started += 1
            self._finish(j)
        return dict(self.values)
