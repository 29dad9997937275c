"""sweep_mappings and compare_presets on an executor give what a serial run gives; the kernel-timing
disk cache takes concurrent writers."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from jalapeno_emu.kernels.registry import get_kernel
from jalapeno_emu.model.plan import Launch
from jalapeno_emu.parallel import LocalPool
from jalapeno_emu.rack import launch_timer, search
from jalapeno_emu.rack.deployment import compare_presets, sweep_mappings
from jalapeno_emu.rack.launch_timer import LaunchTime, LaunchTimer

TINY = dict(cfg="tiny-gpt-oss", isl=128, osl=16)


@pytest.fixture
def fresh_caches(monkeypatch):
    """Each call starts with no step model or timer in this process, so a second run computes
    everything again instead of reading the first run's figures."""

    def clear():
        monkeypatch.setattr(search, "_MODELS", {})
        monkeypatch.setattr(launch_timer, "_SHARED", {})

    return clear


@pytest.fixture
def cramped(tmp_path):
    """A tiny preset whose scratchpad no MoE program fits: its kernels refuse the model."""
    path = tmp_path / "cramped-tiny.toml"
    path.write_text('inherits = "tiny"\nname = "cramped-tiny"\n[sram]\n'
                    'scratchpad_bytes = { value = "1KiB", assumed = "too small for any tiling" }\n')
    return str(path)


def _sweep(executor=None):
    planned, seen, threads = [], [], set()

    def on_point(p):
        seen.append(p)
        threads.add(threading.get_ident())

    points, screened = sweep_mappings(TINY["cfg"], "tiny", TINY["isl"], TINY["osl"], [1, 4], finalists=1,
                                      on_plan=planned.append, on_point=on_point, executor=executor)
    assert threads == {threading.get_ident()}  # progress is reported in the calling thread
    return points, screened, planned, seen


def test_sweep_mappings_on_threads_equals_serial(fresh_caches):
    fresh_caches()
    serial = _sweep()
    fresh_caches()
    with ThreadPoolExecutor(2) as pool:
        threaded = _sweep(pool)
    points, screened, planned, seen = threaded
    assert len({p.mapping for p in points}) >= 2  # at least two tasks
    assert (points, screened) == serial[:2]
    # progress: every point reported once, as many as planned
    assert planned == [len(points)] and sorted(seen, key=id) == sorted(points, key=id)


def test_compare_presets_on_threads_equals_serial_errors_included(fresh_caches, cramped):
    presets = ["tiny", cramped, "no-such-preset", "jalapeno-v1"]

    def run(executor=None):
        reported = []

        def on_preset(preset, error):
            assert threading.get_ident() == caller
            reported.append((preset, error is None))

        out = compare_presets(TINY["cfg"], presets, TINY["isl"], TINY["osl"], [1], finalists=1,
                              executor=executor, on_preset=on_preset)
        return out, sorted(reported)

    caller = threading.get_ident()

    fresh_caches()
    (results, errors), reported = run()
    with ThreadPoolExecutor(2) as pool:  # warm caches: this checks how the tasks' results are put together
        threaded = run(pool)
    assert threaded == ((results, errors), reported)
    assert list(results) == ["tiny", "jalapeno-v1"] and [len(v) for v in results.values()] == [1, 1]
    assert results["tiny"][0]["preset"] == "tiny" and results["jalapeno-v1"][0]["preset"] == "jalapeno-v1"
    assert list(errors) == [cramped, "no-such-preset"]  # in the order given, as a serial run has them
    assert "cannot run on cramped-tiny" in errors[cramped]
    assert "unknown chip preset" in errors["no-such-preset"]
    assert reported == sorted((p, p in results) for p in presets)


