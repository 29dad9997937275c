"""jalapeno_emu.parallel: results in submission order, the serial run's error, executors from options."""

import os
import pickle
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from jalapeno_emu import parallel
from jalapeno_emu.chip import load_preset
from jalapeno_emu.errors import EmuError, InvalidArgumentError
from jalapeno_emu.parallel import LocalPool, default_workers, executor, ordered_map


def _square_after(i, wait_for, done):
    """Task i finishes only after task i + 1 has: completion order is the reverse of submission."""
    if wait_for is not None:
        assert wait_for.wait(10)
        time.sleep(0.2)  # and task i + 1's future has been marked done meanwhile
    done.set()
    return i * i


def test_results_come_back_in_submission_order_and_progress_as_they_complete():
    events = [threading.Event() for _ in range(3)]
    tasks = [(i, events[i + 1] if i < 2 else None, events[i]) for i in range(3)]
    seen = []
    with ThreadPoolExecutor(3) as pool:
        out = ordered_map(_square_after, tasks, executor=pool, on_result=lambda i, r: seen.append((i, r)))
    assert out == [0, 1, 4]
    assert seen == [(2, 4), (1, 1), (0, 0)]  # completion order, each with its own result
    for e in events:
        e.clear()
    seen.clear()
    assert ordered_map(_square_after, [(i, None, events[i]) for i in range(3)],
                       on_result=lambda i, r: seen.append((i, r))) == [0, 1, 4]
    assert seen == [(0, 0), (1, 1), (2, 4)]


def _fail(i, wait_for, failed):
    if wait_for is not None:
        assert wait_for.wait(10)
        time.sleep(0.2)  # and task 1's future has been marked failed meanwhile
    try:
        if i < 2:
            raise ValueError(f"task {i}")
        return i
    finally:
        if failed is not None:
            failed.set()


def test_the_error_raised_is_the_serial_runs_even_when_a_later_task_fails_first():
    later_failed = threading.Event()
    tasks = [(0, later_failed, None), (1, None, later_failed), (2, None, None)]
    with ThreadPoolExecutor(2) as pool, pytest.raises(ValueError, match="task 0"):
        ordered_map(_fail, tasks, executor=pool)
    with pytest.raises(ValueError, match="task 0"):
        ordered_map(_fail, [(0, None, None), (1, None, None)])


def test_a_local_pool_runs_a_single_task_here_without_starting_a_process():
    pool = LocalPool(2)
    assert pool.max_workers == 2 and pool.workers_for(1) == 1 and pool.workers_for(5) == 2
    with pool:
        assert ordered_map(os.getpid, [()], executor=pool) == [os.getpid()]
        assert not pool._processes


def test_default_workers(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert [default_workers(n) for n in (None, 1, 3, 20)] == [8, 1, 3, 8]
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert default_workers(None) == default_workers(20) == 1
    with executor() as ex:
        assert ex is None  # one CPU: serial, in this process


def test_executor_from_options(monkeypatch):
    with executor(workers=1) as ex:
        assert ex is None
    with executor(workers=3) as ex:
        assert isinstance(ex, LocalPool) and ex.max_workers == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="workers must be an integer >= 1"):
            executor(workers=bad).__enter__()
    with pytest.raises(InvalidArgumentError, match="not both"), executor(workers=2, scheduler="tcp://x:1"):
        pass
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if not installed
    with pytest.raises(EmuError, match=r"needs the 'distributed' package.*jalapeno-emu\[distributed\]"), \
            executor(scheduler="tcp://x:1"):
        pass


def test_chip_specs_cross_process_boundaries():
    for name in ("tiny", "jalapeno-v1", "h200"):
        spec = load_preset(name).replace(**{"software.fusion": "layer"})
        back = pickle.loads(pickle.dumps(spec))
        assert back == spec and hash(back) == hash(spec) and back.provenance == spec.provenance


def test_the_spawn_context_is_the_pools():
    assert parallel.spawn_context().get_start_method() == "spawn"
    with LocalPool(2) as pool:
        assert pool._mp_context.get_start_method() == "spawn"
