"""Writers for sweep points: CSV and JSON, each file written whole or not at all.

Stage: serving, the files a sweep leaves behind. Both writers take :class:`SweepPoint` objects or
their flat dicts; nested fields (``tok_s_per_kw``) become dotted CSV columns
(``tok_s_per_kw.package``). The JSON document carries ``schema_version``; bump
:data:`SCHEMA_VERSION` when a field changes meaning or disappears.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.files import atomic_write, check_input_file

__all__ = ["SCHEMA_VERSION", "atomic_write", "flatten", "read_points_json", "write_points_csv",
           "write_points_json"]

SCHEMA_VERSION = 1
"""Version of the sweep JSON document (and of the CSV columns)."""
JSON_KIND = "jalapeno-emu/serving-sweep"


def _point_dict(point: Any) -> dict[str, Any]:
    return dict(point) if isinstance(point, Mapping) else point.as_dict()


def flatten(fields: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys: {"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def write_points_csv(points: Sequence[Any], path: str | os.PathLike[str]) -> None:
    """One row per point, one column per (flattened) field, empty cells for None."""
    if not points:
        raise InvalidArgumentError(f"no serving points to write to {os.fspath(path)!r}")
    rows = [flatten(_point_dict(p)) for p in points]
    columns = list(rows[0])
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row.get(k) for k in columns})
    data = text.getvalue().encode()
    atomic_write(path, lambda f: f.write(data))


def write_points_json(points: Sequence[Any], path: str | os.PathLike[str],
                      meta: Mapping[str, Any] | None = None) -> None:
    """``{"schema_version", "kind", **meta, "points": [...]}``; ``meta`` says what was swept
    (model, chip, isl/osl...)."""
    doc = {"schema_version": SCHEMA_VERSION, "kind": JSON_KIND, **dict(meta or {}),
           "points": [_point_dict(p) for p in points]}
    data = (json.dumps(doc, indent=2, allow_nan=False) + "\n").encode()
    atomic_write(path, lambda f: f.write(data))


def read_points_json(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(meta, points) of a file :func:`write_points_json` wrote; points as flat dicts.

    Raises:
        InvalidArgumentError: not a sweep document, or a schema version this code does not read.
    """
    check_input_file(path, what="sweep JSON")  # a FIFO or device would block or never end
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("kind") != JSON_KIND:
        raise InvalidArgumentError(f"{os.fspath(path)!r} is not a serving sweep JSON document")
    if doc.get("schema_version") != SCHEMA_VERSION:
        found = doc.get("schema_version")
        raise InvalidArgumentError(
            f"{os.fspath(path)!r} has schema_version {found!r}; this code reads {SCHEMA_VERSION}")
    points = doc.pop("points")
    doc.pop("schema_version"), doc.pop("kind")
    return doc, points
