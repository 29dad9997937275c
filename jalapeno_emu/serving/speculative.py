"""Speculative decoding with multi-token prediction (MTP): how many draft tokens a step verifies and
how many of them are accepted.

Stage: serving. Under MTP a decode step does two things for every decoding sequence: a draft
module proposes ``K`` tokens one after the other (DeepSeek-V3's MTP module, or an EAGLE-style
draft layer), then the model verifies them in one pass over ``K + 1`` query tokens (the last
accepted token and the drafts). Draft ``j`` is kept when it and every draft before it are
accepted; the verification also yields one token of its own, so a step emits ``1 + a`` tokens,
``a`` the accepted drafts (0..K).

The acceptance model: ``acceptance[j - 1]`` is the probability that draft ``j`` is accepted given
that drafts 1..j-1 were, drawn per sequence and step from a seeded generator
(:meth:`Speculation.draw`). The expected tokens per step are
``1 + p1 + p1 p2 + ... + p1...pK`` (:attr:`Speculation.expected_tokens_per_step`).

Default acceptance (:data:`DEFAULT_ACCEPTANCE`):

- ``public``: 0.85 for the first draft token. DeepSeek-V3 Technical Report (arXiv:2412.19437,
  section 5.4.3): "the acceptance rate of the second token prediction ranges between 85% and 90%"
  across generation topics; the low end is taken.
- ``assumed``: the same conditional rate for drafts 2..K. Nothing public gives DeepSeek's MTP
  acceptance beyond the second token; a constant conditional rate is the usual first model, and
  it is a knob (``--mtp-acceptance``) for anyone with measured rates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jalapeno_emu.errors import InvalidArgumentError

__all__ = ["DEFAULT_ACCEPTANCE", "MAX_DRAFT_TOKENS", "Speculation", "parse_acceptance", "speculation"]

DEFAULT_ACCEPTANCE = 0.85
"""Conditional acceptance of each draft token by default (see the module docstring's sources)."""
MAX_DRAFT_TOKENS = 8
"""Draft tokens per step at most: deployed MTP and EAGLE configurations draft 1-5 tokens, and every
draft is one more sequential pass of the draft module per step."""


@dataclass(frozen=True)
class Speculation:
    """Draft tokens per step and their acceptance.

    Attributes:
        draft_tokens: K, draft tokens proposed per sequence and step (>= 1).
        acceptance: K conditional acceptance probabilities in [0, 1], one per draft position.
    """

    draft_tokens: int
    acceptance: tuple[float, ...]

    @property
    def query_tokens(self) -> int:
        """Tokens a decoding sequence verifies per step: K + 1."""
        return self.draft_tokens + 1

    @property
    def expected_tokens_per_step(self) -> float:
        """Expected output tokens per sequence and step: 1 + sum over j of p1...pj."""
        return 1.0 + float(sum(math.prod(self.acceptance[:j]) for j in range(1, self.draft_tokens + 1)))

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """int64[n]: accepted drafts (0..K) of ``n`` sequences in one step, position by position."""
        u = rng.random((n, self.draft_tokens))
        ok = u < np.asarray(self.acceptance)
        # the accepted prefix: drafts up to the first rejection
        return np.where(ok.all(axis=1), self.draft_tokens, np.argmin(ok, axis=1)).astype(np.int64)

    def as_dict(self) -> dict[str, object]:
        """JSON fields: ``draft_tokens``, ``acceptance`` and ``expected_tokens_per_step``."""
        return {"draft_tokens": self.draft_tokens, "acceptance": list(self.acceptance),
                "expected_tokens_per_step": self.expected_tokens_per_step}


def _probability(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise InvalidArgumentError(f"{what} {value!r} must be a probability in [0, 1]")
    return float(value)


def speculation(draft_tokens: int, acceptance: float | Sequence[float] | None = None) -> Speculation | None:
    """A checked :class:`Speculation`, or None for ``draft_tokens`` 0 (single-token prediction).

    Args:
        draft_tokens: K, 0 to :data:`MAX_DRAFT_TOKENS`.
        acceptance: one conditional probability for every position, or one per position (K of
            them); None: :data:`DEFAULT_ACCEPTANCE` at every position.

    Raises:
        InvalidArgumentError: K out of range, a probability outside [0, 1], or a list whose
            length is not K.
    """
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not \
            0 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise InvalidArgumentError(f"mtp={draft_tokens!r}: draft tokens per step must be an integer from 0 "
                                   f"to {MAX_DRAFT_TOKENS}")
    if draft_tokens == 0:
        if acceptance is not None:
            raise InvalidArgumentError("an MTP acceptance was given without draft tokens (mtp=0)")
        return None
    if acceptance is None:
        acceptance = DEFAULT_ACCEPTANCE
    if isinstance(acceptance, (int, float)) and not isinstance(acceptance, bool):
        probs = (_probability(acceptance, "mtp acceptance"),) * draft_tokens
    else:
        probs = tuple(_probability(p, "mtp acceptance") for p in acceptance)  # type: ignore[union-attr]
        if len(probs) != draft_tokens:
            raise InvalidArgumentError(f"{len(probs)} mtp acceptance values for {draft_tokens} draft tokens: "
                                       "give one value for every position, or one per position")
    return Speculation(draft_tokens, probs)


def parse_acceptance(text: str) -> float | tuple[float, ...]:
    """``"0.85"`` -> 0.85; ``"0.9,0.8"`` -> (0.9, 0.8) (one per draft position).

    Raises:
        InvalidArgumentError: not numbers.
    """
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise InvalidArgumentError(f"mtp acceptance {text!r} must be a probability or comma-separated "
                                   "probabilities, e.g. 0.85 or 0.9,0.8") from None
    if not values:
        raise InvalidArgumentError("mtp acceptance is empty")
    return values[0] if len(values) == 1 else values
