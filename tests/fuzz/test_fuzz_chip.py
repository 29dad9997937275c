"""Fuzzing the chip spec: presets, ``--set`` overrides and ``ChipSpec.replace`` give a valid
``ChipSpec`` or a ``ConfigError``, never another exception.

A spec that is accepted must also be one the rest of the program can use: every derived total
finite (``chip show --json`` prints it, and JSON has no Infinity), picklable (sweeps send specs to
worker processes), and holding exactly the value the override asked for.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import tempfile
from decimal import Decimal
from fractions import Fraction
from importlib import resources
from pathlib import Path

import numpy as np
from hypothesis import event, example, given
from hypothesis import strategies as st

from jalapeno_emu.chip import (
    FIELDS,
    ChipSpec,
    Provenance,
    apply_overrides,
    list_presets,
    load_preset,
    parse_field_value,
)
from jalapeno_emu.chip._units import unit_suffixes
from jalapeno_emu.emu import run_timing
from jalapeno_emu.errors import ConfigError, EmuError
from jalapeno_emu.isa import assemble
from jalapeno_emu.kernels.runner import run_kernel
from tests.fuzz.helpers import call, fuzz_settings, time_limit

ROOT = Path(__file__).resolve().parents[2]
TINY = load_preset("tiny")
PRESETS_DIR = Path(str(resources.files("jalapeno_emu.chip") / "presets"))
PRESET_TEXT = {name: (PRESETS_DIR / f"{name}.toml").read_text() for name in ("tiny", "jalapeno-v1")}

# Field paths, and the near misses a user types: a block alone, a typo, the top-level keys.
KEYS = st.one_of(
    st.sampled_from(list(FIELDS)),
    st.sampled_from(["core", "hbm.", ".count", "core.count.x", "core.cont", "hbm.Stacks", "name",
                     "description", "inherits", "", " ", "=", "core..count"]),
    st.from_regex(r"[a-z]{1,8}\.[a-z_]{1,20}", fullmatch=True),
)
_ALL_SUFFIXES = sorted({s for info in FIELDS.values() for s in unit_suffixes(info.unit)})
# Numbers as text: every spelling parse_quantity might meet, with and without a unit.
NUMBER_TEXT = st.one_of(
    st.integers(-(2**80), 2**80).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.floats(min_value=1e-3, max_value=1e20).map(lambda x: f"{x:g}"),
    st.sampled_from(["0", "-0", "1", "2", "64", "0.5", "1e1000000", "-1e1000000", "1e-1000000", "nan",
                     "inf", "-inf", "1_000", "1__0", "_1", "1.2.3", "0x10", "1e", "e3", ".", "", " ",
                     "9" * 5000, "1" + "0" * 400, "0." + "0" * 400 + "1", "true", "yes", "off",
                     "jalapeno", "Infinity", "1e308", "1.7976931348623157e308", "5e-324",
                     str(2**63), str(2**64), "9223372036854775808"]),
)
VALUE_TEXT = st.one_of(
    NUMBER_TEXT,
    st.builds("{}{}{}".format, NUMBER_TEXT, st.sampled_from(["", " "]),
              st.sampled_from([*_ALL_SUFFIXES, "Gib", "GHZ", "%", "x", "cycles"])),
    st.sampled_from(["none", "layer", "step", "None", "LAYER"]),  # software.fusion is a str field
    st.text(max_size=12),
)


# "key=value" as typed, with the separator sometimes wrong or missing.
ANY_OVERRIDE = st.tuples(KEYS, st.sampled_from(["=", "=", " = ", ":", ""]), VALUE_TEXT).map("".join)


def _assert_usable(spec: ChipSpec) -> None:
    """What every accepted spec must allow: finite totals, JSON without NaN/Infinity, pickling."""
    assert isinstance(spec, ChipSpec)
    derived = spec.derived()
    assert all(math.isfinite(v) for v in derived.values()), derived
    json.dumps({"spec": spec.to_dict(), "derived": derived}, allow_nan=False)
    assert pickle.loads(pickle.dumps(spec)) == spec
    repr(spec)


@st.composite
def in_range_override(draw: st.DrawFn) -> str:
    """``key=value`` for a real field, with a value inside its check and its limit (often at the
    limit itself): these pass validation, so what they test is that the spec is then usable."""
    path = draw(st.sampled_from(list(FIELDS)))
    info = FIELDS[path]
    if info.type is str:
        return f"{path}={draw(st.sampled_from(['none', 'layer', 'step']))}"
    low = info.limit.minimum if info.limit.minimum is not None else (0 if info.check == "nonnegative" else 1)
    high = info.limit.maximum
    if info.check == "power_of_two":
        value = 2 ** draw(st.integers(0, int(math.log2(high))))
    elif info.type is int:
        value = draw(st.one_of(st.integers(int(low), min(int(high), 64)), st.integers(int(low), int(high)),
                               st.sampled_from([int(low), int(high)])))
    else:
        value = draw(st.one_of(st.floats(float(low), float(high)), st.sampled_from([low, high])))
    return f"{path}={value!r}"


@fuzz_settings(max_examples=300, deadline_s=5)
@given(st.lists(st.one_of(ANY_OVERRIDE, in_range_override()), min_size=1, max_size=3))
def test_set_overrides(items):
    with time_limit(20, "apply_overrides"):
        result = call(apply_overrides, TINY, items)
    if isinstance(result, EmuError):
        assert isinstance(result, ConfigError), repr(result)
        event("refused")
        return
    event("accepted")
    _assert_usable(result)
    # The last override of a key wins, and holds its parsed value exactly.
    key, _, text = items[-1].partition("=")
    assert result.get(key.strip()) == parse_field_value(key.strip(), text.strip())


# Python values of every kind a script might pass to replace(): the right types at extreme
# sizes, and wrong types (bool for int, None, text, containers, numpy and decimal numbers).
PY_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(0, 5000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([True, False, None, "", "1", "2GHz", "step", [], {}, (1,), b"1", Decimal("1.5"),
                     Decimal("NaN"), Fraction(1, 3), 10**5000, np.int64(4), np.float32(0.5), np.float64(2.0),
                     np.uint8(1), np.bool_(True), complex(1, 0), float("nan"), 2**64, np.array([1, 2]),
                     np.array(3), "x" * 10_000]),
)


@fuzz_settings(max_examples=300, deadline_s=5)
@given(st.dictionaries(st.one_of(st.sampled_from([*FIELDS, "name", "description"]), st.text(max_size=8)),
                       PY_VALUES, min_size=1, max_size=3))
# Found by this test: a name Python cannot print (an int of 5,001 digits) raised ValueError from
# the message meant to refuse it.
@example({"name": 10**5000})
@example({"description": 10**5000})
def test_replace_with_python_values(overrides):
    with time_limit(20, "ChipSpec.replace"):
        result = call(TINY.replace, **overrides)
    if isinstance(result, EmuError):
        assert isinstance(result, ConfigError), repr(result)
        event("refused")
        return
    event("accepted")
    _assert_usable(result)
    for key, value in overrides.items():
        # An int given for a float field is stored as that float (==); nothing else is converted.
        stored = getattr(result, key) if key in ("name", "description") else result.get(key)
        assert stored == value, (key, stored, value)


@fuzz_settings(max_examples=100, deadline_s=5)
@given(st.one_of(st.sampled_from(["public", "assumed", "derived"]), PY_VALUES, st.text(max_size=8)),
       st.one_of(st.text(max_size=8), PY_VALUES))
# The same unprintable int as a note, and an array as the kind (`in` a tuple compares with ==).
@example(kind="assumed", note=10**5000)
@example(kind=np.array(["public", "assumed"]), note="x")
def test_provenance_and_specs_built_directly(kind, note):
    # The constructors a script calls: Provenance, and ChipSpec through dataclasses.replace (its
    # provenance mapping given whole).
    prov = call(Provenance, kind=kind, note=note)
    if isinstance(prov, EmuError):
        assert isinstance(prov, ConfigError), repr(prov)
        return
    for provenance in ({**TINY.provenance, "core.count": prov}, {"core.count": prov}, [prov], None, prov):
        spec = call(dataclasses.replace, TINY, provenance=provenance)
        if isinstance(spec, EmuError):
            assert isinstance(spec, ConfigError), repr(spec)
        else:
            _assert_usable(spec)


@fuzz_settings(max_examples=150, deadline_s=5)
@given(st.one_of(st.text(max_size=20), st.sampled_from([*list_presets(), "TINY", "tiny ", "tiny.toml",
                                                        "jalapeno-v2", "./tiny", "", ".", "..", "~"])))
def test_preset_names(name):
    result = call(load_preset, name)
    if isinstance(result, EmuError):
        assert isinstance(result, ConfigError), repr(result)
    else:
        _assert_usable(result)


# TOML values to put where a preset has one: numbers, unit strings, the wrong TOML types, values
# tomllib itself cannot build (an int of 5,000 digits) or builds as infinity (1e1000000).
TOML_VALUES = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    VALUE_TEXT.map(json.dumps),
    st.sampled_from(["true", "false", "nan", "inf", "-inf", "1e1000000", "9" * 5000, "[]", "[1, 2]", "{}",
                     '{ value = 1 }', "1979-05-27", "0x10", "0o17", "0b11", "1_000", '"""x"""', "'raw'"]),
)


@st.composite
def preset_files(draw: st.DrawFn) -> str:
    """A shipped preset's TOML after one to four edits: a value, a provenance note, a key, a whole
    line or the ``inherits`` line changed, dropped, duplicated or replaced by junk."""
    lines = PRESET_TEXT[draw(st.sampled_from(sorted(PRESET_TEXT)))].splitlines()
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(lines) - 1))
        line = lines[i]
        op = draw(st.sampled_from(["value", "value", "note", "key", "drop", "dup", "junk", "inherits"]))
        if op == "value" and "value = " in line:
            head, _, rest = line.partition("value = ")
            tail = rest[rest.find(", "):] if ", " in rest else " }"
            lines[i] = f"{head}value = {draw(TOML_VALUES)}{tail}"
        elif op == "note" and "{" in line:
            kind = draw(st.sampled_from(["public", "assumed", "derived", 'public = "a", assumed', "source"]))
            note = json.dumps(draw(st.text(max_size=5)))
            lines[i] = f"{line.split('=')[0]}= {{ value = 1, {kind} = {note} }}"
        elif op == "key" and "=" in line:
            lines[i] = draw(KEYS).replace(".", "_") + " =" + line.split("=", 1)[1]
        elif op == "drop":
            del lines[i]
        elif op == "dup":
            lines.insert(i, line)
        elif op == "junk":
            lines.insert(i, draw(st.text(max_size=20)))
        else:
            target = draw(st.sampled_from(["self.toml", "jalapeno-v1", "tiny", "missing.toml", "bogus",
                                           ".", "sub/", "../self.toml", "", "1"]))
            lines.insert(0, f"inherits = {json.dumps(target)}")
    return "\n".join(lines)


@fuzz_settings(max_examples=150, deadline_s=10)
@given(preset_files())
def test_preset_files(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "self.toml"
        path.write_text(text, encoding="utf-8")
        (Path(tmp) / "sub").mkdir()
        with time_limit(20, "load_preset"):
            result = call(load_preset, str(path))
    if isinstance(result, EmuError):
        assert isinstance(result, ConfigError), repr(result)
        event("refused")
        return
    event("accepted")
    _assert_usable(result)


# The shipped example, assembled: a program to time on every spec the overrides accept.
EXAMPLE = assemble((ROOT / "examples" / "asm" / "tile_matmul.jasm").read_text())


@fuzz_settings(max_examples=60, deadline_s=20)
@given(st.lists(in_range_override(), min_size=1, max_size=6))
def test_accepted_specs_check_and_time_kernels(items):
    # Issue 13: values that passed validation and then crashed a cost model with ValueError /
    # OverflowError, or ran without end. Whatever is accepted must time a program in bounded time.
    result = call(apply_overrides, TINY, items)
    if isinstance(result, EmuError):
        assert isinstance(result, ConfigError), repr(result)
        event("refused (a relation between fields)")
        return
    event("accepted")
    _assert_usable(result)
    with time_limit(60, f"timing on {items}"):
        timeline = call(run_timing, EXAMPLE, result)
        report = call(run_kernel, "rmsnorm", {"tokens": 2, "hidden": 64}, preset=result)
    event(f"example {'refused' if isinstance(timeline, EmuError) else 'timed'}, "
          f"kernel {'refused' if isinstance(report, EmuError) else 'timed'}")
    # The example fits tiny, so a larger chip runs it; the kernel may be refused (a spec with
    # too little scratchpad for its tiles), but in the project's words.
    for summary in (getattr(timeline, "summary", lambda: None)(), getattr(report, "summary", None)):
        if summary is not None:
            json.dumps(summary, allow_nan=False, default=str)
            assert summary["time_s"] > 0, summary


def test_the_unedited_presets_load():
    # The file mutations start from these two; both must take the success path.
    for text in PRESET_TEXT.values():
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "self.toml"
            path.write_text(text, encoding="utf-8")
            _assert_usable(load_preset(str(path)))
