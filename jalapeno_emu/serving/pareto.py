"""The Pareto frontier of serving points: interactivity against throughput (per chip or per kW).

Stage: serving. Points are :class:`~jalapeno_emu.serving.sweep.SweepPoint` objects or the flat
dicts their ``as_dict()`` (and the JSON writer) give. A metric is named by its JSON field, a nested
one by a dotted path: ``"tok_s_per_kw.package"``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from jalapeno_emu.errors import InvalidArgumentError

__all__ = ["X_DEFAULT", "Y_DEFAULT", "pareto_front", "pareto_fronts", "point_value"]

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
