"""The limits of the chip spec's numeric fields: the largest value (and for rates the smallest)
each may take, with the reason for the bound.

Stage: chip spec. ``spec.py`` checks every numeric leaf against :data:`FIELD_LIMITS` when a spec
is built, so no value passes validation that a cost model cannot price, a host cannot emulate or
JSON cannot print.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from jalapeno_emu.chip._units import short_repr
from jalapeno_emu.errors import ConfigError

__all__ = ["FIELD_LIMITS", "Limit"]


@dataclass(frozen=True)
class Limit:
    """The range a numeric field must stay in beyond its check, with the reason for the bound.

    Attributes:
        maximum: the largest value allowed.
        why: one line: why nothing larger makes sense here.
        minimum: the smallest value allowed, for fields that times or totals divide by (a rate, an
            efficiency): a positive float as small as 1e-300 would make them overflow to infinity.
    """

    maximum: int | float
    why: str
    minimum: int | float | None = None

    def check(self, path: str, value: int | float, unit: str) -> None:
        """Raise ConfigError naming ``path``, the bound and its reason if ``value`` is outside."""
        if value > self.maximum:
            raise ConfigError(f"{path} must be <= {_number(self.maximum, unit)} ({self.why}), "
                              f"found {short_repr(value)}")
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(f"{path} must be >= {_number(self.minimum, unit)} (times and totals divide "
                              f"by it), found {short_repr(value)}")


def _number(value: int | float, unit: str) -> str:
    text = f"{value:,}" if isinstance(value, int) else f"{value:g}"
    return f"{text} {unit}" if unit else text


# The limits of every numeric field (the fraction and enum checks bound the rest). Each is far
# above every preset and every real part, and small enough that a 2-core host builds, checks and
# times a kernel in bounded time and memory, that addresses stay inside the binary format's 64-bit
# fields, and that every derived total and every time stays a finite float (JSON has no Infinity).
_CYCLES = Limit(10**6, "a million cycles, ~0.6 ms at 1.6 GHz: 500x the slowest issue, pipeline or sync "
                "cost of any preset")
_LATENCY = Limit(1e-3, "a millisecond: 500x the slowest hardware or launch latency of any preset")
_BYTES = Limit(2**50, "1 PiB: more than any package holds; keeps addresses well inside 64 bits")
_TILE = Limit(4096, "a tile step's operands live in one scratchpad; 16x the largest systolic array")
_MACS = Limit(2**24, "a 4096 x 4096 array per core: 256x the largest preset's rate")
_LANES = Limit(2**16, "65,536 elements per cycle: 128x the widest preset's vector unit")
_PORTS = Limit(1024, "more than any switch radix (NVLink 5 has 18 ports per GPU)")
_POWER = Limit(1e5, "100 kW: 4x a whole wafer-scale system", minimum=1.0)
_FRACTION = Limit(1.0, "a fraction of peak", minimum=1e-3)


def _rate(maximum: float, why: str) -> Limit:
    return Limit(maximum, why, minimum=1.0)


FIELD_LIMITS: Mapping[str, Limit] = MappingProxyType({
    "core.count": Limit(4096, "each core is an instruction stream the emulator builds and schedules; "
                              "13x the largest preset (304)"),
    "core.clock_hz": _rate(100e9, "100 GHz: no clocked logic runs this fast"),
    "matrix.tile_m": _TILE,
    "matrix.tile_n": _TILE,
    "matrix.tile_k": _TILE,
    "matrix.mxfp4_macs_per_cycle": _MACS,
    "matrix.mxfp8_macs_per_cycle": _MACS,
    "matrix.bf16_macs_per_cycle": _MACS,
    "matrix.pipeline_depth_cycles": _CYCLES,
    "matrix.issue_overhead_cycles": _CYCLES,
    "vector.lanes": _LANES,
    "vector.transcendental_elements_per_cycle": _LANES,
    "vector.issue_overhead_cycles": _CYCLES,
    "sram.scratchpad_bytes": _BYTES,
    "sram.accumulator_bytes": _BYTES,
    "sram.bytes_per_cycle": Limit(2**20, "a 1 MiB-wide port: 2048x the widest preset"),
    "dma.queues_per_core": Limit(256, "each queue is an engine stream the emulator schedules; 64x the "
                                      "presets"),
    "dma.bytes_per_s_per_core": _rate(1e15, "1 PB/s: 2000x the fastest core's DMA in any preset"),
    "dma.setup_latency_s": _LATENCY,
    "dma.max_outstanding_per_queue": Limit(4096, "descriptors the timing pass tracks in flight; 256x "
                                                 "the presets"),
    "hbm.stacks": Limit(64, "the largest packages carry 8 to 12 stacks"),
    "hbm.channels_per_stack": Limit(128, "HBM4 has 32 channels per stack; the timing pass keeps an array "
                                         "per pseudo-channel"),
    "hbm.pseudo_channels_per_channel": Limit(8, "HBM has 2 per channel"),
    "hbm.interleave_bytes": Limit(2**30, "a 1 GiB granule would not interleave at all"),
    "hbm.bytes_per_s_per_pseudo_channel": _rate(1e13, "10 TB/s per pseudo-channel: 250x HBM4"),
    "hbm.efficiency": _FRACTION,
    "hbm.latency_s": _LATENCY,
    "hbm.capacity_bytes_per_stack": _BYTES,
    "link.ports": _PORTS,
    "link.bytes_per_s_per_direction": _rate(1e14, "100 TB/s per port: 1000x NVLink 5"),
    "link.latency_s": _LATENCY,
    "link.switch_latency_s": _LATENCY,
    "link.domain_chips": Limit(4096, "7x the largest announced scale-up domain (576 GPUs)"),
    "link.switch_hops": Limit(16, "a 16-stage network is no scale-up fabric"),
    "link.stripe_ports": _PORTS,
    "link.message_setup_s": _LATENCY,
    "link.efficiency": _FRACTION,
    "sync.semaphore_latency_cycles": _CYCLES,
    "sync.barrier_latency_cycles": _CYCLES,
    "sync.kernel_launch_s": _LATENCY,
    "power.tdp_w": _POWER,
    "power.sustained_w": _POWER,
    "power.facility_w_per_chip": _POWER,
})
"""Dotted field path -> its :class:`Limit`; every int and float field has one (checked at import)."""
