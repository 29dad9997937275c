"""The contract between a deployment's step-time model and the serving simulator.

Stage: serving, the last stage before the CLI. The simulator (:mod:`jalapeno_emu.serving.simulate`)
decides what every engine step of a continuously batched server does and asks a
:class:`StepTimeModel` how long that step takes. The model is written elsewhere (the emulator's
timing pass plus collectives for a mapping of one model onto one or many chips); the simulator only
needs this protocol. :mod:`jalapeno_emu.serving.synthetic` holds small analytic models for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["StepTimeModel", "StepWork", "SupportsDecodeStretch"]


@dataclass(frozen=True)
class StepWork:
    """The work of one engine step: decode tokens plus chunked prefill, mixed in one batch.

    Args:
        decode_contexts: one entry per sequence decoding one token this step: the tokens in its KV
            cache after the step (its prompt, the tokens it generated before, and the new one).
        prefill_chunks: one ``(new_tokens, cached_tokens)`` pair per prompt prefilled this step:
            prompt tokens processed now, and prompt tokens of the same request already in the cache.
        decode_query_tokens: tokens each decoding sequence runs through the model this step: 1, or
            1 + K under speculative decoding (:mod:`jalapeno_emu.serving.speculative`), where the
            step also drafts the K tokens it verifies (the model prices both).

    The summaries below are computed once at construction so that a model can price a step from
    four integers (decode count, sum of contexts, prefill tokens, prior tokens) without walking
    the tuples; attention-heavy models may still read ``prefill_chunks`` (a handful per step).
    """

    decode_contexts: tuple[int, ...] = ()
    prefill_chunks: tuple[tuple[int, int], ...] = ()
    decode_query_tokens: int = 1
    decode_count: int = field(init=False)
    """Sequences decoding this step."""
    decode_context_tokens: int = field(init=False)
    """Sum of ``decode_contexts``: KV-cache tokens the decode attention reads."""
    prefill_tokens: int = field(init=False)
    """Sum of new prompt tokens over ``prefill_chunks``."""
    prefill_cached_tokens: int = field(init=False)
    """Sum of already cached prompt tokens over ``prefill_chunks``."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: summaries are set once, here
        set_(self, "decode_count", len(self.decode_contexts))
        set_(self, "decode_context_tokens", sum(self.decode_contexts))
        set_(self, "prefill_tokens", sum(new for new, _ in self.prefill_chunks))
        set_(self, "prefill_cached_tokens", sum(cached for _, cached in self.prefill_chunks))

    @property
    def batch_tokens(self) -> int:
        """Tokens this step processes: ``decode_query_tokens`` per decoding sequence plus the
        prefill tokens."""
        return self.decode_count * self.decode_query_tokens + self.prefill_tokens


@runtime_checkable
class StepTimeModel(Protocol):
    """How long one engine step of a deployment takes.

    Attributes:
        name: the mapping's name (shown in sweep tables and plots).
        chips: chips in the deployment; throughput is reported per chip.
        kv_capacity_tokens: KV-cache tokens the whole deployment can hold.
        max_batch_tokens: the token budget of one step (decode tokens + prefill tokens).
    """

    name: str
    chips: int
    kv_capacity_tokens: int
    max_batch_tokens: int

    def step_time_s(self, work: StepWork) -> float:
        """Seconds the deployment takes for ``work`` (finite and > 0)."""
        ...


@runtime_checkable
class SupportsDecodeStretch(Protocol):
    """Optional, for speed: the times of a run of decode-only steps in one vectorised call.

    When no prefill can be scheduled, the simulator knows the next steps exactly until the next
    request completes: every sequence decodes one token per step and its context grows by one.
    A model that implements this method prices that whole stretch at once; its answer must equal
    ``step_time_s`` called step by step (tests check this for the shipped models).
    """

    def decode_stretch_times_s(self, contexts: np.ndarray, steps: int) -> np.ndarray:
        """Step times of ``steps`` decode-only steps.

        Args:
            contexts: int64[n] the decode contexts of the first step (as in ``StepWork``);
                step ``j`` (0-based) decodes the same sequences with contexts ``contexts + j``.
            steps: how many steps (>= 1).

        Returns:
            float64[steps] seconds per step.
        """
        ...
