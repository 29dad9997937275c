"""The step model's grids: every form of a query gives the same figures, and points are timed lazily."""

import math

import numpy as np
import pytest

from jalapeno_emu.rack.grid import LazyGrid1D, LazyGrid2D

XS = np.array([32.0, 64.0, 128.0, 256.0])
YS = np.concatenate([[0.0], 2.0 ** np.arange(9, 16)])


def _grid(calls):
    def f(x, y):
        calls.append((x, y))
        # Not bilinear, so interpolation weights matter; bytes and FLOPs grow fast in x.
        return np.array([1e-6 * (x + math.sqrt(y + 1.0)) + 1e-9 * x * y, 3e3 * x * x, 7e6 * x * x])

    return LazyGrid2D(XS, YS, f, bytes_per_s=1e12, flops_per_s=1e15)


@pytest.mark.parametrize("x", [32.0, 40.0, 128.0, 200.0, 256.0, 300.0])
def test_a_run_sum_is_the_floats_summed_in_order_and_each_float_the_array_entry(x):
    """run_sum (compiled loop), the float form and the array form agree to the bit: the serving
    simulator prices decode stretches as arrays and single steps as floats."""
    calls = []
    grid = _grid(calls)
    first, dy, count = 100.0, 1234.5, 37  # ys from below the second grid point to past the last
    ys = first + dy * np.arange(count, dtype=np.float64)
    summed = grid.run_sum(x, first, dy, count)
    singles = [grid(x, float(y)) for y in ys]
    expected = 0.0
    for v in singles:
        expected += v
    assert summed == expected
    assert np.array_equal(grid(x, ys), np.array(singles))
    assert all(isinstance(v, float) for v in singles)


def test_run_sum_times_only_the_points_it_reads_and_reads_them_once():
    calls = []
    grid = _grid(calls)
    first = grid.run_sum(48.0, 600.0, 10.0, 8)  # every y between 512 and 1024
    assert sorted(set(calls)) == [(32, 512), (32, 1024), (64, 512), (64, 1024)]
    assert len(calls) == len(set(calls))
    n = len(calls)
    assert grid.run_sum(48.0, 600.0, 10.0, 8) == first and len(calls) == n  # compiled path, no timing
    assert grid.run_sum(64.0, 0.0, 512.0, 2) == grid(64.0, 0.0) + grid(64.0, 512.0)
    assert (64, 0) in calls and not any(x == 128 for x, _ in calls)  # x on the grid: one column read


def test_beyond_the_last_x_the_slope_is_floored_by_bytes_and_flops():
    grid = _grid([])
    # The last segment's time slope (1.5e-6 s per x at y = 512) is below the FLOP floor
    # (7e6 * (256^2 - 128^2) / 128 / 1e15 = 2.7e-6 s per x); bytes give 1.15e-6 s per x.
    y = 512.0
    slope = max(1e-6 + 1e-9 * y, 3e3 * 384 / 1e12, 7e6 * 384 / 1e15)
    assert grid(512.0, y) == pytest.approx(grid(256.0, y) + 256.0 * slope, rel=1e-12)


def test_a_1d_grid_is_piecewise_linear_and_clamped():
    calls = []
    g = LazyGrid1D(np.array([1.0, 2.0, 4.0]), lambda t: calls.append(t) or 10.0 * t)
    assert g(3.0) == 30.0 and g(0.5) == 10.0 and g(8.0) == 40.0
    assert sorted(calls) == [1, 2, 4]


def test_a_query_hands_prefetch_every_point_it_will_time_at_once_and_the_figures_do_not_change():
    calls, asked = [], []
    plain = _grid([])
    grid = _grid(calls)
    grid.prefetch = lambda points: asked.append(sorted(points))
    assert grid.run_sum(48.0, 600.0, 10.0, 8) == plain.run_sum(48.0, 600.0, 10.0, 8)
    assert asked == [[(32, 512), (32, 1024), (64, 512), (64, 1024)]] and sorted(calls) == asked[0]
    # known points are not asked for again, by any form of query
    assert grid(48.0, 700.0) == plain(48.0, 700.0) and grid.run_sum(48.0, 600.0, 10.0, 8) and len(asked) == 1
    ys = np.array([0.0, 100.0, 700.0])
    assert np.array_equal(grid(40.0, ys), plain(40.0, ys))
    assert asked[1] == [(32, 0), (64, 0)]  # only the points not timed yet
    assert grid(300.0, 512.0) == plain(300.0, 512.0)  # beyond the last x: the last two columns
    assert asked[2] == [(128, 512), (256, 512)]
    assert len(calls) == len(set(calls))
    one = []
    g = LazyGrid1D(np.array([1.0, 2.0, 4.0]), lambda t: 10.0 * t, prefetch=one.append)
    assert g(3.0) == 30.0 and g(2.5) == 25.0 and one == [[2, 4]]
