"""``jalapeno-emu chip show`` in-process: tables, the JSON schema, overrides, one-line errors."""

import json
import math

import pytest

from jalapeno_emu.cli.main import main

DERIVED_KEYS = (
    "peak_mxfp4_flops_per_s", "peak_mxfp8_flops_per_s", "peak_bf16_flops_per_s", "hbm_bytes_per_s",
    "hbm_achievable_bytes_per_s", "hbm_capacity_bytes", "hbm_pseudo_channels", "sram_total_bytes",
    "link_bytes_per_s_per_direction",
)


def test_chip_show_json_has_spec_provenance_and_derived(capsys):
    assert main(["chip", "show", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and doc["command"] == "chip show"
    assert doc["preset"] == "jalapeno-v1" and doc["overrides"] == []
    assert doc["spec"]["hbm"]["stacks"] == 6 and doc["spec"]["core"]["clock_hz"] == 1.6e9
    assert doc["provenance"]["hbm.stacks"]["kind"] == "public"
    assert doc["provenance"]["hbm.efficiency"] == {"kind": "assumed", "note": doc["provenance"][
        "hbm.efficiency"]["note"]}
    for key in DERIVED_KEYS:
        assert key in doc["derived"], key
    assert doc["derived"]["hbm_capacity_bytes"] == 216 * 2**30
    assert doc["derived"]["peak_mxfp4_flops_per_s"] == pytest.approx(13.3e15, rel=0.02)
    assert doc["units"]["hbm.latency_s"] == "s"


def test_chip_show_applies_overrides(capsys):
    assert main(["chip", "show", "tiny", "--set", "hbm.efficiency=0.5", "--set", "core.count=4",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["preset"] == "tiny" and doc["overrides"] == ["hbm.efficiency=0.5", "core.count=4"]
    assert doc["spec"]["core"]["count"] == 4
    assert doc["provenance"]["hbm.efficiency"] == {"kind": "assumed", "note": "override"}
    derived = doc["derived"]
    assert derived["hbm_achievable_bytes_per_s"] == pytest.approx(0.5 * derived["hbm_bytes_per_s"])


def test_chip_show_tables_have_units_and_provenance(capsys):
    assert main(["chip", "show"]) == 0
    out = capsys.readouterr().out
    for text in ("1.60 GHz", "8.00 MiB", "40.1 GB/s", "216 GiB", "15.4 TB/s", "13.4 PFLOP/s",
                 "public", "assumed", "derived", "derived totals", "Hot Chips 2026"):
        assert text in out, text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["chip", "show", "jalapeno-v9"], "unknown chip preset 'jalapeno-v9'"),
        (["chip", "show", "--set", "hbm.eficiency=0.9"], "did you mean hbm.efficiency"),
        (["chip", "show", "--set", "hbm.efficiency=1.5"], "hbm.efficiency must be in (0, 1], found 1.5"),
        (["chip", "show", "--set", "core.count=many"], "core.count expects a number"),
        (["chip", "show", "--set", "core.count"], "must look like key=value"),
        (["chip"], "the following arguments are required"),
    ],
)
def test_chip_errors_print_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err
    assert captured.err.strip().count("\n") == 0 and captured.out == ""


# --- issue 13: huge values are one-line errors, and JSON never carries Infinity ------------------

@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("core.clock_hz=1e1000000", "core.clock_hz is too large: '1e1000000' is beyond any finite number"),
        ("hbm.stacks=1e300", "hbm.stacks must be <= 64 (the largest packages carry 8 to 12 stacks), found an "
                             "integer of 301 digits"),
        ("matrix.tile_m=1e300", "matrix.tile_m must be <= 4,096 ("),
        ("matrix.tile_k=1e18", "matrix.tile_k must be <= 4,096 ("),
        ("dma.max_outstanding_per_queue=9223372036854775808",
         "dma.max_outstanding_per_queue must be <= 4,096 ("),
        ("core.count=9223372036854775808", "core.count must be <= 4,096 ("),
        ("hbm.bytes_per_s_per_pseudo_channel=1e-300", "must be >= 1 B/s (times and totals divide by it)"),
    ],
)
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_values_past_a_limit_are_one_line_errors(capsys, item, message, json_flag):
    assert main(["chip", "show", "tiny", "--set", item, *json_flag]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and message in captured.err, captured.err
    assert captured.err.strip().count("\n") == 0 and captured.out == ""


def test_a_huge_value_in_a_preset_file_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "fast.toml"
    path.write_text('inherits = "tiny"\n[core]\nclock_hz = { value = "1e1000000", assumed = "what if" }\n')
    assert main(["chip", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: core.clock_hz is too large") and err.strip().count("\n") == 0


def _strict_json(text: str) -> dict:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("end", ["maximum", "minimum"])
def test_chip_show_json_at_every_limit_is_strict_json(capsys, end):
    from jalapeno_emu.chip import FIELDS

    sets = []
    for path, info in FIELDS.items():
        bound = getattr(info.limit, end) if info.limit is not None else None
        if bound is not None:
            sets += ["--set", f"{path}={info.type(bound)}"]
    assert main(["chip", "show", "tiny", *sets, "--json"]) == 0
    doc = _strict_json(capsys.readouterr().out)
    assert all(math.isfinite(v) for v in doc["derived"].values())
