"""layer / model / generate on the command line: JSON contracts and one-line errors."""

import json

import pytest

from jalapeno_emu.cli.main import main

_FIELDS = {"time_s", "hbm_bytes", "flops", "hbm_utilization", "bound"}


def test_layer_json_has_the_contract_fields_per_layer_and_per_kernel(capsys, tmp_path):
    trace = tmp_path / "layer.json"
    argv = ["layer", "--model", "gpt-oss-20b", "--phase", "decode", "--batch", "2", "--context", "1024",
            "--layer", "1", "--json", "--trace", str(trace)]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["command"] == "layer" and set(doc) >= _FIELDS and doc["kind"] == "full moe"
    assert [k["label"] for k in doc["kernels"]][-1] == "moe"
    for k in doc["kernels"]:
        assert set(k) >= _FIELDS and k["time_s"] > 0
    assert doc["time_s"] == pytest.approx(sum(k["time_s"] for k in doc["kernels"]))
    assert json.loads(trace.read_text())["traceEvents"]


def test_chunked_prefill_layer_sums_its_chunks(capsys):
    assert main(["layer", "--model", "gpt-oss-20b", "--phase", "prefill", "--seq", "256", "--chunk", "128",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["chunks"] == 2 and doc["seq"] == 256
    assert {k["chunk"] for k in doc["kernels"]} == {0, 1}


def test_model_json_reports_a_model_that_does_not_fit(capsys):
    assert main(["model", "--model", "deepseek-r1", "--phase", "decode", "--context", "256", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits_one_die"] is False and doc["time_s"] is None and doc["time_s_unconstrained"] > 0
    assert doc["footprint"]["weight_bytes"] > doc["footprint"]["capacity_bytes"]
    assert [g["count"] for g in doc["layers"]] == [3, 58]


@pytest.mark.parametrize(("argv", "message"), [
    (["layer", "--model", "gpt-oss-12b", "--phase", "decode"], "no model named 'gpt-oss-12b'"),
    (["layer", "--model", "gpt-oss-20b", "--phase", "decode", "--seq", "64"], "--seq and --chunk are for"),
    (["layer", "--model", "gpt-oss-20b", "--phase", "decode", "--layer", "99"], "layer 99 does not exist"),
    (["model", "--model", "gpt-oss-20b", "--phase", "prefill", "--context", "8"], "--context is for"),
    (["generate", "--model", "tiny-gpt-oss", "--tokens", "0"], "tokens=0"),
])
def test_errors_are_one_line_with_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
