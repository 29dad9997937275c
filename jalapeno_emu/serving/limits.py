"""The bounds of the serving arguments: what one simulated point, sweep or comparison may ask for.

Stage: serving (used by the simulator, the rack step model and the rack entry points, so Python
callers get the same refusals as the CLI). Each bound is checked where the argument enters the
library, before any kernel is built or step simulated, and a refusal names the argument, the
limit and why. The limits are sized so that the largest point still runs in minutes on a 2-core
host (measured: about 0.6 ms of simulation per request at ISL 8192 on one core, with the kernel
timings cached); the bounds that depend on the model or the deployment (``max_position_embeddings``,
the KV capacity) are checked by :mod:`jalapeno_emu.rack.deployment` and the simulator.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from jalapeno_emu.chip._units import short_repr
from jalapeno_emu.errors import InvalidArgumentError

__all__ = ["MAX_BATCH_TOKENS", "MAX_CONCURRENCIES", "MAX_CONCURRENCY", "MAX_REQUESTS", "MAX_SEQUENCE_TOKENS",
           "ArgLimit", "distinct_concurrencies"]


@dataclass(frozen=True)
class ArgLimit:
    """The largest value a serving argument may take, with the reason for the bound.

    Attributes:
        maximum: the largest value allowed.
        why: one line: why nothing larger makes sense here.
    """

    maximum: int
    why: str

    def check(self, name: str, value: object, minimum: int = 1) -> int:
        """``value`` as an int, or InvalidArgumentError naming ``name``, the bound and its reason.

        Raises:
            InvalidArgumentError: not an integer (bools refused), below ``minimum`` or above the limit.
        """
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
            raise InvalidArgumentError(f"{name} must be an integer >= {minimum}; got {short_repr(value)}")
        if value > self.maximum:
            raise InvalidArgumentError(
                f"{name}={short_repr(value)} is above its limit of {self.maximum:,} ({self.why})")
        return int(value)


MAX_REQUESTS = ArgLimit(65_536, "32x the default cap of 2,048 measured requests; at ~0.6 ms of simulation "
                                "per request on one core that is under a minute per point")
"""Measured requests (``requests``) and warm-up completions (``warmup_requests``) of one point."""

MAX_CONCURRENCY = ArgLimit(65_536, "64x the largest default sweep concurrency (1,024): every request in "
                                   "flight is simulated, and as many complete in the warm-up")
"""Requests in flight of one point."""

MAX_CONCURRENCIES = ArgLimit(64, "distinct concurrencies of one sweep or comparison: each is simulated on "
                                 "several mappings or presets; the default sweep has 11")
"""Distinct concurrencies of one sweep or comparison (duplicates are dropped first)."""

MAX_SEQUENCE_TOKENS = ArgLimit(2**22, "the kernels' context limit (16x the longest max_position_embeddings "
                                      "of the models shipped): every prefill chunk of a request is a "
                                      "simulated step")
"""ISL + OSL of one request (a model's own ``max_position_embeddings`` is usually lower)."""

MAX_BATCH_TOKENS = ArgLimit(65_536, "8x the default step budget (8,192): a step's tokens are the rows its "
                                    "kernels are built and timed at, and a full-size GEMM of 65,536 rows is "
                                    "already millions of instructions")
"""Token budget of one DP group's step (``max_batch_tokens``)."""


def distinct_concurrencies(values: Iterable[object], name: str = "concurrencies") -> tuple[int, ...]:
    """``values`` checked (integers in 1..:data:`MAX_CONCURRENCY`) with duplicates dropped, in the
    order first seen: a concurrency given twice is the same point, simulated once.

    Raises:
        InvalidArgumentError: none given, a bad value, or more distinct values than
            :data:`MAX_CONCURRENCIES`.
    """
    seen: dict[int, None] = {}
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise InvalidArgumentError(f"{name} must be integers >= 1; got {short_repr(v)}")
        seen[MAX_CONCURRENCY.check("concurrency", v)] = None
    if not seen:
        raise InvalidArgumentError(f"at least one concurrency is needed ({name} is empty)")
    if len(seen) > MAX_CONCURRENCIES.maximum:
        raise InvalidArgumentError(
            f"{name}: {len(seen):,} distinct values is above the limit of {MAX_CONCURRENCIES.maximum:,} "
            f"({MAX_CONCURRENCIES.why})")
    return tuple(seen)
