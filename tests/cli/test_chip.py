"""``jalapeno-emu chip show`` in-process: tables, the JSON schema, overrides, one-line errors."""

import json

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
