"""Which experts a batch's tokens pick, in expectation: per expert group, tokens received and
distinct experts hit.

Stage: rack. The MoE kernel's time on a chip depends on how many tokens reach the chip and how
many distinct experts they hit there (each hit expert's weights are read once); the dispatch and
combine all-to-alls depend on how many tokens each chip sends where. This module gives those
expectations for a routing distribution:

- ``uniform``: every token picks ``top_k`` distinct experts of ``E`` uniformly at random (the
  assumption the ``moe`` kernel's ``routing=uniform`` slot count makes). A given expert is picked
  by a token with probability ``k / E``.
- ``zipf:s``: expert popularity follows Zipf's law over the expert index, weight ``(e + 1) ** -s``
  (expert 0 the most popular); a token picks ``top_k`` distinct experts, and the probability that
  it picks expert e is ``pi_e = min(1, c * w_e)`` with c such that ``sum(pi) = top_k`` (the
  inclusion probabilities of probability-proportional-to-size sampling without replacement,
  capped at 1). ``s = 0`` is uniform.

Tokens are independent. Per expert group g (the experts one EP rank holds):

- distinct experts hit by T tokens: ``sum_{e in g} 1 - (1 - pi_e) ** T`` (exact given pi);
- probability that a token needs the group (picks at least one of its experts) ``q_g``: exact
  for uniform routing, ``1 - C(E - n, k) / C(E, k)`` with n experts per group; for Zipf the
  independence approximation ``1 - prod_{e in g} (1 - pi_e)``;
- tokens received out of T: ``T * q_g``.

Placement: ``contiguous`` (expert e on EP rank ``e // (E / ep)``: with Zipf the most popular
experts share rank 0, the worst case, as without an expert-placement load balancer) or
``round_robin`` (expert e on rank ``e % ep``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jalapeno_emu.errors import InvalidArgumentError

__all__ = ["UNIFORM", "ExpertLoad", "Routing", "parse_routing"]

_KINDS = ("uniform", "zipf")
_PLACEMENTS = ("contiguous", "round_robin")


@dataclass(frozen=True)
class Routing:
    """A routing distribution (see the module docstring).

    Attributes:
        kind: ``uniform`` or ``zipf``.
        exponent: Zipf's s (>= 0; 0 for uniform).
        placement: ``contiguous`` or ``round_robin`` assignment of experts to EP ranks.
    """

    kind: str = "uniform"
    exponent: float = 0.0
    placement: str = "contiguous"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise InvalidArgumentError(f"routing kind {self.kind!r} is not one of {', '.join(_KINDS)}")
        if not (
            isinstance(self.exponent, int | float) and math.isfinite(self.exponent) and self.exponent >= 0
        ):
            raise InvalidArgumentError(f"routing exponent {self.exponent!r} must be a finite number >= 0")
        if self.kind == "uniform" and self.exponent:
            raise InvalidArgumentError("uniform routing takes no exponent; use zipf:S")
        if self.placement not in _PLACEMENTS:
            raise InvalidArgumentError(
                f"routing placement {self.placement!r} is not one of {', '.join(_PLACEMENTS)}"
            )

    @property
    def name(self) -> str:
        """``uniform`` or ``zipf:S`` (``:round_robin`` appended for that placement)."""
        base = "uniform" if self.kind == "uniform" else f"zipf:{self.exponent:g}"
        return base + (":round_robin" if self.placement == "round_robin" else "")

    def __str__(self) -> str:
        return self.name

    def pick_probabilities(self, experts: int, top_k: int) -> np.ndarray:
        """float64[E]: the probability that one token picks each expert (sums to top_k)."""
        if self.kind == "uniform" or self.exponent == 0:
            return np.full(experts, top_k / experts)
        weights = (np.arange(experts, dtype=np.float64) + 1.0) ** -self.exponent
        return _capped_inclusion(weights, top_k)


UNIFORM = Routing()
"""Uniform routing, contiguous placement."""


def _capped_inclusion(weights: np.ndarray, k: int) -> np.ndarray:
    """pi = min(1, c w) with sum(pi) = k: cap the largest at 1 and rescale the rest, repeatedly."""
    pi = np.zeros_like(weights)
    free = np.ones(weights.size, dtype=bool)
    left = float(k)
    while True:
        scaled = weights[free] * (left / weights[free].sum())
        over = scaled > 1.0
        if not over.any():
            pi[free] = scaled
            return pi
        idx = np.flatnonzero(free)[over]
        pi[idx] = 1.0
        free[idx] = False
        left -= idx.size


def parse_routing(text: str) -> Routing:
    """``uniform``, ``zipf:S`` or either with ``:round_robin`` (placement), e.g. ``zipf:1.2``.

    Raises:
        InvalidArgumentError: anything else, naming what was wrong.
    """
    parts = [p.strip() for p in str(text).split(":")]
    placement = "contiguous"
    if parts and parts[-1] in _PLACEMENTS:
        placement = parts.pop()
    if parts == ["uniform"]:
        return Routing("uniform", 0.0, placement)
    if len(parts) == 2 and parts[0] == "zipf":
        try:
            s = float(parts[1])
        except ValueError:
            raise InvalidArgumentError(
                f"routing {text!r}: zipf exponent {parts[1]!r} is not a number"
            ) from None
        return Routing("zipf", s, placement)
    raise InvalidArgumentError(
        f"routing {text!r} is not 'uniform' or 'zipf:S' (e.g. zipf:1.2), optionally "
        "followed by ':round_robin'"
    )


class ExpertLoad:
    """Expected per-EP-rank load of ``top_k``-of-``experts`` routing split over ``ep`` ranks.

    Args:
        experts, top_k: the model's routed experts and experts per token.
        ep: expert groups (divides experts).
        routing: the distribution and placement.
    """

    def __init__(self, experts: int, top_k: int, ep: int, routing: Routing = UNIFORM) -> None:
        if experts < 1 or top_k < 1 or top_k > experts:
            raise InvalidArgumentError(f"routing needs 1 <= top_k={top_k} <= experts={experts}")
        if ep < 1 or experts % ep:
            raise InvalidArgumentError(f"ep={ep} must divide the {experts} experts")
        self.experts, self.top_k, self.ep, self.routing = experts, top_k, ep, routing
        self.pick = routing.pick_probabilities(experts, top_k)
        per = experts // ep
        idx = np.arange(experts)
        self.members = (
            idx.reshape(ep, per) if routing.placement == "contiguous" else idx.reshape(per, ep).T.copy()
        )
        if routing.kind == "uniform" or routing.exponent == 0:
            miss = math.comb(experts - per, top_k) / math.comb(experts, top_k)
            self.hit = np.full(ep, 1.0 - miss)
        else:
            self.hit = 1.0 - np.prod(1.0 - self.pick[self.members], axis=1)
        self.busiest = int(np.argmax(self.hit))

    def distinct(self, tokens: float | np.ndarray, group: int | None = None) -> np.ndarray:
        """Expected distinct experts of ``group`` (default: the busiest) hit by ``tokens`` tokens."""
        g = self.busiest if group is None else group
        t = np.asarray(tokens, dtype=np.float64)
        pi = self.pick[self.members[g]]
        return np.sum(1.0 - (1.0 - pi[:, None]) ** t.reshape(1, -1), axis=0).reshape(t.shape)

    def picks_per_token(self, group: int | None = None) -> float:
        """Expected experts of ``group`` (default: the busiest) a token that needs the group picks."""
        g = self.busiest if group is None else group
        return float(self.pick[self.members[g]].sum() / self.hit[g])

    def received(self, tokens: float | np.ndarray, group: int | None = None) -> np.ndarray:
        """Expected tokens, out of ``tokens``, that pick at least one expert of ``group``."""
        g = self.busiest if group is None else group
        return np.asarray(tokens, dtype=np.float64) * self.hit[g]
