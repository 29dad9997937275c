"""Error statistics of an approximation against a reference (a reporting tool, runs in numpy)."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from jalapeno_emu.errors import InvalidArgumentError, InvalidTypeError
from jalapeno_emu.mx._validate import as_host_array, describe

__all__ = ["ErrorStats", "error_stats", "ulp_distance"]

_ULP_FORMATS = {
    "float32": (np.float32, np.int32),
    "bfloat16": (ml_dtypes.bfloat16, np.int16),
    "float16": (np.float16, np.int16),
}


@dataclass(frozen=True)
class ErrorStats:
    """Summary of ``approx - reference``.

    Attributes:
        count: number of elements compared.
        max_abs_error: max |approx - reference|.
        max_rel_error: max |approx - reference| / |reference| over elements with reference != 0.
        rmse: sqrt(mean((approx - reference)^2)).
        snr_db: 10 log10(sum reference^2 / sum error^2); inf when the error is zero.
        cosine_similarity: <approx, reference> / (|approx| |reference|); 1.0 when both are zero.
        ulp_format: the float format the ULP distances are counted in.
        ulp_histogram: {bucket label: count}; buckets "0", "1", "2", "3-4", "5-8", ... by powers
            of two. Non-finite pairs are counted under "nonfinite".
    """

    count: int
    max_abs_error: float
    max_rel_error: float
    rmse: float
    snr_db: float
    cosine_similarity: float
    ulp_format: str
    ulp_histogram: dict[str, int]

    def as_dict(self) -> dict:
        """Plain-JSON form."""
        return {
            "count": self.count,
            "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error,
            "rmse": self.rmse,
            "snr_db": self.snr_db,
            "cosine_similarity": self.cosine_similarity,
            "ulp_format": self.ulp_format,
            "ulp_histogram": dict(self.ulp_histogram),
        }


def _ordered(bits: np.ndarray, width: int) -> np.ndarray:
    """Map sign-magnitude float bits to integers whose order and differences count ULPs."""
    b = bits.astype(np.int64)
    sign = 1 << (width - 1)
    mag = b & (sign - 1)
    return np.where(b & sign, -mag, mag)


def ulp_distance(approx: np.ndarray, reference: np.ndarray, fmt: str = "float32") -> np.ndarray:
    """Distance in units in the last place of ``fmt`` after rounding both inputs to ``fmt``.

    Args:
        approx, reference: arrays of one shape (any real float dtype).
        fmt: "float32", "bfloat16" or "float16".

    Returns:
        int64 array; -1 where either side is not finite in ``fmt``. +0 and -0 are 0 apart.
    """
    if not isinstance(fmt, str) or fmt not in _ULP_FORMATS:
        raise InvalidArgumentError(f"ulp_format={fmt!r} is not one of {sorted(_ULP_FORMATS)}")
    approx, reference = _real(approx, "approx"), _real(reference, "reference")
    if approx.shape != reference.shape:
        raise InvalidArgumentError(f"approx has shape {approx.shape} but reference has {reference.shape}")
    ftype, itype = _ULP_FORMATS[fmt]
    a = np.asarray(approx, np.float32).astype(ftype)
    r = np.asarray(reference, np.float32).astype(ftype)
    width = np.dtype(itype).itemsize * 8
    d = np.abs(_ordered(a.view(itype), width) - _ordered(r.view(itype), width))
    finite = np.isfinite(a.astype(np.float32)) & np.isfinite(r.astype(np.float32))
    return np.where(finite, d, -1)


def _real(value: object, argname: str) -> np.ndarray:
    """``value`` as a numpy array of real numbers (complex would lose its imaginary part silently)."""
    arr = as_host_array(value, argname, "an array of real numbers")
    if arr.dtype.kind == "c":
        raise InvalidTypeError(f"{argname} must be an array of real numbers, got {describe(value)}")
    return arr


def _histogram(dist: np.ndarray) -> dict[str, int]:
    hist: dict[str, int] = {}
    finite = dist[dist >= 0]
    for label, lo, hi in (("0", 0, 0), ("1", 1, 1), ("2", 2, 2)):
        hist[label] = int(np.count_nonzero((finite >= lo) & (finite <= hi)))
    lo = 3
    top = int(finite.max()) if finite.size else 0
    while lo <= top:
        hi = 2 * (lo - 1)
        hist[f"{lo}-{hi}"] = int(np.count_nonzero((finite >= lo) & (finite <= hi)))
        lo = hi + 1
    hist["nonfinite"] = int(np.count_nonzero(dist < 0))
    return hist


def _log10_energy(x: np.ndarray) -> float:
    """log10(sum(x^2)) without overflow or underflow: squares of x / max|x| lie in [0, 1]."""
    top = float(np.max(np.abs(x))) if x.size else 0.0
    if top == 0:
        return float("-inf")
    return float(np.log10(np.sum(np.square(x / top)))) + 2 * float(np.log10(top))


def _snr_db(log_signal: float, log_noise: float) -> float:
    """10 log10(signal energy / noise energy), from their log10 energies."""
    if log_noise == float("-inf"):
        return float("inf")
    return 10 * (log_signal - log_noise) if log_signal != float("-inf") else float("-inf")


def _unit(x: np.ndarray) -> np.ndarray:
    """``x`` divided by its largest magnitude (unchanged when all zero)."""
    top = float(np.max(np.abs(x))) if x.size else 0.0
    return x / top if top else x


def error_stats(approx, reference, *, ulp_format: str = "float32") -> ErrorStats:
    """Error statistics of ``approx`` against ``reference`` (both any real float arrays).

    Args:
        approx: array[*shape], e.g. dequantised MX values or an MX matmul result.
        reference: array[*shape], e.g. the float32 or float64 original.
        ulp_format: float format for the ULP histogram ("float32", "bfloat16", "float16").

    Returns:
        ErrorStats. Statistics other than the ULP histogram are computed in float64 over the
        pairs where both sides are finite.
    """
    approx, reference = _real(approx, "approx"), _real(reference, "reference")
    a = approx.astype(np.float64)
    r = reference.astype(np.float64)
    if a.shape != r.shape:
        raise InvalidArgumentError(f"approx has shape {a.shape} but reference has {r.shape}")
    if not isinstance(ulp_format, str) or ulp_format not in _ULP_FORMATS:
        raise InvalidArgumentError(f"ulp_format={ulp_format!r} is not one of {sorted(_ULP_FORMATS)}")
    ok = np.isfinite(a) & np.isfinite(r)
    a_f, r_f = a[ok], r[ok]
    # Finite float64 inputs near the top of the range overflow when squared: sums of squares are
    # taken of values scaled to at most 1 (_log10_energy, _unit). A difference that itself
    # overflows (opposite signs near the top) is taken of both halves, then counted twice.
    with np.errstate(over="ignore"):  # such an error is inf: it exceeds float64
        err = a_f - r_f
    e, e_scale = (err, 1.0) if np.isfinite(err).all() else (a_f * 0.5 - r_f * 0.5, 2.0)
    abs_err = np.abs(err)
    nz = r_f != 0
    top_e = float(np.max(np.abs(e))) if e.size else 0.0
    with np.errstate(over="ignore"):  # an rmse beyond float64 is inf
        rmse = top_e * float(np.sqrt(np.mean(np.square(e / top_e)))) * e_scale if top_e else 0.0
    a_u, r_u = _unit(a_f), _unit(r_f)
    # Norms from the same dot product as the numerator: with approx == reference all three are
    # one number D and sqrt(D * D) is exactly D, so an exact match gives exactly 1.0 (with
    # np.linalg.norm it read 0.9999999999999998 under one numpy build).
    norm = float(np.sqrt(np.dot(a_u, a_u) * np.dot(r_u, r_u)))
    return ErrorStats(
        count=int(a.size),
        max_abs_error=float(abs_err.max()) if abs_err.size else 0.0,
        max_rel_error=float((abs_err[nz] / np.abs(r_f[nz])).max()) if nz.any() else 0.0,
        rmse=rmse,
        snr_db=_snr_db(_log10_energy(r_f), _log10_energy(e) + 2 * float(np.log10(e_scale))),
        # Clipped: rounding in the norms can push an exact match a hair past 1.
        cosine_similarity=float(np.clip(np.dot(a_u, r_u) / norm, -1, 1)) if norm else 1.0,
        ulp_format=ulp_format,
        ulp_histogram=_histogram(ulp_distance(approx, reference, ulp_format)),
    )
