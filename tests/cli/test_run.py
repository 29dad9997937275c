"""``jalapeno-emu run``: the example assembly runs end to end; bad files give one line and exit 2."""

import json
from pathlib import Path

import numpy as np
import pytest

from jalapeno_emu.cli.main import main
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.isa.asm import assemble

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "asm" / "tile_matmul.jasm"


def test_run_example_json_and_trace(tmp_path, capsys):
    trace = tmp_path / "t.json"
    assert main(["run", str(EXAMPLE), "--trace", str(trace), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["command"] == "run" and doc["instructions"] == 14
    t = doc["timing"]
    assert t["time_s"] >= t["lower_bound_s"] > 0 and t["bound"] == "latency"
    assert set(doc["functional"]) == {"A", "A_scale", "B", "B_scale", "C"}
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("ph") == "X" for e in events) == 14


def test_example_result_matches_mx_matmul():
    from jalapeno_emu import mx

    prog = assemble(EXAMPLE.read_text(), source=EXAMPLE.name)
    res = run_functional(prog)
    a_codes = res.read("A", "fp4", (32, 128))[:, :64]
    a_scales = res.read("A_scale", "e8m0", (32, 4))[:, :2]
    b_codes, b_scales = res.read("B", "fp4", (64, 32)), res.read("B_scale", "e8m0", (2, 32))
    a = mx.MXArray(codes=a_codes, scales=a_scales, fmt="e2m1", axis=1, block_size=32)
    b = mx.MXArray(codes=b_codes, scales=b_scales, fmt="e2m1", axis=0, block_size=32)
    want = np.asarray(mx.matmul(a, b)).astype(res.read("C", "bf16", (32, 32)).dtype)
    got = res.read("C", "bf16", (32, 32))
    assert np.array_equal(got, want) and np.abs(got.astype(np.float32)).max() > 1


def test_binary_program_runs_too(tmp_path, capsys):
    out = tmp_path / "k.bin"
    assert main(["asm", str(EXAMPLE), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", str(out), "--timing-only", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["functional"] is None and doc["instructions"] == 14


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00\x01\x02garbage", "binary file without the JEMU header"),
        (b"JEMU\x01", "bad.jasm: byte 4: truncated"),
        (b"c0.mxu: mxu.frobnicate 1\n", "mxu.frobnicate"),
        (b"c0.vpu: sem.wait 0, 1\n", "no engine can make progress"),
    ],
    ids=["binary", "truncated-bin", "bad-mnemonic", "deadlock"],
)
def test_bad_programs_exit_2_with_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "bad.jasm"
    path.write_bytes(content)
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_file_and_directory(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.jasm")]) == 2
    assert main(["run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "is a directory" in err


@pytest.mark.parametrize(
    ("item", "message"),
    [  # issue 13: these passed validation, then the cost model raised ValueError/OverflowError
        ("matrix.tile_m=1e300", "matrix.tile_m must be <= 4,096"),
        ("hbm.stacks=1e300", "hbm.stacks must be <= 64"),
        ("dma.max_outstanding_per_queue=9223372036854775808",
         "dma.max_outstanding_per_queue must be <= 4,096"),
    ],
)
def test_a_chip_field_past_its_limit_stops_before_the_run(capsys, item, message):
    assert main(["run", str(EXAMPLE), "--set", item]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and message in captured.err
    assert captured.err.strip().count("\n") == 0 and "Traceback" not in captured.err
