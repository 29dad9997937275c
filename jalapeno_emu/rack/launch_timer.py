"""Kernel launch times for the rack model: the emulator's timing pass, each distinct launch once.

Stage: rack. :class:`LaunchTimer` builds a launch's Program and runs the timing pass (timing-only,
as :class:`jalapeno_emu.model.timing.StepTimer` does), keeping only the figures (not the Timeline,
so thousands of launches stay cheap in memory). One timer per chip spec is shared by every mapping
in a process (:func:`shared_timer`), so launches whose sliced shapes coincide across mappings are
built once.

**Batches a kernel refuses.** Some kernels cap their batch by on-chip capacity (the MoE kernel's
[tokens, hidden] FP32 partial must fit a core's accumulators; GPU presets' small scratchpads refuse
more). When the build raises ``InvalidArgumentError`` for a launch whose kernel has a batch-like
key (below), the batch is split in two halves run as two launches back to back (each paying the
launch cost), recursively; a launch that still fails at batch 1 re-raises the kernel's own error,
naming the kernel and the preset. Batch keys: gemm ``m``; rmsnorm, embedding, logits, moe
``tokens``; attention-decode, kv-append, mla-decode, mla-append ``batch``.

**Disk cache** (optional, off by default in the library, on in the CLI): figures are appended to
a JSON-lines file under ``$JALAPENO_EMU_CACHE_DIR`` (default ``~/.cache/jalapeno-emu``) named by
a hash of the chip spec and a hash of the source of every module that decides a Program or its
timing (kernels, ISA, emulator, chip spec, MX numerics). Editing any of them starts a new file,
so a cached figure is always what this code would compute. Processes share the file: each line is
appended whole, and a timer reads the file when it is made and, on each miss, the lines other
processes have appended since, so a sweep's workers build a figure once between them unless they
reach it at the same moment.

**Launches timed side by side.** Inside :func:`launch_executor` (``serve`` uses it with its
``--workers``), a grid that finds several points untimed at once hands their launches to
:meth:`LaunchTimer.prefetch`, which builds and times them on the executor's processes: the same
function on the same arguments, so the same figures as one after the other; they run while this
process goes on, and :meth:`LaunchTimer.time` waits for a launch's build only when it needs its
figures. A build that fails there is left to :meth:`LaunchTimer.time`, which raises or splits it
as it always did. Sweeps already run their points in processes; there nothing is set and
everything runs in order.

**Re-timing** (for calibration). A Program depends on a spec's structural fields only, so timers
of specs that differ in timing fields alone can share builds: a timer's ``followers`` (timers of
such specs) get every Program this timer builds timed on their own spec too, as it is built, and
the Program is then dropped (GPU-preset Programs run to millions of instructions; keeping them
costs gigabytes). ``keep_programs=True`` instead keeps every Program built, so
:meth:`LaunchTimer.program` can hand it to a subclass overriding :meth:`LaunchTimer._timed_summary`
later. :func:`install_timer` makes such a timer the one :func:`shared_timer` (hence the rack step
model) uses for its spec.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jalapeno_emu.chip import ChipSpec, load_preset
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.files import cache_root
from jalapeno_emu.fingerprint import code_fingerprint, spec_fingerprint
from jalapeno_emu.kernels.planning import DoesNotFit
from jalapeno_emu.kernels.registry import get_kernel
from jalapeno_emu.model.plan import Launch
from jalapeno_emu.model.timing import gc_paused

__all__ = ["BATCH_KEYS", "LaunchTime", "LaunchTimer", "code_fingerprint", "install_timer", "launch_executor",
           "shared_timer"]

BATCH_KEYS: dict[str, str] = {
    "gemm": "m",
    "rmsnorm": "tokens",
    "embedding": "tokens",
    "logits": "tokens",
    "moe": "tokens",
    "attention-decode": "batch",
    "kv-append": "batch",
    "mla-decode": "batch",
    "mla-append": "batch",
}
"""Kernel -> the shape key a refused launch is split along."""


@dataclass(frozen=True)
class LaunchTime:
    """The timing pass's figures for one launch (summed over its pieces when it was split).

    Attributes:
        time_s: launch cost plus makespan, s (summed over pieces).
        hbm_bytes: HBM bytes read and written.
        flops: matrix-unit FLOPs.
        bound: what limits it (the longest piece's bound).
        instructions: Program length (summed).
        pieces: launches it ran as (1 unless the kernel refused the whole batch).
    """

    time_s: float
    hbm_bytes: float
    flops: float
    bound: str
    instructions: int
    pieces: int = 1

    def __add__(self, other: LaunchTime) -> LaunchTime:
        bound = self.bound if self.time_s >= other.time_s else other.bound
        return LaunchTime(
            self.time_s + other.time_s,
            self.hbm_bytes + other.hbm_bytes,
            self.flops + other.flops,
            bound,
            self.instructions + other.instructions,
            self.pieces + other.pieces,
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "time_s": self.time_s,
            "hbm_bytes": self.hbm_bytes,
            "flops": self.flops,
            "bound": self.bound,
            "instructions": self.instructions,
            "pieces": self.pieces,
        }


def _key(launch: Launch) -> str:
    return json.dumps([launch.kernel, [list(kv) for kv in launch.shape]], separators=(",", ":"))


class LaunchTimer:
    """Times kernel launches on one chip spec, each distinct (kernel, shape) once.

    Args:
        spec: the chip (a preset name or a ChipSpec).
        disk_cache: also keep figures on disk across processes (see the module docstring); a path
            chooses the directory.
        keep_programs: keep every Program built (for :meth:`program`; memory grows with them).
    """

    def __init__(
        self,
        spec: ChipSpec | str,
        *,
        disk_cache: bool | str | os.PathLike[str] = False,
        keep_programs: bool = False,
    ) -> None:
        self.spec = load_preset(spec) if isinstance(spec, str) else spec
        self._times: dict[tuple[str, tuple], LaunchTime] = {}
        self._parts: dict[tuple, LaunchTime] = {}
        # Parts refused (a kernel's shape, or slower fused than launched): mappings that split a
        # chip alike ask for the same part, and a refusal can cost a whole build and timing.
        self._refused_parts: dict[tuple, InvalidArgumentError] = {}
        self._programs: dict[tuple[str, tuple], Any] | None = {} if keep_programs else None
        self.followers: list[LaunchTimer] = []
        """Timers of specs differing only in timing fields: each Program built here is also timed
        on theirs (see the module docstring)."""
        self._pending: dict[tuple[str, tuple], tuple[Launch, Future]] = {}  # prefetched, not yet read
        self.builds = 0
        """Programs built and timed in this process (cache misses)."""
        self.build_wall_s = 0.0
        """Wall seconds spent building and timing them."""
        self._file: Path | None = None
        self._disk: dict[str, LaunchTime | _Refusal | _Decision] = {}
        self._decisions: dict[str, str] = {}
        self._disk_read_bytes = 0  # how much of the file _disk holds (whole lines)
        if disk_cache:
            directory = cache_root() if disk_cache is True else Path(disk_cache)
            self._file = directory / f"timings-{spec_fingerprint(self.spec)}-{code_fingerprint()}.jsonl"
            self._disk_read_bytes = _read_cache(self._file, self._disk)

    def _from_disk(self, key: str) -> LaunchTime | _Refusal | _Decision | None:
        """The figures of ``key`` in the disk cache, reading first what other processes appended
        since the last read: a sweep's workers then build a program once between them, not once
        each (a miss costs one ``stat``)."""
        if self._file is None:
            return None
        hit = self._disk.get(key)
        if hit is None:
            try:
                grown = self._file.stat().st_size > self._disk_read_bytes
            except OSError:
                grown = False
            if grown:
                self._disk_read_bytes = _read_cache(self._file, self._disk, self._disk_read_bytes)
                hit = self._disk.get(key)
        return hit

    @property
    def distinct_launches(self) -> int:
        """Distinct launches known to this timer (built here or read from the disk cache)."""
        return len(self._times)

    def time(self, launch: Launch, *, split: bool = True) -> LaunchTime:
        """The figures of ``launch`` (cached; split in halves if the kernel refuses its batch).

        Args:
            split: False raises the kernel's refusal instead of splitting the batch.

        Raises:
            InvalidArgumentError: the kernel refuses the shape even at batch 1 (its message, with
                the kernel and preset named), or at all when ``split`` is False.
        """
        key = (launch.kernel, launch.shape)
        hit = self._times.get(key)
        if hit is None:
            hit = self._prefetched(key) if self._pending else None
            if hit is None:
                hit = self._from_disk(_key(launch))
            if not isinstance(hit, LaunchTime):  # a launch's refusal is never stored: re-measure
                hit = self._measure(launch, split)
            self._times[key] = hit
        return hit

    def _prefetched(self, key: tuple[str, tuple]) -> LaunchTime | None:
        """The figures of a prefetched launch, waiting for its build if it is still running; None
        when it was not prefetched or its build failed there (refused, or its process died):
        :meth:`time` then measures it here, raising or splitting as without prefetching."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return None
        launch, future = pending
        t0 = time.perf_counter()
        try:
            summary = future.result()
        except Exception:  # a crashed worker or a bug: the build here says which
            summary = None
        self.build_wall_s += time.perf_counter() - t0  # the wait: the build ran meanwhile
        if summary is None:
            return None
        self.builds += 1
        hit = _launch_time(summary)
        self._remember(launch, hit)
        return hit

    def prefetch(self, launches: Sequence[Launch]) -> int:
        """Start building and timing, on the executor of :func:`launch_executor`, those of
        ``launches`` that neither this timer nor the disk cache knows, and return at once;
        :meth:`time` then waits for each when it needs it. Nothing starts without such an
        executor, for fewer than two new launches, or on a timer that keeps its programs or has
        followers (those need the Program here).

        Returns:
            How many builds were started.
        """
        use = _EXECUTOR[-1]
        if use is None or self._programs is not None or self.followers:
            return 0
        todo: dict[tuple[str, tuple], Launch] = {}
        for launch in launches:
            key = (launch.kernel, launch.shape)
            if key in self._times or key in todo or key in self._pending:
                continue
            hit = self._from_disk(_key(launch))
            if isinstance(hit, LaunchTime):
                self._times[key] = hit
            else:
                todo[key] = launch
        # Worth the pool only when running the batch side by side saves more than it costs: the
        # pool's start-up (its processes import the project) the first time, a batch's round trip
        # later. The builds so far tell what one costs here.
        expected_s = len(todo) * self.build_wall_s / self.builds if self.builds else 0.0
        saved_s = expected_s * (1.0 - 1.0 / max(2, min(use.workers, len(todo))))
        if len(todo) < 2 or saved_s <= (use.batch_s if use.started else use.start_s):
            return 0
        use.started = True
        for key, launch in todo.items():
            self._pending[key] = (launch, use.pool.submit(_build_and_time_or_none, launch,
                                                          launch.shape_dict, self.spec))
        return len(todo)

    def time_part(self, cfg: Any, layer: int, step: Any, launches: tuple[Launch, ...]) -> LaunchTime:
        """The figures of ``launches`` (part of layer ``layer`` of ``cfg`` for ``step``) run as one
        fused program (``model.fused.build_part``), without the launch cost: the caller pays one
        launch per layer or per step (cached like launches, by the launches and the step).

        Raises:
            InvalidArgumentError: a kernel of the part has no emitter or refuses its shape.
            DoesNotFit: operators were re-planned and the program is slower than the launches
                back to back (the caller then times the launches).
        """
        key = ("part", cfg.attention, step, tuple((la.label, la.kernel, la.shape) for la in launches))
        refused = self._refused_parts.get(key)
        if refused is not None:
            raise refused.with_traceback(None)
        hit = self._parts.get(key)
        if hit is None:
            disk_key = json.dumps(["part", cfg.attention, repr(step),
                                   [[la.label, la.kernel, [list(kv) for kv in la.shape]] for la in launches]],
                                  separators=(",", ":"))
            hit = self._from_disk(disk_key)
            if isinstance(hit, _Refusal):  # refused by an earlier run of this code on this spec
                refused = self._refused_parts[key] = hit.error()
                raise refused
            if hit is None:
                from jalapeno_emu.model.fused import build_part

                t0 = time.perf_counter()
                try:
                    with gc_paused():
                        fb = build_part(cfg, step, self.spec, layer, launches)
                        s = run_timing(fb.program, self.spec).summary()
                        replanned = [op.label for op in fb.composer.ops if op.replanned]
                        del fb  # see _build_and_time
                except InvalidArgumentError as exc:
                    self._refused_parts[key] = exc
                    self._write_refusal(disk_key, exc)
                    raise
                self.builds += 1
                self.build_wall_s += time.perf_counter() - t0
                hit = LaunchTime(float(s["makespan_s"]), float(s["hbm_bytes"]), float(s["flops"]),
                                 str(s["bound"]), int(s["instructions"]))
                if replanned:
                    # Operators re-planned into the memory the others leave can make the program
                    # slower than its launches back to back, launch costs included (Kimi K2.5's
                    # dense-layer token part at 4,096 tokens: 4.26 ms fused, 1.03 ms launched);
                    # the software would launch them then, and so does the caller on this error.
                    launched = sum(self.time(la).time_s for la in launches)
                    if launched < hit.time_s:
                        exc = DoesNotFit(
                            f"the fused part ({', '.join(la.label for la in launches)}) takes "
                            f"{hit.time_s * 1e6:,.1f} us with {', '.join(replanned)} re-planned, its "
                            f"launches {launched * 1e6:,.1f} us")
                        self._refused_parts[key] = exc
                        self._write_refusal(disk_key, exc)
                        raise exc
                self._write_line(disk_key, hit)
            self._parts[key] = hit
        return hit

    def moe_grouping(self, launch: Launch) -> str:
        """The MoE kernel's program family for ``launch`` on this timer's spec ("dense" or "gather",
        :func:`jalapeno_emu.kernels.moe.grouping_of`), remembered like a launch's figures: in
        memory and in the disk cache. The rack asks it at every MoE grid point of every mapping,
        and answering it runs the kernel's planners: 1-2 s of each model's warm sweep."""
        key = json.dumps(["moe-grouping", [list(kv) for kv in launch.shape]], separators=(",", ":"))
        hit = self._decisions.get(key)
        if hit is None:
            found = self._from_disk(key)
            if isinstance(found, _Decision):
                hit = found.value
            else:
                from jalapeno_emu.kernels.moe import grouping_of  # the kernel's own rule

                hit = grouping_of(launch.shape_dict, self.spec)
                self._write_line(key, _Decision(hit))
            self._decisions[key] = hit
        return hit

    def time_s(self, launch: Launch) -> float:
        """Seconds of ``launch`` (see :meth:`time`)."""
        return self.time(launch).time_s

    def program(self, launch: Launch) -> Any:
        """The Program of ``launch`` built on this timer's spec (kept when ``keep_programs``).

        Raises:
            InvalidArgumentError: the kernel refuses the shape on this spec.
        """
        key = (launch.kernel, launch.shape)
        prog = self._programs.get(key) if self._programs is not None else None
        if prog is None:
            with gc_paused():
                prog = get_kernel(launch.kernel).build(launch.shape_dict, self.spec).program
            if self._programs is not None:
                self._programs[key] = prog
        return prog

    def drop_programs(self) -> None:
        """Forget the kept Programs (their memory); figures stay cached."""
        if self._programs is not None:
            self._programs.clear()

    def _timed_summary(self, launch: Launch, shape: dict[str, Any]) -> dict[str, Any]:
        """The timing pass's summary of ``launch`` on this spec (built here unless programs are kept)."""
        if self._programs is not None or self.followers:
            prog = self.program(launch)
            with gc_paused():
                for follower in self.followers:
                    follower._adopt(launch, run_timing(prog, follower.spec).summary())
                return run_timing(prog, self.spec).summary()
        return _build_and_time(launch, shape, self.spec)

    def _adopt(self, launch: Launch, summary: dict[str, Any]) -> None:
        """Take a timing-pass summary of ``launch`` on this spec computed by a leader's build."""
        key = (launch.kernel, launch.shape)
        if key not in self._times:
            self._times[key] = _launch_time(summary)
            self._remember(launch, self._times[key])

    def _measure(self, launch: Launch, split: bool) -> LaunchTime:
        shape = launch.shape_dict
        t0 = time.perf_counter()
        try:
            s = self._timed_summary(launch, shape)
        except InvalidArgumentError as exc:
            if not split:
                raise
            return self._split(launch, shape, exc)
        self.builds += 1
        self.build_wall_s += time.perf_counter() - t0
        out = _launch_time(s)
        self._remember(launch, out)
        return out

    def _split(self, launch: Launch, shape: dict[str, Any], exc: InvalidArgumentError) -> LaunchTime:
        key = BATCH_KEYS.get(launch.kernel)
        n = shape.get(key, 1) if key else 1
        if n < 2:
            raise InvalidArgumentError(
                f"kernel {launch.kernel} cannot run on {self.spec.name}: {exc.message}", hint=exc.hint
            ) from None
        halves = []
        for part in (n - n // 2, n // 2):
            sub = dict(shape, **{key: part})
            if launch.kernel == "moe" and sub.get("experts"):
                sub["distinct_experts"] = (
                    min(sub["distinct_experts"], part * sub["top_k"]) if sub.get("distinct_experts") else 0
                )
            halves.append(Launch(launch.label, launch.kernel, tuple(sorted(sub.items()))))
        return self.time(halves[0]) + self.time(halves[1])

    def _remember(self, launch: Launch, t: LaunchTime) -> None:
        self._write_line(_key(launch), t)

    def _write_refusal(self, key: str, exc: InvalidArgumentError) -> None:
        """Store a part's refusal: a warm run then skips the build that found it (DeepSeek-R1's
        sweep re-built 16 refused parts, 40 s of its warm run)."""
        self._write_line(key, _Refusal(type(exc).__name__, str(exc)))

    def _write_line(self, key: str, t: LaunchTime | _Refusal | _Decision) -> None:
        if self._file is None:
            return
        line = (json.dumps({"key": key, **t.as_dict()}, separators=(",", ":")) + "\n").encode("utf-8")
        try:
            self._file.parent.mkdir(parents=True, exist_ok=True)
            # The processes of a sweep append to the same file at once: one write() of the whole
            # line on an O_APPEND descriptor lands whole after the others' lines (a buffered text
            # file leaves how many writes a long line takes to its buffering).
            fd = os.open(self._file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, line)
            finally:
                os.close(fd)
            if written != len(line):  # a full disk: the torn line is skipped when read
                raise OSError("short write")
        except OSError:
            self._file = None  # an unwritable cache directory only costs speed


def _launch_time(summary: dict[str, Any]) -> LaunchTime:
    return LaunchTime(
        float(summary["time_s"]),
        float(summary["hbm_bytes"]),
        float(summary["flops"]),
        str(summary["bound"]),
        int(summary["instructions"]),
    )


def _build_and_time(launch: Launch, shape: dict[str, Any], spec: ChipSpec) -> dict[str, Any]:
    """Build the launch's Program and run the timing pass; the cyclic garbage collector is paused
    meanwhile (its collections would re-walk the hundreds of thousands of objects a Program is
    made of, costing more than building it). The Program is dropped before the collector
    resumes: reference counting frees it at once, where the first collection after the pause
    would walk every object of it that is still alive (40 ms a build, 17 s of a cold sweep)."""
    with gc_paused():
        build = get_kernel(launch.kernel).build(shape, spec)
        summary = run_timing(build.program, spec).summary()
        del build
    return summary


def _build_and_time_or_none(launch: Launch, shape: dict[str, Any], spec: ChipSpec) -> dict[str, Any] | None:
    """:func:`_build_and_time` for :meth:`LaunchTimer.prefetch` (in another process): None where
    the kernel refuses the shape."""
    try:
        return _build_and_time(launch, shape, spec)
    except InvalidArgumentError:
        return None


POOL_START_S = 4.0
"""Seconds a batch must save by running side by side before :meth:`LaunchTimer.prefetch` starts
a local pool for it: measured, two spawned processes importing the project and running one small
build each took 2-3.5 s on a 2-core machine."""

BATCH_OVERHEAD_S = 0.5
"""Seconds a batch must save once the pool runs: sending launches and specs to its processes and
their figures back, and the parent's wait (measured: `serve` of gpt-oss-120b on jalapeno-v1,
whose builds take 0.15 s, ran 16.2 s alone and 18-23 s sending batches of 2-12 to two processes)."""


@dataclass
class _Use:
    pool: Executor
    start_s: float
    batch_s: float
    workers: int
    started: bool = False


_EXECUTOR: list[_Use | None] = [None]


@contextlib.contextmanager
def launch_executor(pool: Executor | None, *, start_s: float = POOL_START_S,
                    batch_s: float = BATCH_OVERHEAD_S) -> Iterator[None]:
    """Inside the block, :meth:`LaunchTimer.prefetch` runs builds on ``pool`` (None: nowhere,
    they run one by one when needed). The pool's tasks must reach this code: local processes
    (:class:`jalapeno_emu.parallel.LocalPool`) or a cluster with jalapeno-emu installed.

    Args:
        pool: the executor.
        start_s: a batch goes to the pool only when running it side by side would save more
            than this (its builds estimated from this timer's builds so far), until the pool
            has been used once; then when it saves more than ``batch_s``.
    """
    # A local pool says how many processes it runs; another executor (a cluster) counts as two.
    workers = getattr(pool, "max_workers", None) or 2
    _EXECUTOR.append(None if pool is None else _Use(pool, start_s, batch_s, workers))
    try:
        yield
    finally:
        _EXECUTOR.pop()


@dataclass(frozen=True)
class _Refusal:
    """A fused part a kernel refused (``kind``: the exception's class name), as the disk cache
    keeps it."""

    kind: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"refused": self.kind, "message": self.message}

    def error(self) -> InvalidArgumentError:
        """The exception the build raised, rebuilt (DoesNotFit or InvalidArgumentError)."""
        return (DoesNotFit if self.kind == "DoesNotFit" else InvalidArgumentError)(self.message)


@dataclass(frozen=True)
class _Decision:
    """A kernel's choice for a shape (:meth:`LaunchTimer.moe_grouping`), as the disk cache keeps it."""

    value: str

    def as_dict(self) -> dict[str, str]:
        return {"decision": self.value}


def _read_cache(path: Path, out: dict[str, LaunchTime | _Refusal | _Decision], start: int = 0) -> int:
    """Add the entries of the cache file from byte ``start`` on to ``out``; returns the byte just
    past the last whole line read (a line still being written is read next time)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            data = fh.read()
    except OSError:
        return start
    whole = data.rfind(b"\n") + 1
    for raw in data[:whole].splitlines():
        try:
            d = json.loads(raw)
            if "refused" in d:
                out[d["key"]] = _Refusal(str(d["refused"]), str(d["message"]))
                continue
            if "decision" in d:
                out[d["key"]] = _Decision(str(d["decision"]))
                continue
            out[d["key"]] = LaunchTime(
                float(d["time_s"]),
                float(d["hbm_bytes"]),
                float(d["flops"]),
                str(d["bound"]),
                int(d["instructions"]),
                int(d["pieces"]),
            )
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by an interrupted writer
    return start + whole


_SHARED: dict[tuple[str, str, bool], LaunchTimer] = {}


def install_timer(timer: LaunchTimer, *, disk_cache: bool = False) -> None:
    """Make ``timer`` the one :func:`shared_timer` returns for its spec and cache setting (the
    calibration's re-timing timers); a later install for the same spec replaces it."""
    spec = timer.spec
    _SHARED[(spec.name, spec_fingerprint(spec), bool(disk_cache))] = timer


def shared_timer(spec: ChipSpec | str, *, disk_cache: bool = False) -> LaunchTimer:
    """The process-wide timer of ``spec`` (one per distinct spec contents and cache setting)."""
    spec = load_preset(spec) if isinstance(spec, str) else spec
    key = (spec.name, spec_fingerprint(spec), bool(disk_cache))
    timer = _SHARED.get(key)
    if timer is None:
        timer = _SHARED[key] = LaunchTimer(spec, disk_cache=disk_cache)
    return timer
