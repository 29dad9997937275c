"""The Pareto frontier of serving points: interactivity against throughput (per chip or per kW).

Stage: serving. Points are :class:`~jalapeno_emu.serving.sweep.SweepPoint` objects or the flat
dicts their ``as_dict()`` (and the JSON writer) give. A metric is named by its JSON field, a nested
one by a dotted path: ``"tok_s_per_kw.package"``. Comparisons between chips are quoted from
frontiers: the best throughput each reaches at a given interactivity (:func:`value_at`) and its
peak throughput (:func:`peak_point`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from jalapeno_emu.errors import InvalidArgumentError

__all__ = ["X_DEFAULT", "Y_DEFAULT", "pareto_front", "pareto_fronts", "peak_point", "point_value", "value_at"]

X_DEFAULT = "interactivity_tok_s_user"
Y_DEFAULT = "throughput_tok_s_per_chip"

P = TypeVar("P")


def _fields(point: Any) -> Mapping[str, Any]:
    return point if isinstance(point, Mapping) else point.as_dict()


def point_value(point: Any, key: str) -> float | None:
    """The value of metric ``key`` (a JSON field or dotted path) of ``point``; None when missing or NaN.

    Raises:
        InvalidArgumentError: ``key`` names no field of the point.
    """
    value: Any = _fields(point)
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise InvalidArgumentError(f"metric {key!r} is not a field of the serving points")
        value = value[part]
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


def pareto_front(points: Iterable[P], x: str = X_DEFAULT, y: str = Y_DEFAULT) -> list[P]:
    """The points no other point dominates (higher is better on both axes), sorted by ``x`` ascending.

    A point is dominated when another is at least as good on both metrics and better on one; equal
    points are all kept. Points missing either value are left out.
    """
    valued = [(point_value(p, x), point_value(p, y), i, p) for i, p in enumerate(points)]
    valued = [v for v in valued if v[0] is not None and v[1] is not None]
    # best x first, then best y: a point is on the front when its y beats every point with larger x
    valued.sort(key=lambda v: (-v[0], -v[1]))
    front: list[tuple[float, int, P]] = []
    best_y = -math.inf
    best_point: tuple[float, float] | None = None
    for vx, vy, i, p in valued:
        if vy > best_y:
            best_y, best_point = vy, (vx, vy)
            front.append((vx, i, p))
        elif (vx, vy) == best_point:
            front.append((vx, i, p))
    front.sort(key=lambda v: (v[0], v[1]))  # by x, equal points in the order given
    return [p for _, _, p in front]


def pareto_fronts(points: Sequence[P], x: str = X_DEFAULT, y: str = Y_DEFAULT,
                  by: str = "series") -> dict[str, list[P]]:
    """One frontier per value of field ``by`` (e.g. each chip/preset's own frontier), in first-seen order."""
    groups: dict[str, list[P]] = {}
    for p in points:
        groups.setdefault(str(_fields(p)[by]), []).append(p)
    return {name: pareto_front(group, x, y) for name, group in groups.items()}


def value_at(front: Sequence[P], x_value: float, x: str = X_DEFAULT, y: str = Y_DEFAULT
             ) -> tuple[float | None, list[P]]:
    """The best ``y`` a frontier reaches at ``x`` = ``x_value`` or better (higher), and the front
    points it comes from.

    ``front`` is a Pareto front sorted by ``x`` ascending (:func:`pareto_front`), so ``y`` falls as
    ``x`` rises. At or below the front's smallest ``x`` the answer is its largest ``y`` (the
    slowest point is fast enough); between two points it is linear interpolation between them (a
    deployment between the two concurrencies measured); above the fastest point it is None (no
    point measured reaches ``x_value``), with that point returned to say how far it got.

    Args:
        front: the frontier (points or their dicts).
        x_value: the required ``x`` (e.g. tok/s per user); a finite number.
        x, y: metric names (JSON fields or dotted paths, :func:`point_value`).

    Returns:
        (value or None, the one or two front points it was read from; [] for an empty front).

    Raises:
        InvalidArgumentError: ``x_value`` is not a finite number.
    """
    if isinstance(x_value, bool) or not isinstance(x_value, (int, float)) or not math.isfinite(x_value):
        raise InvalidArgumentError(f"the {x} to read the frontier at must be a finite number; "
                                   f"got {x_value!r}")
    pts = [(point_value(p, x), point_value(p, y), p) for p in front]
    pts = [(vx, vy, p) for vx, vy, p in pts if vx is not None and vy is not None]
    if not pts:
        return None, []
    if x_value <= pts[0][0]:
        return pts[0][1], [pts[0][2]]
    for (x0, y0, p0), (x1, y1, p1) in itertools.pairwise(pts):
        if x0 < x_value <= x1:
            return y0 + (y1 - y0) * (x_value - x0) / (x1 - x0), [p0, p1]
    return None, [pts[-1][2]]


def peak_point(points: Iterable[P], y: str = Y_DEFAULT, x: str = X_DEFAULT) -> P | None:
    """The point of largest ``y`` (ties: the larger ``x``, then the first given); None when no
    point has both values."""
    best: tuple[float, float, int] | None = None
    found: P | None = None
    for i, p in enumerate(points):
        vx, vy = point_value(p, x), point_value(p, y)
        if vx is None or vy is None:
            continue
        key = (vy, vx, -i)
        if best is None or key > best:
            best, found = key, p
    return found
