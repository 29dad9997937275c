"""InferenceX serving metrics of one simulated point, and how they are summarised.

Stage: serving. :func:`jalapeno_emu.serving.simulate.simulate` produces the per-request times and
the step counters of a measurement window; :func:`summarise` turns them into a frozen
:class:`ServingMetrics` whose :meth:`~ServingMetrics.as_dict` field names are the CLI's JSON fields.

Conventions (InferenceX, docs/rack.md): TPOT per request = (E2E - TTFT) / (output tokens - 1), defined
for requests with at least two output tokens; interactivity = 1 / median TPOT (tok/s/user); p99 is
numpy's linear-interpolation percentile (as InferenceX's benchmark client computes it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from jalapeno_emu.errors import InvalidArgumentError

__all__ = ["POWER_KINDS", "ServingMetrics", "Stats", "power_w_from_spec", "summarise"]

POWER_KINDS: tuple[str, ...] = ("package", "sustained", "all_in")
"""The powers per chip that tok/s per kW is reported under: package TDP, measured-sustained draw,
all-in facility power."""


@dataclass(frozen=True)
class Stats:
    """Mean, median and 99th percentile of one per-request quantity, in seconds (NaN when empty)."""

    mean: float
    median: float
    p99: float

    @classmethod
    def of(cls, values: np.ndarray) -> Stats:
        """Stats of float64[n] ``values`` (all NaN when n == 0)."""
        if values.size == 0:
            return cls(math.nan, math.nan, math.nan)
        return cls(float(np.mean(values)), float(np.median(values)), float(np.percentile(values, 99)))


@dataclass(frozen=True)
class ServingMetrics:
    """The metrics of one serving point (one mapping at one concurrency, ISL/OSL).

    Latencies are over the measured requests; throughput, batch and step counts over the
    measurement window (from the end of warm-up to the completion of the last measured request).
    """

    mapping: str
    concurrency: int
    chips: int
    isl: int
    osl: int
    ttft_s: Stats
    tpot_s: Stats
    e2e_s: Stats
    interactivity_tok_s_user: float
    """1 / median TPOT."""
    throughput_tok_s_per_chip: float
    """Input + output tokens processed in the window / window seconds / chips."""
    tok_s_per_kw: Mapping[str, float | None]
    """Throughput per chip over each power in :data:`POWER_KINDS` (kW); None where not given."""
    measured_requests: int
    warmup_requests: int
    measured_input_tokens: int
    measured_output_tokens: int
    window_tokens: int
    """Tokens processed by the window's steps: prefill tokens plus output tokens, each counted once."""
    window_s: float
    window_steps: int
    total_steps: int
    simulated_s: float
    mean_decode_batch: float
    """Sequences decoding per step, averaged over the window's steps."""
    kv_bound_step_share: float
    """Share of the window's steps where the oldest waiting request could not be admitted because
    its KV reservation did not fit."""
    draft_tokens: int = 0
    """Speculative decoding: draft tokens per sequence and step (0: single-token prediction)."""
    tokens_per_decode_step: float = 1.0
    """Output tokens a decoding sequence emitted per step, averaged over the window (1 without
    speculative decoding; 1 + the mean accepted drafts with it)."""

    def as_dict(self) -> dict[str, Any]:
        """Flat JSON-ready fields: the medians under ``ttft_s``/``tpot_s``/``e2e_s``, mean and p99
        beside them (``ttft_s_mean``, ``ttft_s_p99``...); NaN becomes None."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if key in ("ttft_s", "tpot_s", "e2e_s"):
                out[key] = value["median"]
                out[f"{key}_mean"] = value["mean"]
                out[f"{key}_p99"] = value["p99"]
            elif key == "tok_s_per_kw":
                out[key] = dict(value)
            else:
                out[key] = value
        return _nan_to_none(out)


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    return value


def check_power(power_w: Mapping[str, float] | None) -> dict[str, float] | None:
    """Validate a {"package", "sustained", "all_in"} -> watts per chip mapping (or None)."""
    if power_w is None:
        return None
    if set(power_w) != set(POWER_KINDS):
        raise InvalidArgumentError(
            f"power_w must have exactly the keys {', '.join(POWER_KINDS)} (watts per chip); "
            f"got {', '.join(sorted(power_w)) or 'none'}")
    for kind in POWER_KINDS:
        watts = power_w[kind]
        if not isinstance(watts, int | float) or not math.isfinite(watts) or watts <= 0:
            raise InvalidArgumentError(f"power_w[{kind!r}] must be a positive number of watts; got {watts!r}")
    return {kind: float(power_w[kind]) for kind in POWER_KINDS}


def power_w_from_spec(spec: Any) -> dict[str, float]:
    """The three powers per chip of a :class:`~jalapeno_emu.chip.ChipSpec`'s power block, in W:
    package = ``power.tdp_w``, sustained = ``power.sustained_w``, all_in = ``power.facility_w_per_chip``."""
    power = spec.power
    return {"package": float(power.tdp_w), "sustained": float(power.sustained_w),
            "all_in": float(power.facility_w_per_chip)}


@dataclass(frozen=True)
class RequestTimes:
    """What the simulator recorded for the measured requests (float64/int64 arrays of length n)."""

    arrival_s: np.ndarray
    first_token_s: np.ndarray
    end_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray


@dataclass(frozen=True)
class WindowCounters:
    """Step counters over the measurement window."""

    tokens: int
    seconds: float
    steps: int
    decode_sequence_steps: int
    kv_bound_steps: int
    decode_tokens: int = 0
    """Output tokens the decode sequence-steps emitted (``decode_sequence_steps`` without MTP)."""


def summarise(*, mapping: str, concurrency: int, chips: int, isl: int, osl: int, warmup_requests: int,
              requests: RequestTimes, window: WindowCounters, total_steps: int, simulated_s: float,
              power_w: Mapping[str, float] | None, draft_tokens: int = 0) -> ServingMetrics:
    """Metrics of one point from the measured requests and the window counters."""
    ttft = requests.first_token_s - requests.arrival_s
    e2e = requests.end_s - requests.arrival_s
    multi = requests.output_tokens > 1  # TPOT is undefined for a single output token
    tpot = (e2e[multi] - ttft[multi]) / (requests.output_tokens[multi] - 1)
    tpot_stats = Stats.of(tpot)
    throughput = window.tokens / window.seconds / chips if window.seconds > 0 else math.nan
    per_kw = {kind: (None if power_w is None else throughput / (power_w[kind] / 1000.0))
              for kind in POWER_KINDS}
    return ServingMetrics(
        mapping=mapping, concurrency=concurrency, chips=chips, isl=isl, osl=osl,
        ttft_s=Stats.of(ttft), tpot_s=tpot_stats, e2e_s=Stats.of(e2e),
        interactivity_tok_s_user=1.0 / tpot_stats.median if tpot_stats.median > 0 else math.nan,
        throughput_tok_s_per_chip=throughput, tok_s_per_kw=per_kw,
        measured_requests=int(requests.arrival_s.size), warmup_requests=warmup_requests,
        measured_input_tokens=int(requests.input_tokens.sum()),
        measured_output_tokens=int(requests.output_tokens.sum()),
        window_tokens=window.tokens, window_s=window.seconds, window_steps=window.steps,
        total_steps=total_steps, simulated_s=simulated_s,
        mean_decode_batch=window.decode_sequence_steps / window.steps if window.steps else math.nan,
        kv_bound_step_share=window.kv_bound_steps / window.steps if window.steps else math.nan,
        draft_tokens=draft_tokens,
        tokens_per_decode_step=(window.decode_tokens / window.decode_sequence_steps
                                if window.decode_sequence_steps else math.nan),
    )
