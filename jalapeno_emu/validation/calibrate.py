"""Calibration by grid search and its leave-one-out error: pure arithmetic on a prediction matrix.

Stage: validation. ``P[s, r, m]`` is the prediction of metric m of row r at knob setting s,
``measured[r, m]`` the measurement (NaN where the source has none). The error is relative,
``(P - measured) / measured``; a missing prediction (NaN) where a measurement exists is an infinite
error, so a setting under which a row fails is never preferred. MAPE is the MEDIAN absolute
percentage error over every (row, metric) pair that has a measurement.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

__all__ = ["fit_setting", "leave_one_out", "mape", "relative_errors"]


def relative_errors(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """(predicted - measured) / measured, broadcast over leading axes; NaN where nothing was
    measured, +inf where a measurement exists but the prediction is missing.

    Args:
        predicted: float[..., R, M]; measured: float[R, M].
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        err = (predicted - measured) / measured
    missing = np.isnan(predicted) & ~np.isnan(measured)
    return np.where(missing, np.inf, err)


def mape(errors: np.ndarray, axis: tuple[int, ...] | None = None) -> np.ndarray | float:
    """Median of |errors| over ``axis`` (all when None), ignoring NaN (nothing measured); NaN when
    nothing is left. In percent of the measurement as a fraction: 0.1 is 10 %."""
    a = np.abs(np.asarray(errors, dtype=np.float64))
    if axis is None:
        a = a[~np.isnan(a)]
        return float(np.median(a)) if a.size else float("nan")
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices give NaN, as documented
        return np.nanmedian(a, axis=axis)


def fit_setting(predicted: np.ndarray, measured: np.ndarray, rows: Sequence[int]) -> tuple[int, np.ndarray]:
    """The knob setting with the lowest MAPE over ``rows``.

    Args:
        predicted: float[S, R, M]; measured: float[R, M]; rows: row indices fitted on.

    Returns:
        (index of the best setting (lowest index on ties), float[S] MAPE of every setting).
    """
    rows = list(rows)
    if not rows:
        raise ValueError("fit_setting needs at least one row")
    err = relative_errors(predicted[:, rows, :], measured[rows, :])
    per_setting = np.array([mape(err[s]) for s in range(err.shape[0])])
    finite = np.where(np.isnan(per_setting), np.inf, per_setting)
    return int(np.argmin(finite)), per_setting


def leave_one_out(
    predicted: np.ndarray, measured: np.ndarray, rows: Sequence[int]
) -> tuple[np.ndarray, list[int]]:
    """Each row's error when the knobs are fitted on the other rows.

    Returns:
        (float[len(rows), M] errors of each left-out row at the setting fitted without it,
        the setting chosen for each). With one row there is nothing to fit on: its errors are NaN
        and its setting -1.
    """
    rows = list(rows)
    out = np.full((len(rows), measured.shape[1]), np.nan)
    chosen = []
    for i, r in enumerate(rows):
        others = rows[:i] + rows[i + 1:]
        if not others:
            chosen.append(-1)
            continue
        s, _ = fit_setting(predicted, measured, others)
        chosen.append(s)
        out[i] = relative_errors(predicted[s, r, :], measured[r, :])
    return out, chosen
