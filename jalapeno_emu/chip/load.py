"""Presets: TOML files become validated :class:`ChipSpec` objects; ``key=value`` overrides apply on top.

Stage: chip spec (the lenient, user-facing level). A preset file has ``name``, ``description``,
an optional ``inherits`` (a shipped preset name, or a path relative to the file), and one table
per block whose leaves each read ``{ value = ..., public = "source" }``,
``{ value = ..., assumed = "reason" }`` or ``{ value = ..., derived = "how" }``: exactly one of
the three. A value may be a number or a string with a unit that matches the field
(``"36GiB"``, ``"1.6GHz"``, ``"500ns"``). A child preset overrides only the leaves that differ.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from jalapeno_emu.chip._units import parse_quantity, short_repr
from jalapeno_emu.chip.spec import BLOCKS, FIELDS, ChipSpec, Provenance, unknown_field_message
from jalapeno_emu.errors import ConfigError
from jalapeno_emu.files import check_input_file

__all__ = ["apply_overrides", "list_presets", "load_preset", "parse_field_value", "preset_path"]

_TOP_KEYS = ("inherits", "name", "description")
_LEAF_KINDS = ("public", "assumed", "derived")


def _presets_dir() -> Path:
    return Path(str(resources.files("jalapeno_emu.chip") / "presets"))


def list_presets() -> list[str]:
    """Names of the presets shipped with the package, sorted (e.g. ``["jalapeno-v1", "tiny"]``)."""
    return sorted(p.stem for p in _presets_dir().glob("*.toml"))


def preset_path(name_or_path: str | os.PathLike[str], *, relative_to: Path | None = None) -> Path:
    """The TOML file behind a shipped preset name or a path (relative paths against `relative_to`).

    Raises:
        ConfigError: an unknown preset name (with close matches) or a path that does not exist.
    """
    text = os.fspath(name_or_path)
    looks_like_path = text.endswith(".toml") or os.sep in text or "/" in text
    if not looks_like_path:
        path = _presets_dir() / f"{text}.toml"
        if path.is_file():
            return path
        names = list_presets()
        close = difflib.get_close_matches(text, names, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"unknown chip preset {text!r}; {hint}shipped presets: {', '.join(names)} "
                          f"(or give a path to a .toml file)")
    path = Path(text)
    if relative_to is not None and not path.is_absolute():
        path = relative_to / path
    if not path.exists():
        raise ConfigError(f"chip preset file {str(path)!r} does not exist")
    # A directory, FIFO or device is refused by name before it is opened (a FIFO would block).
    return check_input_file(path, what="chip preset", error=ConfigError)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: malformed TOML: {exc}") from None
    except ValueError as exc:  # tomllib's int() refuses an integer of more than 4,300 digits
        raise ConfigError(f"{path}: unreadable TOML value: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the preset: {exc.strerror or exc}") from None


def parse_field_value(path: str, raw: Any) -> Any:
    """Convert a TOML value or a command-line string to the declared type of field `path`.

    Numbers may carry a unit suffix of the field's unit (``"36GiB"``, ``"1.6e9"``, ``"500ns"``);
    an int field accepts a float or string only if it is a whole number; bools accept
    true/false/yes/no/1/0.

    Args:
        path: dotted field path, e.g. ``"hbm.latency_s"``.
        raw: the value as written (TOML int/float/str/bool, or a string from ``--set``).

    Returns:
        The value as the field's type (int, float, bool or str).

    Raises:
        ConfigError: naming `path`, the expected type and what was found.
    """
    if path not in FIELDS:
        raise ConfigError(unknown_field_message(path))
    info = FIELDS[path]
    kind = info.type
    unit_note = f" in {info.unit}" if info.unit else ""
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
        if isinstance(raw, str) and raw.strip().lower() in words:
            return words[raw.strip().lower()]
        raise ConfigError(f"{path} expects true or false, found {raw!r}")
    if kind is str:
        if isinstance(raw, str):
            return raw
        raise ConfigError(f"{path} expects a string, found {raw!r}")
    value: Any = raw
    if isinstance(raw, str):
        try:
            value = parse_quantity(raw, info.unit, what=path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path} expects a number{unit_note}, found {raw!r}")
    if kind is int:
        if isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"{path} expects a whole number{unit_note}, found {raw!r}")
            value = int(value)
        return value
    try:
        return float(value)
    except OverflowError:  # an int past the largest float
        raise ConfigError(f"{path} expects a finite number{unit_note}, found {short_repr(value)}") from None


def _leaves_of(data: dict[str, Any], path: Path) -> dict[str, tuple[Any, Provenance]]:
    """Validate one file's structure; return its leaves as dotted path -> (raw value, provenance)."""
    leaves: dict[str, tuple[Any, Provenance]] = {}
    for key, table in data.items():
        if key in _TOP_KEYS:
            if not isinstance(table, str):
                raise ConfigError(f"{path}: {key} must be a string, found {table!r}")
            continue
        if key not in BLOCKS:
            close = difflib.get_close_matches(key, [*_TOP_KEYS, *BLOCKS], n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"{path}: unknown top-level key {key!r}; {hint}expected "
                              f"{', '.join(_TOP_KEYS)} or a block table ({', '.join(BLOCKS)})")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {key} must be a table ([{key}]), found {table!r}")
        for name, leaf in table.items():
            dotted = f"{key}.{name}"
            if dotted not in FIELDS:
                raise ConfigError(f"{path}: {unknown_field_message(dotted)}")
            leaves[dotted] = _leaf(dotted, leaf, path)
    return leaves


