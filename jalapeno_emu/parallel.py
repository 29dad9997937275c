"""Independent tasks on any :class:`concurrent.futures.Executor`: local processes, threads, a Dask cluster.

Stage: shared by the sweeps (:func:`jalapeno_emu.serving.sweep`,
:func:`jalapeno_emu.rack.deployment.sweep_mappings`), ``compare``
(:func:`jalapeno_emu.rack.deployment.compare_presets`) and the validation
(:func:`jalapeno_emu.validation.run.run_validation`), whose points are independent simulations.

- :func:`ordered_map` runs tasks on an executor (None: serially, in the calling thread) and returns
  their results in submission order, so a parallel run returns what a serial one does; its
  progress callback runs in the calling thread as tasks complete.
- :class:`LocalPool` is a process pool on this machine started with ``spawn``: forking a process
  that has JAX loaded is unsafe (JAX runs threads; a forked child inherits their locks held). Its
  processes start as tasks need them, so a pool sized to the CPUs starts no more processes than
  there are tasks, and a single task runs in the calling process (one task gains nothing from a
  process, which would pay its start-up and JAX import).
- :func:`executor` builds the executor the CLI's ``--workers N`` / ``--scheduler ADDRESS`` ask for
  (the latter a Dask ``distributed`` cluster, an optional dependency:
  ``pip install 'jalapeno-emu[distributed]'``).

Task functions must be module-level and their arguments and results picklable (they cross
process boundaries): pass chip specs, model configs and preset names, not timers or step models.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from concurrent.futures import Future as _Future
from multiprocessing.context import SpawnContext
from typing import Any, TypeVar

from jalapeno_emu.errors import EmuError, InvalidArgumentError

__all__ = ["LocalPool", "default_workers", "executor", "ordered_map", "spawn_context"]

R = TypeVar("R")


def spawn_context() -> SpawnContext:
    """The ``spawn`` multiprocessing context every process pool of the project uses."""
    return multiprocessing.get_context("spawn")


def default_workers(tasks: int | None = None) -> int:
    """Processes for ``tasks`` independent tasks when the user names none: 1 for a single task or
    on a one-CPU machine, else ``min(os.cpu_count(), tasks)`` (the CPU count when ``tasks`` is
    not known yet)."""
    cpus = os.cpu_count() or 1
    if cpus == 1 or (tasks is not None and tasks <= 1):
        return 1
    return cpus if tasks is None else min(cpus, tasks)


def _check_workers(workers: int | None) -> None:
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise InvalidArgumentError(f"workers must be an integer >= 1; got {workers!r}")


class LocalPool(ProcessPoolExecutor):
    """A process pool on this machine, ``spawn`` started, processes started as tasks need them.

    Args:
        max_workers: at most this many processes; None: :func:`default_workers` (the CPU count).

    Raises:
        InvalidArgumentError: ``max_workers`` is not an integer >= 1.
    """

    def __init__(self, max_workers: int | None = None) -> None:
        _check_workers(max_workers)
        self.max_workers = max_workers or default_workers()
        super().__init__(max_workers=self.max_workers, mp_context=spawn_context())

    def workers_for(self, tasks: int) -> int:
        """Processes ``tasks`` tasks would occupy; :func:`ordered_map` runs them in the calling
        thread when that is 1."""
        return max(1, min(self.max_workers, tasks))


def ordered_map(
    fn: Callable[..., R],
    tasks: Sequence[tuple[Any, ...]],
    *,
    executor: Executor | None = None,
    on_result: Callable[[int, R], None] | None = None,
) -> list[R]:
    """``[fn(*args) for args in tasks]``, the calls run on ``executor``.

    Args:
        fn: a module-level function (pickled by reference to reach another process).
        tasks: the argument tuples, one per call.
        executor: where the calls run; None runs them here, one after the other. An executor with
            a ``workers_for(tasks)`` method (:class:`LocalPool`) that answers 1 runs them here too.
        on_result: called in the calling thread with (task index, result) as each call completes:
            in order when serial, in completion order otherwise.

    Returns:
        The results in the order of ``tasks``, whatever order they completed in.

    Raises:
        Exception: what the first failing task in the order of ``tasks`` raised, as a serial run
            raises it (a task that fails is raised once every task before it has finished; the
            tasks after it are cancelled where they have not started).
    """
    tasks = list(tasks)
    workers_for = getattr(executor, "workers_for", None)
    if executor is None or (workers_for is not None and workers_for(len(tasks)) <= 1):
        results: list[R] = []
        for i, args in enumerate(tasks):
            results.append(fn(*args))
            if on_result is not None:
                on_result(i, results[-1])
        return results
    futures = [executor.submit(fn, *args) for args in tasks]
    index = {f: i for i, f in enumerate(futures)}
    try:
        for f in as_completed(futures):
            if f.exception() is not None:
                raise _earliest_failure(futures, index[f])
            if on_result is not None:
                on_result(index[f], f.result())
    except BaseException:
        for f in futures:
            f.cancel()
        raise
    return [f.result() for f in futures]


def _earliest_failure(futures: list[_Future[Any]], failed: int) -> BaseException:
    """The exception a serial run would raise, once task ``failed`` is known to fail: the first
    failure among the tasks up to it (those before it are waited for; those after, cancelled)."""
    for f in futures[failed + 1:]:
        f.cancel()
    for f in futures[:failed]:
        exc = f.exception()
        if exc is not None:
            return exc
    exc = futures[failed].exception()
    assert exc is not None
    return exc


@contextlib.contextmanager
def executor(workers: int | None = None, scheduler: str | None = None) -> Iterator[Executor | None]:
    """The executor ``--workers`` / ``--scheduler`` ask for, shut down on leaving the block.

    Args:
        workers: local processes; 1 yields None (serial, in this process); None sizes a
            :class:`LocalPool` to the CPUs (None on a one-CPU machine), which starts processes as
            tasks need them and runs a single task in this process.
        scheduler: address of a Dask scheduler (``tcp://host:8786``): its cluster's executor
            (``distributed.Client(scheduler).get_executor()``); the cluster's workers need
            jalapeno-emu installed.

    Raises:
        InvalidArgumentError: both given, or ``workers`` is not an integer >= 1.
        EmuError: ``scheduler`` given but ``distributed`` is not installed, or the scheduler cannot
            be reached.
    """
    _check_workers(workers)
    if scheduler is not None:
        if workers is not None:
            raise InvalidArgumentError("give workers or a scheduler, not both: a cluster's own workers "
                                       "run the tasks")
        with _dask_executor(scheduler) as ex:
            yield ex
        return
    size = default_workers() if workers is None else workers
    if size == 1:
        yield None
        return
    pool = LocalPool(workers)
    try:
        yield pool
    except BaseException:
        # Do not sit out minutes of running tasks after an error or Ctrl-C: drop what has not started.
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


@contextlib.contextmanager
def _dask_executor(address: str) -> Iterator[Executor]:
    try:
        from distributed import Client
    except ImportError:
        raise EmuError(f"scheduler {address}: a Dask cluster needs the 'distributed' package, which is "
                       "not installed", hint="pip install 'jalapeno-emu[distributed]'") from None
    try:
        client = Client(address)
    except (OSError, TimeoutError, ValueError) as exc:
        reason = " ".join(str(exc).split())
        raise EmuError(f"cannot connect to the Dask scheduler at {address}: {reason}") from None
    try:
        # pure=False: every submission runs, even of equal arguments (no hashing of large specs).
        ex = client.get_executor(pure=False)
        try:
            yield ex
        except BaseException:
            ex.shutdown(wait=False)
            raise
        ex.shutdown(wait=True)
    finally:
        client.close()
