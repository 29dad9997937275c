"""Figures read from frontiers: the best throughput at an interactivity, and the peak."""

from __future__ import annotations

import pytest

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.serving import pareto_front, peak_point, value_at
from jalapeno_emu.serving.quotes import at_interactivity, peaks


def _pt(mapping, concurrency, x, y, watts=1000.0):
    return {"mapping": mapping, "chips": 1, "concurrency": concurrency, "interactivity_tok_s_user": x,
            "throughput_tok_s_per_chip": y,
            "tok_s_per_kw": {"package": y * 1000 / (watts / 2), "sustained": y * 1000 / watts,
                             "all_in": y * 1000 / (2 * watts)}}


# A frontier by hand: faster per user means less per chip; "slow" is dominated by "b".
CHIP_A = [_pt("a", 64, 10.0, 1000.0), _pt("b", 16, 40.0, 600.0), _pt("c", 1, 100.0, 50.0),
          _pt("slow", 32, 20.0, 400.0)]
CHIP_B = [_pt("x", 64, 20.0, 500.0, watts=2000.0), _pt("y", 1, 50.0, 100.0, watts=2000.0)]


def test_value_at_interpolates_between_the_front_points_around_x():
    front = pareto_front(CHIP_A)
    assert [p["mapping"] for p in front] == ["a", "b", "c"]
    value, used = value_at(front, 25.0)
    assert value == pytest.approx(1000.0 + (600.0 - 1000.0) * (25.0 - 10.0) / (40.0 - 10.0))
    assert [p["mapping"] for p in used] == ["a", "b"]
    assert value_at(front, 40.0)[0] == pytest.approx(600.0)  # on a point: that point's value


def test_value_at_below_the_slowest_point_is_the_peak_and_above_the_fastest_is_none():
    front = pareto_front(CHIP_A)
    assert value_at(front, 1.0) == (1000.0, [front[0]])
    value, used = value_at(front, 150.0)
    assert value is None and used == [front[-1]]  # the fastest point, to say how far it got
    assert value_at([], 5.0) == (None, [])
    with pytest.raises(InvalidArgumentError, match="finite"):
        value_at(front, float("nan"))


def test_peak_point_is_the_largest_throughput():
    assert peak_point(CHIP_A)["mapping"] == "a"
    assert peak_point([]) is None


def test_at_interactivity_reads_each_chip_and_gives_ref_over_other_ratios():
    row = at_interactivity({"A": CHIP_A, "B": CHIP_B}, 30.0, ref="A", power="sustained")
    a = 1000.0 + (600.0 - 1000.0) * 20.0 / 30.0
    b = 500.0 + (100.0 - 500.0) * 10.0 / 30.0
    assert row["A"]["throughput_tok_s_per_chip"] == pytest.approx(a)
    assert row["B"]["throughput_tok_s_per_chip"] == pytest.approx(b)
    # per kW at the chip's own power: A draws 1 kW sustained, B 2 kW
    assert row["A"]["tok_s_per_kw"] == pytest.approx(a)
    assert row["B"]["tok_s_per_kw"] == pytest.approx(b / 2)
    ratio = row["ratios"]["B"]
    assert ratio["throughput_tok_s_per_chip"] == pytest.approx(a / b)
    assert ratio["tok_s_per_kw"] == pytest.approx(2 * a / b)
    assert [p["mapping"] for p in row["B"]["from"]] == ["x", "y"]


def test_at_interactivity_says_why_a_chip_has_no_value():
    row = at_interactivity({"A": CHIP_A, "B": CHIP_B}, 80.0, ref="A")
    assert row["A"]["throughput_tok_s_per_chip"] is not None
    assert row["B"]["throughput_tok_s_per_chip"] is None and "fastest simulated is 50.0" in row["B"]["reason"]
    assert row["ratios"]["B"] == {"throughput_tok_s_per_chip": None, "tok_s_per_kw": None}


@pytest.mark.parametrize("bad", [0, -3.0, float("inf"), True, "10"])
def test_at_interactivity_refuses_a_bad_target(bad):
    with pytest.raises(InvalidArgumentError, match="interactivity"):
        at_interactivity({"A": CHIP_A}, bad, ref="A")


def test_peaks_and_their_ratios():
    out = peaks({"A": CHIP_A, "B": CHIP_B}, ref="A", power="all_in")
    assert out["A"]["mapping"] == "a" and out["B"]["mapping"] == "x"
    assert out["ratios"]["B"]["throughput_tok_s_per_chip"] == pytest.approx(1000.0 / 500.0)
    assert out["ratios"]["B"]["tok_s_per_kw"] == pytest.approx((1000.0 / 2) / (500.0 / 4))
    with pytest.raises(InvalidArgumentError, match="power 'all-in'"):
        peaks({"A": CHIP_A}, ref="A", power="all-in")