def _leaf(dotted: str, leaf: Any, path: Path) -> tuple[Any, Provenance]:
    """(raw value, provenance) of one ``{ value = ..., public|assumed|derived = "..." }`` table."""
    form = '{ value = ..., public = "source" } or { value = ..., assumed = "reason" }'
    if not isinstance(leaf, dict):
        raise ConfigError(f"{path}: {dotted} must be written {form}, found {leaf!r}")
    extra = sorted(set(leaf) - {"value", *_LEAF_KINDS})
    if extra:
        raise ConfigError(f"{path}: {dotted} has unexpected key(s) {', '.join(extra)}; write {form}")
    if "value" not in leaf:
        raise ConfigError(f"{path}: {dotted} has no value; write {form}")
    kinds = [k for k in _LEAF_KINDS if k in leaf]
    if len(kinds) != 1:
        found = " and ".join(kinds) if kinds else "none"
        raise ConfigError(f"{path}: {dotted} needs exactly one of public, assumed or derived "
                          f"(its provenance), found {found}")
    note = leaf[kinds[0]]
    if not isinstance(note, str) or not note.strip():
        raise ConfigError(f"{path}: {dotted} needs a non-empty {kinds[0]} note "
                          f"({'the source' if kinds[0] == 'public' else 'a one-line reason'}), "
                          f"found {note!r}")
    return leaf["value"], Provenance(kind=kinds[0], note=note.strip())


def _resolve(path: Path, chain: tuple[Path, ...]) -> tuple[dict[str, Any], dict[str, tuple]]:
    """(this file's top-level data, merged leaves path -> (raw, provenance, origin file)) with parents."""
    if path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"{path}: preset inheritance loops ({cycle})")
    data = _read_toml(path)
    leaves = {k: (*v, path) for k, v in _leaves_of(data, path).items()}
    parent = data.get("inherits")
    if parent is None:
        return data, leaves
    try:
        parent_path = preset_path(parent, relative_to=path.parent)
    except ConfigError as exc:
        raise ConfigError(f"{path}: inherits: {exc.message}") from None
    _, merged = _resolve(parent_path, (*chain, path.resolve()))
    merged.update(leaves)
    return data, merged


def load_preset(name_or_path: str | os.PathLike[str]) -> ChipSpec:
    """Load a shipped preset by name (``"jalapeno-v1"``, ``"tiny"``) or a TOML file by path.

    Args:
        name_or_path: a name from :func:`list_presets`, or a path to a ``.toml`` preset.

    Returns:
        The validated spec, provenance included (``name`` defaults to the file's stem).

    Raises:
        ConfigError: unknown preset, unreadable or malformed TOML, unknown key, a leaf without
            exactly one provenance, a missing field, a bad value or a broken invariant; the one
            sentence names the file and the dotted key.

    >>> load_preset("tiny").core.count
    2
    """
    path = preset_path(name_or_path)
    data, leaves = _resolve(path, ())
    missing = [p for p in FIELDS if p not in leaves]
    if missing:
        raise ConfigError(f"{path}: missing field(s) {', '.join(missing)}; every field needs "
                          f"{{ value = ..., public|assumed|derived = \"...\" }} here or in an "
                          f"inherited preset")
    values: dict[str, dict[str, Any]] = {block: {} for block in BLOCKS}
    provenance: dict[str, Provenance] = {}
    for dotted, (raw, prov, origin) in leaves.items():
        try:
            value = parse_field_value(dotted, raw)
        except ConfigError as exc:
            raise ConfigError(f"{origin}: {exc.message}") from None
        block, name = dotted.split(".")
        values[block][name] = value
        provenance[dotted] = prov
    try:
        blocks = {block: cls(**values[block]) for block, cls in BLOCKS.items()}
        return ChipSpec(name=data.get("name", path.stem), description=data.get("description", ""),
                        provenance=provenance, **blocks)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc.message}") from None


def apply_overrides(spec: ChipSpec, overrides: Iterable[str]) -> ChipSpec:
    """Apply ``"key=value"`` strings (from ``--set``) to `spec`, parsing each by its field's type.

    Args:
        spec: the spec to start from.
        overrides: e.g. ``["hbm.efficiency=0.85", "core.count=32", "hbm.latency_s=400ns"]``.

    Returns:
        A new validated spec; the overridden fields' provenance is ``assumed`` / ``"override"``.

    Raises:
        ConfigError: a string without ``=``, an unknown key (with close matches), a value that does
            not parse, or a result that breaks an invariant.
    """
    parsed: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. hbm.efficiency=0.85")
        parsed[key] = parse_field_value(key, text.strip())
    return spec.replace(**parsed) if parsed else spec
