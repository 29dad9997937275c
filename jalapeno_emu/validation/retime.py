"""Knob settings of a GPU preset and the timers that price them without rebuilding kernels.

Stage: validation. A :class:`KnobSetting` changes only timing fields (:data:`KNOBS`) of a preset:
the efficiency knobs absolutely (``hbm.efficiency``, ``link.efficiency``), the fixed costs as a
multiple of the preset's own value (``sync.kernel_launch_s``, ``link.message_setup_s``), so one
setting means the same for every preset of a family.

A kernel's Program is built from the structural fields (cores, tiles, scratchpad, ...), so a
setting is priced by re-timing, not rebuilding (:func:`setting_timers`):

- ``hbm.efficiency`` changes the timing pass: one timer per distinct value follows the preset's
  timer (``LaunchTimer.followers``), so every Program the preset's timer builds is also timed at
  that value as it is built, then dropped. Kernels choose some plans from hbm.efficiency as a cost
  estimate (gemm's decode relay, the MoE slice width); the re-timed Program keeps the plan chosen
  at the preset's own value, which is what a fixed software stack does when the memory turns out
  slower. A launch the preset's timer never built is built by the follower itself.
- ``link.*`` enters no registered kernel (the rack prices collectives analytically from the spec)
  and ``sync.kernel_launch_s`` is added once per launch to its time, so a setting that changes only
  these takes its hbm value's figures plus the launch-cost difference per launch piece (exact,
  :class:`RetimedTimer`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.model.plan import Launch
from jalapeno_emu.model.timing import gc_paused
from jalapeno_emu.rack.launch_timer import LaunchTime, LaunchTimer

__all__ = ["DEFAULT_GRID", "KNOBS", "KnobSetting", "RetimedTimer", "knob_spec", "setting_timers"]

KNOBS = ("hbm.efficiency", "sync.kernel_launch_s", "link.efficiency", "link.message_setup_s")
"""The calibrated fields: timing only, each marked ``calibration knob`` in the GPU presets."""

_ADDITIVE = {"sync.kernel_launch_s", "link.efficiency", "link.message_setup_s"}


@dataclass(frozen=True)
class KnobSetting:
    """One point of the calibration grid.

    Attributes:
        hbm_efficiency: hbm.efficiency (absolute).
        launch_scale: sync.kernel_launch_s as a multiple of the preset's.
        link_efficiency: link.efficiency (absolute).
        setup_scale: link.message_setup_s as a multiple of the preset's.
    """

    hbm_efficiency: float
    launch_scale: float
    link_efficiency: float
    setup_scale: float

    def values(self, preset: ChipSpec) -> dict[str, float]:
        """Dotted field -> value on ``preset``."""
        return {
            "hbm.efficiency": self.hbm_efficiency,
            "sync.kernel_launch_s": self.launch_scale * preset.sync.kernel_launch_s,
            "link.efficiency": self.link_efficiency,
            "link.message_setup_s": self.setup_scale * preset.link.message_setup_s,
        }

    @property
    def label(self) -> str:
        """Short text, e.g. ``hbm=0.75,launch=x2,link=0.85,setup=x1``."""
        return (f"hbm={self.hbm_efficiency:g},launch=x{self.launch_scale:g},link={self.link_efficiency:g},"
                f"setup=x{self.setup_scale:g}")

    def as_dict(self) -> dict[str, float]:
        """JSON form."""
        return dataclasses.asdict(self)


DEFAULT_GRID: tuple[KnobSetting, ...] = tuple(
    KnobSetting(h, ls, le, ss)
    for h, ls, le, ss in itertools.product((0.6, 0.75, 0.9), (0.5, 1.0, 2.0), (0.6, 0.85), (1.0, 3.0))
)
"""36 settings; (0.9, x1, 0.85, x1) is every GPU preset's own values."""


def knob_spec(preset: ChipSpec, setting: KnobSetting) -> ChipSpec:
    """``preset`` with ``setting``'s knob values: the preset itself when they are its own, else a
    copy named ``<preset>~<label>`` (so its disk-cached timings never mix with a fresh build's)."""
    values = setting.values(preset)
    if all(preset.get(k) == v for k, v in values.items()):
        return preset
    return preset.replace(name=f"{preset.name}~{setting.label}", **values)


class RetimedTimer(LaunchTimer):
    """A timer of ``spec`` (a knob setting of ``base.spec``) that prices launches from ``base``:
    its figures plus the launch-cost difference when only additive fields changed, else by
    re-timing the base timer's kept Program (see the module docstring).

    Raises:
        InvalidArgumentError: ``spec`` differs from ``base.spec`` in a field that is not a knob.
    """

    def __init__(self, spec: ChipSpec, base: LaunchTimer, *, disk_cache: bool = False) -> None:
        changed = {path for path, v in spec.leaves() if base.spec.get(path) != v}
        if not changed <= set(KNOBS):
            extra = ", ".join(sorted(changed - set(KNOBS)))
            raise InvalidArgumentError(f"{spec.name} differs from {base.spec.name} in fields {extra}")
        super().__init__(spec, disk_cache=disk_cache)
        self.base = base
        self.additive = changed <= _ADDITIVE
        self._launch_delta_s = spec.sync.kernel_launch_s - base.spec.sync.kernel_launch_s

    def _measure(self, launch: Launch, split: bool) -> LaunchTime:
        if not self.additive:
            return super()._measure(launch, split)
        t = self.base.time(launch, split=split)
        out = dataclasses.replace(t, time_s=t.time_s + t.pieces * self._launch_delta_s)
        self._remember(launch, out)
        return out

    def _timed_summary(self, launch: Launch, shape: dict[str, Any]) -> dict[str, Any]:
        prog = self.base.program(launch)
        with gc_paused():
            return run_timing(prog, self.spec).summary()


def setting_timers(
    preset: ChipSpec, grid: tuple[KnobSetting, ...] | list[KnobSetting], *, disk_cache: bool = False
) -> tuple[LaunchTimer, dict[KnobSetting, LaunchTimer]]:
    """The preset's timer and one timer per setting of ``grid``, wired so that a Program is built
    once for all of them (see the module docstring).

    Returns:
        (the preset's own timer, setting -> the timer that prices it); settings equal to the
        preset's values map to the preset's timer.
    """
    base = LaunchTimer(preset, disk_cache=disk_cache)
    by_hbm: dict[float, LaunchTimer] = {preset.hbm.efficiency: base}
    out: dict[KnobSetting, LaunchTimer] = {}
    for setting in grid:
        spec = knob_spec(preset, setting)
        if spec is preset:
            out[setting] = base
            continue
        h = setting.hbm_efficiency
        lead = by_hbm.get(h)
        if lead is None:
            hbm_spec = preset.replace(name=f"{preset.name}~hbm={h:g}", **{"hbm.efficiency": h})
            lead = by_hbm[h] = LaunchTimer(hbm_spec, disk_cache=disk_cache)
            base.followers.append(lead)
        # Exact sums of the lead's figures: not worth a cache file per setting.
        out[setting] = RetimedTimer(spec, lead)
    return base, out
