"""``kernel list`` and ``kernel NAME``: JSON fields, check results, one-line errors."""

import json

from jalapeno_emu.cli.main import main


def test_kernel_list_json(capsys):
    assert main(["kernel", "list", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    names = {k["name"] for k in doc["kernels"]}
    assert "rmsnorm" in names
    assert all(k["shape"] for k in doc["kernels"])


def test_kernel_check_json_has_the_contract_fields(capsys, tmp_path):
    trace = tmp_path / "t.json"
    assert main(["kernel", "rmsnorm", "--shape", "tokens=4", "--check", "--json",
                 "--trace", str(trace)]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("time_s", "hbm_bytes", "flops", "hbm_utilization", "mxu_utilization", "bound",
                "max_abs_error", "max_rel_error", "tolerance", "passed"):
        assert key in doc, key
    assert doc["passed"] is True and json.loads(trace.read_text())["traceEvents"]


def test_kernel_errors_exit_2(capsys):
    assert main(["kernel", "nope"]) == 2
    assert main(["kernel", "rmsnorm", "--shape", "tokens=x"]) == 2
    err = capsys.readouterr().err
    assert "no kernel named 'nope'" in err and "tokens='x' is not a valid int" in err


def test_kernel_timing_only_skips_the_functional_run(capsys):
    assert main(["kernel", "rmsnorm", "--timing-only", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "passed" not in doc and doc["time_s"] >= doc["lower_bound_s"] > 0


def test_a_long_run_warns_on_stderr_and_points_at_timing_only(capsys, monkeypatch):
    from jalapeno_emu.cli import kernel as kernel_cli

    monkeypatch.setattr(kernel_cli, "LONG_RUN_INSTRUCTIONS", 10)  # rmsnorm has a few dozen
    assert main(["kernel", "rmsnorm", "--shape", "tokens=4", "--check", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["passed"] is True  # stdout is still only the JSON
    assert "instructions" in err and "--timing-only" in err
    assert err.count("--timing-only") == 1  # once, not once per pass
    # without --json the same run also draws the (transient) progress bars on stderr
    assert main(["kernel", "rmsnorm", "--shape", "tokens=4", "--check"]) == 0
    assert "--timing-only gives" in capsys.readouterr().err
    # --timing-only runs neither the analysis nor the functional pass: nothing to warn about
    assert main(["kernel", "rmsnorm", "--shape", "tokens=4", "--timing-only"]) == 0
    assert "--timing-only gives" not in capsys.readouterr().err


def test_a_short_run_does_not_warn(capsys):
    assert main(["kernel", "rmsnorm", "--shape", "tokens=4", "--check"]) == 0
    assert "--timing-only" not in capsys.readouterr().err


def _moe_json(capsys, *extra: str) -> dict:
    assert main(["kernel", "moe", "--timing-only", "--json", *extra]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_a_timed_moe_does_the_routed_work_unless_told_otherwise(capsys):
    # tiny default shape: 4 tokens, 8 experts, top-2, hidden = intermediate = 64 (SwiGLU: 3 matmuls)
    routed = 2 * 4 * 2 * 3 * 64 * 64
    router = 2 * 4 * 64 * 8
    doc, _ = _moe_json(capsys)
    assert doc["shape"]["routing"] == "uniform" and doc["flops"] == routed + router
    # asked for: kept, and the worst case is more work
    worst, _ = _moe_json(capsys, "--shape", "routing=any")
    assert worst["shape"]["routing"] == "any" and worst["flops"] > doc["flops"]
    # the tables say which default was taken
    assert main(["kernel", "moe", "--timing-only"]) == 0
    assert "timing-only default routing=uniform" in capsys.readouterr().err
