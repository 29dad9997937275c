"""LaunchTimer: each launch timed once, refused batches split, the disk cache, errors on GPU presets."""

import pytest

from jalapeno_emu.chip import apply_overrides, load_preset
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.kernels.base import KernelDef
from jalapeno_emu.kernels.registry import get_kernel, register
from jalapeno_emu.model.plan import launch
from jalapeno_emu.rack import launch_timer
from jalapeno_emu.rack.launch_timer import LaunchTimer, launch_executor

_CAP = 64


def _capped_build(shape, spec):
    if shape["tokens"] > _CAP:
        raise InvalidArgumentError(
            f"shape key tokens={shape['tokens']}: more than {_CAP} rows (split the batch)"
        )
    return get_kernel("rmsnorm").build(shape, spec)


_CAPPED = register(
    KernelDef(
        "test-capped-rmsnorm",
        "rmsnorm refusing more than 64 rows (tests)",
        get_kernel("rmsnorm").shape_keys,
        _capped_build,
    )
)


def test_each_launch_is_built_once():
    timer = LaunchTimer("jalapeno-v1")
    la = launch("attn_norm", "rmsnorm", tokens=8, hidden=256)
    first = timer.time(la)
    assert timer.builds == 1 and timer.time(la) == first and timer.builds == 1
    assert first.time_s > 0 and first.hbm_bytes > 0 and first.pieces == 1


def test_a_refused_batch_runs_as_halves_back_to_back(monkeypatch):
    monkeypatch.setitem(launch_timer.BATCH_KEYS, _CAPPED.name, "tokens")
    timer = LaunchTimer("jalapeno-v1")
    whole = timer.time(launch("x", _CAPPED.name, tokens=256, hidden=256))
    piece = timer.time(launch("x", _CAPPED.name, tokens=64, hidden=256))
    assert whole.pieces == 4 and whole.time_s == pytest.approx(4 * piece.time_s, rel=1e-12)
    with pytest.raises(InvalidArgumentError, match="tokens=256: more than 64 rows"):
        LaunchTimer("jalapeno-v1").time(launch("x", _CAPPED.name, tokens=256, hidden=256), split=False)


def test_disk_cache_is_read_back_by_another_timer(tmp_path):
    la = launch("attn_norm", "rmsnorm", tokens=16, hidden=128)
    a = LaunchTimer("jalapeno-v1", disk_cache=tmp_path)
    t = a.time(la)
    files = list(tmp_path.glob("timings-*.jsonl"))
    assert a.builds == 1 and len(files) == 1
    b = LaunchTimer("jalapeno-v1", disk_cache=tmp_path)
    assert b.time(la) == t and b.builds == 0
    files[0].write_text(files[0].read_text() + '{"key": "torn')  # an interrupted writer's last line
    assert LaunchTimer("jalapeno-v1", disk_cache=tmp_path).time(la) == t


def test_a_kernel_that_cannot_run_on_a_gpu_preset_says_which_and_why():
    la = launch(
        "attention", "attention-prefill", batch=1, seq=64, prior=0, q_heads=64, kv_heads=8, head_dim=64
    )
    # 16 KiB: not even one 32-token tile of one head fits (228 KiB builds since the lean path).
    cramped = apply_overrides(load_preset("gb300-nvl72"), ["sram.scratchpad_bytes=16KiB"])
    with pytest.raises(
        InvalidArgumentError, match=r"kernel attention-prefill cannot run on gb300-nvl72: .*scratchpad"
    ):
        LaunchTimer(cramped).time(la)


def test_the_moe_grouping_is_the_kernels_and_is_remembered_on_disk(monkeypatch, tmp_path):
    """A warm sweep reads the MoE kernel's choice of program from the cache instead of running
    its planners again; a timer without a disk cache asks the kernel."""
    from jalapeno_emu.kernels import moe

    slots = launch("moe", "moe", tokens=8, hidden=256, intermediate=256, experts=8, top_k=2,
                   shared_experts=0, activation="silu", distinct_experts=8)
    gather = launch("moe", "moe", tokens=512, hidden=256, intermediate=256, experts=8, top_k=2,
                    shared_experts=0, activation="silu", distinct_experts=8)
    spec = load_preset("tiny")
    expected = [moe.grouping_of(la.shape_dict, spec) for la in (slots, gather)]
    assert expected == ["dense", "gather"]
    first = LaunchTimer(spec, disk_cache=tmp_path)
    assert [first.moe_grouping(la) for la in (slots, gather)] == expected

    def refuse(*_args):
        raise AssertionError("the kernel's planners ran again")

    monkeypatch.setattr(moe, "grouping_of", refuse)
    second = LaunchTimer(spec, disk_cache=tmp_path)
    assert [second.moe_grouping(la) for la in (slots, gather)] == expected
    with pytest.raises(AssertionError, match="planners ran again"):
        LaunchTimer(spec).moe_grouping(slots)


def test_prefetch_times_new_launches_on_the_executor_with_the_figures_time_gives(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setitem(launch_timer.BATCH_KEYS, _CAPPED.name, "tokens")
    las = [launch("attn_norm", "rmsnorm", tokens=t, hidden=256) for t in (8, 16, 32)]
    refused = launch("x", _CAPPED.name, tokens=128, hidden=256)
    serial = LaunchTimer("jalapeno-v1")
    expected = [serial.time(la) for la in [*las, refused]]
    timer = LaunchTimer("jalapeno-v1")
    assert timer.prefetch(las) == 0 and timer.builds == 0  # no executor: nothing runs
    timer.time(launch("attn_norm", "rmsnorm", tokens=4, hidden=256))  # one build to go by
    with ThreadPoolExecutor(2) as pool:
        with launch_executor(pool, start_s=1e9):  # not worth starting the pool: nothing runs
            assert timer.prefetch(las) == 0 and timer.builds == 1
        with launch_executor(pool, start_s=0.0, batch_s=0.0):
            assert timer.prefetch([*las, las[0], refused]) == 4  # started, each once
            assert timer.prefetch(las) == 0  # already running
    # read when asked for; the refused batch is left to time(), which splits it as before
    assert [timer.time(la) for la in [*las, refused]] == expected
    assert timer.builds == 5  # 1 + 3 prefetched + the refused batch's halves (one shape, built once)


def test_a_prefetched_build_that_fails_there_is_measured_here():
    from concurrent.futures import Executor, Future

    class Broken(Executor):  # a pool whose processes die (BrokenProcessPool, out of memory)
        def submit(self, fn, /, *args, **kwargs):
            f = Future()
            f.set_exception(RuntimeError("worker died"))
            return f

    las = [launch("attn_norm", "rmsnorm", tokens=t, hidden=128) for t in (8, 16)]
    expected = [LaunchTimer("jalapeno-v1").time(la) for la in las]
    timer = LaunchTimer("jalapeno-v1")
    with launch_executor(Broken(), start_s=0.0, batch_s=0.0):
        timer.time(launch("attn_norm", "rmsnorm", tokens=4, hidden=128))
        assert timer.prefetch(las) == 2
    assert [timer.time(la) for la in las] == expected and timer.builds == 3
