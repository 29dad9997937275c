"""Figures on a grid of kernel sizes, timed when first needed and interpolated between grid points.

Stage: rack, under :mod:`jalapeno_emu.rack.step_model`, which prices every engine step of a
serving simulation from these grids (a sweep asks tens of thousands of steps per model, so the
interpolation itself must cost microseconds, not the grid points it reads).

- :class:`LazyGrid1D`: one figure (seconds) on a 1-D grid, piecewise linear.
- :class:`LazyGrid2D`: three figures (seconds, HBM bytes, FLOPs) on an (x, y) grid, bilinear, with
  a floored linear extrapolation beyond the last x.

A grid may be given ``prefetch``: called with the points (as the ints ``f`` takes) a query is
about to time, when it meets the first of them, before it times them one by one, so that their
builds can run side by side
(:meth:`jalapeno_emu.rack.launch_timer.LaunchTimer.prefetch`). It only warms what ``f`` reads;
every figure is still ``f``'s.

Every form of a query (one float, a numpy array of ys, an arithmetic run of ys summed by the
compiled loop) does the same floating-point operations in the same order, so a step's price does
not depend on which form priced it: the serving simulator's decode stretches (arrays) and single
steps (floats) give identical times.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["LazyGrid1D", "LazyGrid2D", "bracket", "bracket1"]


def bracket(grid: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lower grid index and weight of the upper point for each x (clamped to the grid).

    Args:
        grid: float64[n] increasing, n >= 2.
        x: float64[m].

    Returns:
        (int64[m] index i in 0..n-2, float64[m] weight w in [0, 1]): x = grid[i] + w (grid[i+1] - grid[i]).
    """
    x = np.minimum(np.maximum(x, grid[0]), grid[-1])
    i = np.minimum(np.maximum(np.searchsorted(grid, x, side="right") - 1, 0), grid.size - 2)
    w = (x - grid[i]) / (grid[i + 1] - grid[i])
    return i, w


