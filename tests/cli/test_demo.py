"""The CLI in-process: demo output, JSON schema, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from jalapeno_emu.cli.main import main


def test_demo_json_has_every_scale_mode_and_sane_numbers(capsys):
    assert main(["demo", "--numerics", "--rows", "64", "--cols", "48", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and doc["command"] == "demo --numerics"
    assert [r["scale_mode"] for r in doc["results"]] == ["floor", "ceil", "even", "rceil"]
    for r in doc["results"]:
        # 64*48 codes at 4 bits + 2*48 scale bytes
        assert r["packed_bytes"] == 64 * 48 // 2 + 2 * 48
        assert 8 < r["snr_db"] < 30 and 0.9 < r["cosine_similarity"] <= 1
        assert r["quantize_s"] > 0 and r["dequantize_s"] > 0
    ceil = next(r for r in doc["results"] if r["scale_mode"] == "ceil")
    assert ceil["saturated_fraction"] == 0  # ceil leaves headroom: nothing clips


def test_demo_table_names_the_scale_rules(capsys):
    assert main(["demo", "--numerics", "--rows", "32", "--cols", "8"]) == 0
    out = capsys.readouterr().out
    for word in ("floor", "ceil", "even", "rceil", "SNR"):
        assert word in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--numerics", "--fmt", "e9m9"], "--fmt='e9m9' is not an MX element format"),
        (["demo", "--numerics", "--rows", "30"], "--rows must be a positive multiple of 32"),
        (["demo", "--numerics", "--rows", "abc"], "invalid int value"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_user_errors_print_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.strip().count("\n") == 0


def test_console_script_module_runs_as_a_process():
    argv = [sys.executable, "-m", "jalapeno_emu.cli.main", "demo", "--numerics", "--fmt", "bad"]
    proc = subprocess.run(argv,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_the_demo_rack_section_estimates_both_concurrencies():
    """The demo's third section, as it runs it: gpt-oss-120b on jalapeno-v1 racks at 8k/1k, the
    rack grid's fused parts timed on the die (a deadlock there once failed the whole demo)."""
    from jalapeno_emu.rack.deployment import rack_estimate

    points = rack_estimate("gpt-oss-120b", "jalapeno-v1", 8192, 1024, (1, 64), disk_cache=False)
    assert [p["concurrency"] for p in points] == [1, 64]
    for p in points:
        assert p["tpot_s"] > 0 and p["ttft_s"] > 0 and p["chips"] >= 1
    assert points[1]["throughput_tok_s_per_chip"] > points[0]["throughput_tok_s_per_chip"]