@pytest.mark.slow
def test_compare_presets_in_spawned_processes_equals_serial(cramped):
    # The one test that pays for process start-up: specs (one read from a TOML file) and the
    # per-preset error cross the process boundary.
    presets = ["jalapeno-v1", cramped]
    with LocalPool(2) as pool:
        pooled = compare_presets(TINY["cfg"], presets, TINY["isl"], TINY["osl"], [1], finalists=1,
                                 executor=pool, spec_overrides={"software.fusion": "layer"})
    serial = compare_presets(TINY["cfg"], presets, TINY["isl"], TINY["osl"], [1], finalists=1,
                             spec_overrides={"software.fusion": "layer"})
    assert pooled == serial
    assert list(serial[0]) == ["jalapeno-v1"] and serial[0]["jalapeno-v1"][0]["fusion"] == "layer"
    assert list(serial[1]) == [cramped]


def test_the_disk_cache_keeps_every_line_of_concurrent_writers(tmp_path):
    timers = [LaunchTimer("tiny", disk_cache=tmp_path) for _ in range(4)]
    # keys longer than a file buffer, so a line that took several writes could be torn apart
    pad = "x" * 20_000
    start = threading.Barrier(len(timers))

    def write(w):
        start.wait()
        for k in range(50):
            timers[w]._write_line(f"{w}-{k}-{pad}", LaunchTime(1e-6 * k, 2.0, 3.0, "hbm", w))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(len(timers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (path,) = tmp_path.glob("timings-*.jsonl")
    back: dict = {}
    assert launch_timer._read_cache(path, back) == path.stat().st_size
    assert len(back) == 200
    assert back[f"3-7-{pad}"] == LaunchTime(7e-6, 2.0, 3.0, "hbm", 3)


def test_a_timer_sees_what_other_processes_wrote_since_it_started(tmp_path):
    """A sweep's workers share their figures through the file as they go: a miss reads what the
    others appended before building (each program is built once between them)."""
    first, second = LaunchTimer("tiny", disk_cache=tmp_path), LaunchTimer("tiny", disk_cache=tmp_path)
    assert second._from_disk("k1") is None
    first._write_line("k1", LaunchTime(1e-6, 2.0, 3.0, "hbm", 4))
    assert second._from_disk("k1") == LaunchTime(1e-6, 2.0, 3.0, "hbm", 4)
    (path,) = tmp_path.glob("timings-*.jsonl")
    with open(path, "ab") as fh:  # a line still being written: read once it is whole
        fh.write(b'{"key":"k2","time_s":1e-6,"hbm_bytes":2')
    assert second._from_disk("k2") is None
    with open(path, "ab") as fh:
        fh.write(b',"flops":3,"bound":"hbm","instructions":5,"pieces":1}\n')
    assert second._from_disk("k2") == LaunchTime(1e-6, 2.0, 3.0, "hbm", 5, 1)
    shape = get_kernel("gemm").shape({"m": 8, "n": 64, "k": 64})
    launch = Launch("ffn", "gemm", tuple(sorted(shape.items())))
    built = first.time(launch)
    assert first.builds == 1 and second.time(launch) == built and second.builds == 0


def test_a_prediction_with_builds_side_by_side_equals_the_serial_one(fresh_caches, monkeypatch):
    from jalapeno_emu.rack.deployment import predict
    from jalapeno_emu.rack.launch_timer import launch_executor

    fresh_caches()
    serial = predict(TINY["cfg"], "tiny", TINY["isl"], TINY["osl"], 2, mapping="tp=2").as_dict()
    fresh_caches()
    ran = []
    prefetch = LaunchTimer.prefetch
    monkeypatch.setattr(LaunchTimer, "prefetch", lambda self, las: ran.append(prefetch(self, las)) or ran[-1])
    with ThreadPoolExecutor(2) as pool, launch_executor(pool, start_s=0.0, batch_s=0.0):
        side_by_side = predict(TINY["cfg"], "tiny", TINY["isl"], TINY["osl"], 2, mapping="tp=2").as_dict()
    assert sum(ran) >= 4  # grid points' launches did run on the pool
    assert side_by_side == serial
