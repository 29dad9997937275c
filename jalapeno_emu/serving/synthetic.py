"""Analytic step-time models: hand-checkable fixtures for the simulator's tests and benchmark.

Stage: serving. The real step-time models come from the emulator's timing pass plus collectives;
these two stand in for them where a closed form is what is wanted:

- :class:`LinearStepModel`: a fixed cost per step plus costs per decoding sequence, per context
  token read by decode attention and per prefill token. TTFT/TPOT follow by hand.
- :class:`RooflineStepModel`: max(FLOPs / FLOP/s, bytes / B/s) plus a fixed overhead, with every
  rate and size passed in by the caller (a benchmark takes them from a chip spec).

Both implement the optional ``decode_stretch_times_s`` with the same floating-point operations, in
the same order, as ``step_time_s``, so the simulator's fast path gives bit-identical times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.serving.step_model import StepWork

__all__ = ["LinearStepModel", "RooflineStepModel"]


def _check_fields(owner: object, positive: tuple[str, ...], non_negative: tuple[str, ...]) -> None:
    for key in positive:
        value = getattr(owner, key)
        if not value > 0:
            raise InvalidArgumentError(f"{type(owner).__name__}.{key} must be > 0; got {value!r}")
    for key in non_negative:
        value = getattr(owner, key)
        if not value >= 0:
            raise InvalidArgumentError(f"{type(owner).__name__}.{key} must be >= 0; got {value!r}")


@dataclass(frozen=True)
class LinearStepModel:
    """step time = fixed_s + decode_s_per_sequence x decodes x query tokens per decode +
    decode_s_per_context_token x (sum of decode contexts) + prefill_s_per_token x prefill tokens,
    in seconds."""

    name: str
    chips: int
    kv_capacity_tokens: int
    max_batch_tokens: int
    fixed_s: float
    decode_s_per_sequence: float = 0.0
    decode_s_per_context_token: float = 0.0
    prefill_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        _check_fields(self, ("chips", "kv_capacity_tokens", "max_batch_tokens", "fixed_s"),
                      ("decode_s_per_sequence", "decode_s_per_context_token", "prefill_s_per_token"))

    def step_time_s(self, work: StepWork) -> float:
        """Seconds for ``work`` (the formula in the class docstring)."""
        return (self.fixed_s + self.decode_s_per_sequence * work.decode_count * work.decode_query_tokens
                + self.decode_s_per_context_token * work.decode_context_tokens
                + self.prefill_s_per_token * work.prefill_tokens)

    def decode_stretch_times_s(self, contexts: np.ndarray, steps: int) -> np.ndarray:
        """float64[steps] times of decode-only steps with contexts ``contexts + j`` at step j."""
        n = contexts.size
        context_tokens = int(contexts.sum()) + n * np.arange(steps, dtype=np.int64)
        return (self.fixed_s + self.decode_s_per_sequence * n
                + self.decode_s_per_context_token * context_tokens.astype(np.float64))


@dataclass(frozen=True)
class RooflineStepModel:
    """A roofline per step: overhead_s + max(FLOPs / flops_per_s, bytes / bytes_per_s).

    FLOPs = flops_per_token x batch tokens + attention_flops_per_pair x (query, key) pairs, where a
    decode with context c has c pairs per query token and a prefill chunk of n new tokens after p
    cached ones has
    n x p + n (n + 1) / 2. Bytes = weight_bytes (read once per step) + kv_bytes_per_token x (decode
    contexts + cached prompt tokens read + new prompt tokens written). All sizes are for the whole
    deployment (``chips`` chips); rates are the deployment's totals.
    """

    name: str
    chips: int
    kv_capacity_tokens: int
    max_batch_tokens: int
    flops_per_s: float
    bytes_per_s: float
    weight_bytes: float
    flops_per_token: float
    kv_bytes_per_token: float
    attention_flops_per_pair: float
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        _check_fields(self, ("chips", "kv_capacity_tokens", "max_batch_tokens", "flops_per_s", "bytes_per_s"),
                      ("weight_bytes", "flops_per_token", "kv_bytes_per_token", "attention_flops_per_pair",
                       "overhead_s"))

    def step_time_s(self, work: StepWork) -> float:
        """Seconds for ``work`` (the roofline in the class docstring)."""
        pairs = work.decode_context_tokens * work.decode_query_tokens
        for new, cached in work.prefill_chunks:
            pairs += new * cached + new * (new + 1) // 2
        kv_tokens = work.decode_context_tokens + work.prefill_cached_tokens + work.prefill_tokens
        return self._time(float(work.batch_tokens), float(pairs), float(kv_tokens))

    def _time(self, tokens: float, pairs: float, kv_tokens: float) -> float:
        flops = self.flops_per_token * tokens + self.attention_flops_per_pair * pairs
        moved = self.weight_bytes + self.kv_bytes_per_token * kv_tokens
        return self.overhead_s + max(flops / self.flops_per_s, moved / self.bytes_per_s)

    def decode_stretch_times_s(self, contexts: np.ndarray, steps: int) -> np.ndarray:
        """float64[steps] times of decode-only steps with contexts ``contexts + j`` at step j."""
        n = contexts.size
        context_tokens = (int(contexts.sum()) + n * np.arange(steps, dtype=np.int64)).astype(np.float64)
        # the operations of _time, in the same order, on arrays
        flops = self.flops_per_token * float(n) + self.attention_flops_per_pair * context_tokens
        moved = self.weight_bytes + self.kv_bytes_per_token * context_tokens
        return self.overhead_s + np.maximum(flops / self.flops_per_s, moved / self.bytes_per_s)