def bracket1(grid: list[float], x: float) -> tuple[int, float]:
    """:func:`bracket` for one x, in plain floats (the same arithmetic, so the same result)."""
    x = min(max(x, grid[0]), grid[-1])
    i = min(max(bisect.bisect_right(grid, x) - 1, 0), len(grid) - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


class LazyGrid1D:
    """``f`` (seconds) on grid points, computed when first needed; piecewise linear between them.

    Args:
        grid: float64[n] increasing grid (x values passed to ``f`` as ints).
        f: the figure at one grid point.
        prefetch: called with the xs (ints) about to be computed, when one is (see the module
            docstring); None: nothing.
    """

    def __init__(self, grid: np.ndarray, f: Callable[[int], float], *,
                 prefetch: Callable[[list[int]], Any] | None = None) -> None:
        self.grid, self.f, self.prefetch = grid, f, prefetch
        self._grid = [float(g) for g in grid]
        self.values: dict[int, float] = {}
        self._answers: dict[float, float] = {}  # a sweep asks the same few thousand xs again and again

    def point(self, i: int) -> float:
        """The figure at grid point ``i`` (computed on first use)."""
        v = self.values.get(i)
        if v is None:
            v = self.values[i] = float(self.f(int(self.grid[i])))
        return v

    def __call__(self, x: float) -> float:
        """The figure at ``x`` (clamped to the grid)."""
        x = float(x)
        v = self._answers.get(x)
        if v is None:
            i0, w0 = bracket1(self._grid, x)
            if self.prefetch is not None:
                wanted = [i for i in ((i0, i0 + 1) if w0 != 0.0 else (i0,)) if i not in self.values]
                if wanted:
                    self.prefetch([int(self.grid[i]) for i in wanted])
            v = self.point(i0)
            if w0 != 0.0:
                v = v + w0 * (self.point(i0 + 1) - v)
            self._answers[x] = v
        return v


class LazyGrid2D:
    """Launch figures (time, HBM bytes, FLOPs) on a grid of (x, y) points, computed when first
    needed; bilinear between them. Beyond the last x, linear in x with the slope of the last
    segment, but never below what each extra unit of x costs in HBM bytes at the achievable
    bandwidth or in FLOPs at the peak rate (the last segment may still sit below the die's knee).

    Args:
        xs: float64[nx] increasing x grid; ys: float64[ny] increasing y grid.
        f: the figures (seconds, HBM bytes, FLOPs) at one grid point (ints).
        bytes_per_s: the achievable HBM rate, for the extrapolation's floor.
        flops_per_s: the peak FLOP rate, for the extrapolation's floor.
        prefetch: called with the (x, y) points (ints) a query is about to compute (see the
            module docstring); None: nothing.
    """

    def __init__(
        self,
        xs: np.ndarray,
        ys: np.ndarray,
        f: Callable[[int, int], np.ndarray],
        bytes_per_s: float,
        flops_per_s: float,
        *,
        prefetch: Callable[[list[tuple[int, int]]], Any] | None = None,
    ) -> None:
        self.xs, self.ys, self.f, self.prefetch = xs, ys, f, prefetch
        self._xs, self._ys = [float(v) for v in xs], [float(v) for v in ys]
        self.bytes_per_s, self.flops_per_s = bytes_per_s, flops_per_s
        self.values: dict[tuple[int, int], np.ndarray] = {}
        # The same figures as a dense [x, y, 3] table (NaN = not timed yet), so a column of many
        # ys (a decode stretch of a thousand steps) is gathered by indexing, not a Python loop.
        self._table = np.full((xs.size, ys.size, 3), np.nan)
        self._floats: dict[tuple[int, int], tuple[float, float, float]] = {}
        # The query being answered, (x, ys), until its first point that needs computing hands
        # ``prefetch`` all of them (``_point``): queries of known points pay one store, no check.
        self._query: tuple[float, Any] | None = None

    def _rows(self, x: float) -> tuple[int, ...]:
        """The x grid indices a query at ``x`` reads."""
        top = len(self._xs) - 1
        if x > self._xs[top]:
            return (top - 1, top)
        i0, w0 = bracket1(self._xs, float(x))
        return (i0, i0 + 1) if w0 != 0.0 else (i0,)

    def _want(self, x: float, ys: Any) -> None:
        """Hand ``prefetch`` every grid point a query at ``x`` for ``ys`` (floats) reads and nobody
        has computed yet (nothing when there is no such point)."""
        j, w = bracket(self.ys, np.asarray(ys, dtype=np.float64))
        cols = np.union1d(j, j[w > 0] + 1).tolist()
        wanted = [(int(self.xs[i]), int(self.ys[c])) for i in self._rows(x) for c in cols
                  if (i, c) not in self.values]
        if wanted:
            self.prefetch(wanted)

    def _point(self, i: int, j: int) -> np.ndarray:
        v = self.values.get((i, j))
        if v is None:
            query, self._query = self._query, None
            if query is not None and self.prefetch is not None:
                self._want(*query)
            v = self.values[(i, j)] = np.asarray(self.f(int(self.xs[i]), int(self.ys[j])), dtype=np.float64)
            self._table[i, j] = v
            self._floats[(i, j)] = tuple(v.tolist())
        return v

    def _point_floats(self, i: int, j: int) -> tuple[float, float, float]:
        v = self._floats.get((i, j))
        if v is None:
            self._point(i, j)
            v = self._floats[(i, j)]
        return v

    def _column(self, i: int, ys: np.ndarray) -> np.ndarray:
        """float64[3, n]: the figures at x = xs[i], interpolated over ys."""
        if ys.size <= 8:  # a few ys: plain floats, the same arithmetic as below
            return np.array([self._column1(i, y) for y in ys.tolist()]).T
        j, w = bracket(self.ys, ys)
        up = w > 0
        row = self._table[i]
        j_hi = np.where(up, j + 1, j)
        lo, hi = row[j], row[j_hi]
        if np.isnan(lo[:, 0]).any() or np.isnan(hi[:, 0]).any():  # grid points first needed here
            for a in sorted(set(j.tolist()) | set(j_hi.tolist())):
                self._point(i, a)
            lo, hi = row[j], row[j_hi]
        return np.where(up, (lo + w[:, None] * (hi - lo)).T, lo.T)

    def _column1(self, i: int, y: float) -> tuple[float, ...]:
        """:meth:`_column` at one y, in plain floats (the same arithmetic element by element, so
        the same result): a single step's price costs microseconds, not numpy's per-call cost."""
        j0, w0 = bracket1(self._ys, y)
        lo = self._point_floats(i, j0)
        if w0 == 0.0:
            return lo
        hi = self._point_floats(i, j0 + 1)
        return tuple(a + w0 * (b - a) for a, b in zip(lo, hi, strict=True))

    def __call__(self, x: float, ys: np.ndarray | float) -> np.ndarray | float:
        """The time (s) at ``x`` for each of ``ys`` (an array: float64[n]; one float: a float)."""
        if not isinstance(ys, np.ndarray):
            return self._at(x, float(ys))
        self._query = (x, ys)
        top = self.xs.size - 1
        if x > self.xs[top]:
            hi, lo = self._column(top, ys), self._column(top - 1, ys)
            dx = self.xs[top] - self.xs[top - 1]
            slope = np.maximum.reduce(
                [
                    (hi[0] - lo[0]) / dx,
                    (hi[1] - lo[1]) / dx / self.bytes_per_s,
                    (hi[2] - lo[2]) / dx / self.flops_per_s,
                ]
            )
            return hi[0] + (x - self.xs[top]) * slope
        i0, w0 = bracket1(self._xs, float(x))
        lo = self._column(i0, ys)[0]
        if w0 == 0.0:
            return lo
        return lo + w0 * (self._column(i0 + 1, ys)[0] - lo)

    def _at(self, x: float, y: float) -> float:
        """:meth:`__call__` at one y, in plain floats (the same arithmetic)."""
        self._query = (x, (y,))
        return self._at_known(x, y)

    def _at_known(self, x: float, y: float) -> float:
        """:meth:`_at` within a query already recorded (a run of ys)."""
        top = len(self._xs) - 1
        if x > self._xs[top]:
            hi, lo = self._column1(top, y), self._column1(top - 1, y)
            dx = self._xs[top] - self._xs[top - 1]
            slope = max(
                (hi[0] - lo[0]) / dx,
                (hi[1] - lo[1]) / dx / self.bytes_per_s,
                (hi[2] - lo[2]) / dx / self.flops_per_s,
            )
            return hi[0] + (x - self._xs[top]) * slope
        i0, w0 = bracket1(self._xs, float(x))
        lo = self._column1(i0, y)[0]
        if w0 == 0.0:
            return lo
        return lo + w0 * (self._column1(i0 + 1, y)[0] - lo)

    def run_sum(self, x: float, first_y: float, dy: float, count: int) -> float:
        """The times at ``x`` for ys ``first_y + dy * j``, j = 0 .. count-1, summed in order of j
        (the same as adding ``self(x, y)`` one y at a time, in a compiled loop: the prefill
        attention of a chunk split into up to 64 sub-chunks, priced at every mixed step).

        Args:
            x: the chunk size; within the grid the compiled loop runs (a prefill chunk's always
                is), beyond its last x the extrapolation is priced one y at a time.
            first_y, dy: the run's first y and its step; count: its length (>= 1).
        """
        if x > self._xs[-1]:  # beyond the grid: the extrapolation, one y at a time
            return self._run_sum_floats(x, first_y, dy, count)
        i0, w0 = bracket1(self._xs, float(x))
        lo_row = self._table[i0, :, 0]
        hi_row = self._table[i0 + 1, :, 0] if w0 != 0.0 else lo_row
        total = _run_sum_loop()(lo_row, hi_row, self.ys, w0, float(first_y), float(dy), int(count))
        if total != total:  # NaN: a grid point first needed here; the float path times it
            return self._run_sum_floats(x, first_y, dy, count)
        return total

    def _run_sum_floats(self, x: float, first_y: float, dy: float, count: int) -> float:
        if self.prefetch is not None:
            self._query = (x, first_y + dy * np.arange(count, dtype=np.float64))
        total = 0.0
        for j in range(count):
            total += self._at_known(x, first_y + dy * float(j))
        return total


def _run_sum(lo_row: np.ndarray, hi_row: np.ndarray, ys: np.ndarray, w0: float, first_y: float,
             dy: float, count: int) -> float:
    """The loop of :meth:`LazyGrid2D.run_sum` (compiled by numba; NaN when it meets an untimed
    point): per y, the arithmetic of ``bracket1``, ``_column1`` and ``_at``."""
    n = ys.size
    total = 0.0
    for k in range(count):
        y = first_y + dy * float(k)
        y = min(max(y, ys[0]), ys[n - 1])
        j = min(max(np.searchsorted(ys, y, side="right") - 1, 0), n - 2)
        w = (y - ys[j]) / (ys[j + 1] - ys[j])
        v = lo_row[j]
        if w != 0.0:
            v = v + w * (lo_row[j + 1] - v)
        if w0 != 0.0:
            u = hi_row[j]
            if w != 0.0:
                u = u + w * (hi_row[j + 1] - u)
            v = v + w0 * (u - v)
        total += v
    return total


@functools.cache
def _run_sum_loop() -> Any:
    """:func:`_run_sum` compiled (numba loads on first use: a sweep's points need it, an import
    of the rack does not)."""
    from jalapeno_emu.compiled import njit_cached

    return njit_cached(_run_sum)
