"""``jalapeno-emu bench hbm|mxu`` in-process: the JSON schema, the table, one-line errors (exit 2)."""

import json

import pytest

from jalapeno_emu.cli.main import main

HBM_KEYS = {"schema_version", "command", "preset", "chip", "overrides", "bytes", "time_s", "launch_s",
            "achieved", "peak", "utilization", "achievable", "utilization_of_achievable", "efficiency",
            "descriptors", "dma_queues", "channel_utilization", "bound", "unit"}
MXU_KEYS = {"schema_version", "command", "preset", "chip", "overrides", "shape", "flops", "time_s",
            "launch_s", "achieved", "peak", "utilization", "matmuls", "bound", "unit"}


def test_bench_hbm_json_on_tiny(capsys):
    assert main(["bench", "hbm", "--preset", "tiny", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == HBM_KEYS
    assert doc["schema_version"] == 1 and doc["command"] == "bench hbm" and doc["preset"] == "tiny"
    assert doc["bytes"] == 32 << 20  # half of tiny's 64 MiB
    assert doc["utilization"] == pytest.approx(doc["achieved"] / doc["peak"])
    assert doc["utilization_of_achievable"] == pytest.approx(1.0, abs=0.03)
    assert doc["bound"] == "hbm"


def test_bench_hbm_overrides_change_the_answer(capsys):
    assert main(["bench", "hbm", "--preset", "tiny", "--set", "hbm.efficiency=0.5", "--bytes", "8MiB",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["overrides"] == ["hbm.efficiency=0.5"] and doc["bytes"] == 8 << 20
    assert doc["utilization"] == pytest.approx(0.5, abs=0.03)


def test_bench_mxu_json_and_table(capsys):
    assert main(["bench", "mxu", "--preset", "tiny", "--shape", "1024x1024x1024", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == MXU_KEYS and doc["command"] == "bench mxu"
    assert doc["flops"] == 2 * 1024**3 and doc["shape"] == [1024, 1024, 1024]
    assert 0.5 < doc["utilization"] <= 1.0
    assert main(["bench", "mxu", "--preset", "tiny", "--shape", "1024x1024x1024"]) == 0
    out = capsys.readouterr().out
    for text in ("bench mxu on tiny", "peak MXFP4", "utilization", "FLOP/s"):
        assert text in out, text


def test_bench_hbm_v1_default_is_a_4_gib_stream_near_achievable(capsys):
    assert main(["bench", "hbm", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["preset"] == "jalapeno-v1" and doc["bytes"] == 4 << 30
    assert doc["achieved"] == pytest.approx(0.9 * 15.4e12, rel=0.03)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "hbm", "--preset", "jalapeno-v9"], "unknown chip preset 'jalapeno-v9'"),
        (["bench", "mxu", "--set", "hbm.eficiency=0.9"], "did you mean hbm.efficiency"),
        (["bench", "hbm", "--set", "hbm.efficiency=2"], "hbm.efficiency must be in (0, 1]"),
        (["bench", "hbm", "--preset", "tiny", "--bytes", "lots"], "--bytes expects a number"),
        (["bench", "hbm", "--preset", "tiny", "--bytes", "1GiB"], "--bytes must be a positive multiple"),
        (["bench", "mxu", "--shape", "12x12"], "--shape must look like MxNxK"),
        (["bench", "mxu", "--preset", "tiny", "--shape", "100x100x100"], "must be a multiple of the block"),
        (["bench"], "the following arguments are required"),
    ],
)
def test_bench_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2
