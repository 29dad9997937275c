"""The measured InferenceX GPU points (``data/inferencex_gpu_points.csv``, provenance in
``data/README.md``), read into :class:`MeasuredPoint` records.

Stage: validation. One record per CSV data row, in file order, numbered from 1; empty cells are
None. The metrics compared with predictions are :data:`METRICS`.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.files import read_input_bytes

__all__ = ["CSV_NAME", "METRICS", "MeasuredPoint", "load_points"]

CSV_NAME = "inferencex_gpu_points.csv"

METRICS: dict[str, str] = {
    "tok_s_user": "interactivity_tok_s_user",
    "tput_per_gpu": "throughput_tok_s_per_chip",
    "ttft_s": "ttft_s",
}
"""CSV column -> the predicted field (``Prediction.as_dict()``) it is compared with."""

_COLUMNS = ("hardware", "model", "precision", "isl", "osl", "concurrency", "tok_s_user", "ttft_s", "e2e_s",
            "tput_per_gpu", "framework", "mtp", "source", "notes")


@dataclass(frozen=True)
class MeasuredPoint:
    """One measured serving point.

    Attributes:
        row: 1-based data row number in the CSV.
        hardware, model, precision, framework, mtp, source, notes: the CSV's text columns.
        isl, osl: nominal input / output tokens; concurrency: requests in flight (None: unknown).
        tok_s_user: interactivity, tok/s/user; ttft_s, e2e_s: median seconds; tput_per_gpu:
            input + output tok/s per GPU (each None where the source does not give it).
    """

    row: int
    hardware: str
    model: str
    precision: str
    isl: int
    osl: int
    concurrency: int | None
    tok_s_user: float | None
    ttft_s: float | None
    e2e_s: float | None
    tput_per_gpu: float | None
    framework: str
    mtp: str
    source: str
    notes: str

    def measured(self) -> dict[str, float]:
        """The compared metrics (:data:`METRICS` columns) this point has, column -> value."""
        return {k: v for k in METRICS if (v := getattr(self, k)) is not None}


def _num(text: str, row: int, column: str, kind: type) -> float | int | None:
    text = text.strip()
    if not text:
        return None
    try:
        return kind(float(text)) if kind is int else float(text)
    except ValueError:
        raise InvalidArgumentError(f"{CSV_NAME} row {row}: {column}={text!r} is not a number") from None


def load_points(path: str | Path | None = None) -> list[MeasuredPoint]:
    """Every data row of the calibration CSV (the packaged copy unless ``path`` is given).

    Raises:
        InvalidArgumentError: a missing column, or a number that does not parse (row named).
    """
    if path is None:
        data = resources.files("jalapeno_emu.validation").joinpath("data")
        text = data.joinpath(CSV_NAME).read_text("utf-8")
    else:
        # A FIFO or device at the path is refused rather than read (it would block or never end).
        text = read_input_bytes(path, what="calibration CSV").decode("utf-8")
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in _COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise InvalidArgumentError(f"{CSV_NAME}: missing columns {', '.join(missing)}")
    out = []
    for i, r in enumerate(reader, start=1):
        nums = {c: _num(r[c], i, c, int if c in ("isl", "osl", "concurrency") else float)
                for c in ("isl", "osl", "concurrency", "tok_s_user", "ttft_s", "e2e_s", "tput_per_gpu")}
        if nums["isl"] is None or nums["osl"] is None:
            raise InvalidArgumentError(f"{CSV_NAME} row {i}: isl and osl are required")
        out.append(MeasuredPoint(row=i, **{c: r[c].strip() for c in _COLUMNS if c not in nums}, **nums))
    return out
