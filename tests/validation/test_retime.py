"""Re-timing a kept Program on a knob setting equals building and timing afresh on that setting."""

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.model.plan import launch
from jalapeno_emu.rack.launch_timer import LaunchTimer, install_timer, shared_timer
from jalapeno_emu.validation.retime import DEFAULT_GRID, KnobSetting, RetimedTimer, knob_spec, setting_timers

NORM = launch("norm", "rmsnorm", tokens=64, hidden=2048)
GEMM = launch("proj", "gemm", m=64, n=1024, k=1024, weight_fmt="fp4", act_fmt="bf16", bias=False)


@pytest.fixture(scope="module")
def base():
    timer = LaunchTimer(load_preset("b200"), keep_programs=True)
    timer.time(NORM)
    timer.time(GEMM)
    return timer


def test_a_slower_hbm_re_times_the_kept_program_like_a_fresh_build(base):
    setting = KnobSetting(0.6, 1.0, 0.85, 1.0)
    spec = knob_spec(base.spec, setting)
    assert spec.name.startswith("b200~") and spec.hbm.efficiency == 0.6
    retimed = RetimedTimer(spec, base)
    assert not retimed.additive
    fresh = LaunchTimer(spec)
    for la in (NORM, GEMM):
        got, want = retimed.time(la), fresh.time(la)
        assert got.time_s == pytest.approx(want.time_s, rel=1e-12)
        assert got.hbm_bytes == want.hbm_bytes and got.instructions == want.instructions
        assert got.time_s > base.time(la).time_s  # slower memory, slower kernel
    assert base.builds == 2  # the Programs were built once, by the base timer


def test_launch_and_link_knobs_add_the_launch_difference_exactly(base):
    setting = KnobSetting(0.9, 2.0, 0.6, 3.0)
    spec = knob_spec(base.spec, setting)
    assert spec.sync.kernel_launch_s == 2 * base.spec.sync.kernel_launch_s
    assert spec.link.message_setup_s == 3 * base.spec.link.message_setup_s
    retimed = RetimedTimer(spec, base)
    assert retimed.additive
    fresh = LaunchTimer(spec)
    for la in (NORM, GEMM):
        assert retimed.time(la).time_s == pytest.approx(fresh.time(la).time_s, rel=1e-12)
    assert retimed.builds == 0


def test_the_grid_holds_every_gpu_preset_own_values():
    for name in ("b200", "h100", "h200", "mi300x", "mi325x", "mi355x"):
        spec = load_preset(name)
        assert sum(knob_spec(spec, s) is spec for s in DEFAULT_GRID) == 1, name


def test_a_structural_change_is_refused(base):
    other = base.spec.replace(name="b200-small", **{"core.count": 64})
    with pytest.raises(InvalidArgumentError, match=r"core\.count"):
        RetimedTimer(other, base)


def test_an_installed_timer_is_the_shared_one(base):
    spec = knob_spec(base.spec, KnobSetting(0.75, 1.0, 0.85, 1.0))
    timer = RetimedTimer(spec, base)
    install_timer(timer)
    assert shared_timer(spec) is timer


def test_setting_timers_build_each_program_once_for_every_setting():
    preset = load_preset("b200")
    grid = [KnobSetting(h, ls, 0.85, 1.0) for h in (0.6, 0.9) for ls in (1.0, 2.0)]
    base, timers = setting_timers(preset, grid)
    assert timers[KnobSetting(0.9, 1.0, 0.85, 1.0)] is base
    assert len(base.followers) == 1  # one follower per distinct hbm value other than the preset's
    for la in (NORM, GEMM):
        base.time(la)
    assert base.builds == 2
    for setting, timer in timers.items():
        fresh = LaunchTimer(knob_spec(preset, setting))
        for la in (NORM, GEMM):
            assert timer.time(la).time_s == pytest.approx(fresh.time(la).time_s, rel=1e-12), setting.label
    # The followers adopted the base's builds: nothing was built again.
    assert base.builds == 2 and base.followers[0].builds == 0
    assert all(t.builds == 0 for t in timers.values() if t is not base)
