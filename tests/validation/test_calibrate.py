"""Calibration and leave-one-out on a small prediction matrix with a known answer (pure math)."""

import math

import numpy as np
import pytest

from jalapeno_emu.validation.calibrate import fit_setting, leave_one_out, mape, relative_errors

NAN = math.nan


def test_relative_errors_and_median():
    meas = np.array([[100.0, NAN], [10.0, 2.0]])
    pred = np.array([[110.0, 5.0], [NAN, 1.0]])
    err = relative_errors(pred, meas)
    assert err[0, 0] == pytest.approx(0.1)
    assert math.isnan(err[0, 1])  # nothing measured: ignored
    assert err[1, 0] == math.inf  # measured but not predicted: infinitely wrong
    assert err[1, 1] == pytest.approx(-0.5)
    assert mape(err) == pytest.approx(0.5)  # median of 0.1, inf, 0.5
    assert math.isnan(mape(np.array([NAN])))


def _matrix():
    # 3 settings x 4 rows x 1 metric; measured 100 everywhere
    meas = np.full((4, 1), 100.0)
    P = np.array([
        [[100.0], [100.0], [100.0], [300.0]],  # setting 0: rows 0-2 exact, row 3 +200 %
        [[110.0], [110.0], [110.0], [110.0]],  # setting 1: +10 % everywhere
        [[150.0], [150.0], [150.0], [100.0]],  # setting 2: +50 %, row 3 exact
    ])
    return P, meas


def test_fit_picks_the_lowest_median_error():
    P, meas = _matrix()
    s, per = fit_setting(P, meas, [0, 1, 2, 3])
    assert s == 0  # median of (0, 0, 0, 2) = 0
    assert per.tolist() == pytest.approx([0.0, 0.1, 0.5])
    assert fit_setting(P, meas, [3])[0] == 2


def test_leave_one_out_refits_without_the_row():
    P, meas = _matrix()
    errs, chosen = leave_one_out(P, meas, [0, 1, 2, 3])
    # leaving out any of rows 0-2 still picks setting 0; leaving out row 3 too
    assert chosen == [0, 0, 0, 0]
    assert errs[:, 0].tolist() == pytest.approx([0.0, 0.0, 0.0, 2.0])
    assert mape(errs) == pytest.approx(0.0)
    # on rows {2, 3} alone: without 3 -> setting 0 (row 2 exact); without 2 -> setting 2 (row 3 exact)
    errs, chosen = leave_one_out(P, meas, [2, 3])
    assert chosen == [2, 0]
    assert errs[:, 0].tolist() == pytest.approx([0.5, 2.0])


def test_a_setting_where_a_row_fails_is_not_chosen():
    P, meas = _matrix()
    P[0, 1, 0] = NAN  # setting 0 fails on row 1
    P[0, 2, 0] = NAN  # and row 2: its median is now inf
    assert fit_setting(P, meas, [0, 1, 2, 3])[0] == 1


def test_one_row_has_nothing_to_fit_on():
    P, meas = _matrix()
    errs, chosen = leave_one_out(P, meas, [1])
    assert chosen == [-1] and np.isnan(errs).all()
