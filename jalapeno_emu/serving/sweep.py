"""Sweeps: every (mapping, concurrency) point of a workload, in-process or in a process pool.

Stage: serving. Points are independent simulations (docs/rack.md: run them in a process
pool); ``workers=1`` runs them in this process, in order, which tests and 2-core CI use. A pool
is :class:`jalapeno_emu.parallel.LocalPool` (the ``spawn`` start method: forking a process that has
JAX loaded is unsafe), so models must be picklable (module-level classes; the frozen dataclasses of
:mod:`~jalapeno_emu.serving.synthetic` are).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.parallel import LocalPool, ordered_map
from jalapeno_emu.serving.limits import distinct_concurrencies
from jalapeno_emu.serving.metrics import ServingMetrics
from jalapeno_emu.serving.simulate import DEFAULT_RANGE_RATIO, simulate
from jalapeno_emu.serving.step_model import StepTimeModel

__all__ = ["SweepPoint", "sweep"]


@dataclass(frozen=True)
class SweepPoint:
    """One simulated point of a sweep.

    Attributes:
        mapping: the step model's ``name``.
        series: what the point is grouped and coloured by in plots: the model's optional ``series``
            attribute (e.g. the chip preset) or, without one, its name.
        concurrency: the closed-loop concurrency.
        metrics: the point's metrics.
        kernel_limits: where the step model's kernels refused a batch it then ran in pieces (the
            model's ``kernel_limits()`` after this point; not in ``as_dict``, whose fields are the
            CSV's columns).
    """

    mapping: str
    series: str
    concurrency: int
    metrics: ServingMetrics
    kernel_limits: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The flat JSON fields: ``series`` plus :meth:`ServingMetrics.as_dict`."""
        return {"series": self.series, **self.metrics.as_dict()}


def _series(model: StepTimeModel) -> str:
    return str(getattr(model, "series", None) or model.name)


def _run_point(model: StepTimeModel, concurrency: int, kwargs: dict[str, Any]) -> SweepPoint:
    if kwargs.get("power_w") is None:
        kwargs = {**kwargs, "power_w": getattr(model, "power_w", None)}
    if kwargs.get("stack") is None:
        kwargs = {**kwargs, "stack": getattr(model, "stack", None)}
    metrics = simulate(model, concurrency=concurrency, **kwargs)
    return SweepPoint(model.name, _series(model), concurrency, metrics)


def _check_sweep(models: Sequence[StepTimeModel], concurrencies: Sequence[int],
                 workers: int) -> tuple[int, ...]:
    """The distinct concurrencies, in order, after checking every argument."""
    if not models:
        raise InvalidArgumentError("sweep needs at least one step model")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"sweep model names must be unique (they name the mappings); got {names}")
    if not concurrencies:
        raise InvalidArgumentError("sweep needs at least one concurrency")
    distinct = distinct_concurrencies(concurrencies)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidArgumentError(f"workers must be an integer >= 1; got {workers!r}")
    return distinct


def sweep(models: Sequence[StepTimeModel], concurrencies: Sequence[int], *, isl: int, osl: int,
          requests: int | None = None, warmup_requests: int | None = None, seed: int = 0,
          range_ratio: float = DEFAULT_RANGE_RATIO, power_w: Mapping[str, float] | None = None,
          workers: int = 1, progress: bool = False) -> list[SweepPoint]:
    """Simulate every model (one per mapping) at every concurrency for one ISL/OSL workload.

    Args:
        models: step-time models, one per mapping; names must be unique.
        concurrencies: closed-loop concurrencies (e.g. 1, 2, 4, ... 1024); one given twice is
            simulated once (at most :data:`~jalapeno_emu.serving.limits.MAX_CONCURRENCIES`
            distinct values).
        isl, osl, requests, warmup_requests, seed, range_ratio: as :func:`simulate`; every point
            uses the same seed, so every mapping serves the same request lengths.
        power_w: watts per chip ("package", "sustained", "all_in") for every model; when None, a
            model's own ``power_w`` attribute is used if it has one (mappings on different chips).
        workers: processes; 1 runs in this process.
        progress: show a rich progress bar on stderr.

    Returns:
        One :class:`SweepPoint` per (model, distinct concurrency), models outer, in the order given.
    """
    concurrencies = _check_sweep(models, concurrencies, workers)
    kwargs = dict(isl=isl, osl=osl, requests=requests, warmup_requests=warmup_requests, seed=seed,
                  range_ratio=range_ratio, power_w=None if power_w is None else dict(power_w))
    tasks = [(model, int(c), kwargs) for model in models for c in concurrencies]
    with _Progress(progress, len(tasks)) as bar, contextlib.ExitStack() as stack:
        pool = None if workers == 1 else stack.enter_context(LocalPool(min(workers, len(tasks))))
        return ordered_map(_run_point, tasks, executor=pool, on_result=lambda _i, _p: bar.advance())


class _Progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("serving sweep"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task("points", total=total)

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)
