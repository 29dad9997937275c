"""The validate pipeline end to end: orchestration with a stand-in prediction of known answer, one
real (cheap) run of rows that cannot be predicted, and the CLI contract."""

import json
import math

import numpy as np
import pytest

from jalapeno_emu.cli.main import main
from jalapeno_emu.validation import run as vrun
from jalapeno_emu.validation.points import METRICS
from jalapeno_emu.validation.retime import DEFAULT_GRID


def _stand_in(plan, spec, mapping=None):
    """Exact at hbm.efficiency 0.75 and the preset's launch cost; error grows away from them."""
    m = plan.point.measured()
    base = spec.name.split("~")[0]
    # Other knob settings serve the mapping found at the preset's own values.
    assert (mapping == "tp=8") == ("~" in spec.name)
    from jalapeno_emu.chip import load_preset

    launch_scale = spec.sync.kernel_launch_s / load_preset(base).sync.kernel_launch_s
    f = spec.hbm.efficiency / 0.75 * (1 + 0.1 * abs(math.log2(launch_scale)))
    return "tp=8", np.array([m.get(c, 1.0) * f for c in METRICS])


def test_calibration_finds_the_known_setting_and_reports_every_row(monkeypatch):
    monkeypatch.setattr(vrun, "_predict_row", _stand_in)
    rows = [17, 19, 22, 25, 27, 1, 14]  # NVIDIA fit rows, one disaggregated, one without concurrency
    doc = vrun.run_validation(rows)
    s = doc["summary"]
    nv = s["families"]["nvidia"]
    assert nv["setting"]["hbm_efficiency"] == 0.75 and nv["setting"]["launch_scale"] == 1.0
    assert nv["mape_before"] == pytest.approx(0.2)  # 0.9 / 0.75 - 1 on every metric
    assert nv["mape_after"] == pytest.approx(0.0) and nv["loo_mape"] == pytest.approx(0.0)
    assert nv["knobs"]["b200"]["hbm.efficiency"] == 0.75
    assert nv["knobs"]["h100"]["sync.kernel_launch_s"] == pytest.approx(1.3e-6)
    assert s["mape_fit"]["rows"] == 5 and s["mape_fit"]["after"] == pytest.approx(0.0)
    assert s["classes"] == {"fit": 5, "predicted-only": 1, "not-predicted": 1}
    po = s["mape_predicted_only"]
    assert po["rows"] == 1 and po["before"] == pytest.approx(0.2) and po["after"] == pytest.approx(0.0)
    by_row = {r["row"]: r for r in doc["rows"]}
    assert [r["row"] for r in doc["rows"]] == rows
    assert by_row[17]["error"]["tok_s_user"] == pytest.approx(0.2)
    assert by_row[17]["error_calibrated"]["tput_per_gpu"] == pytest.approx(0.0)
    assert by_row[14]["class"] == "not-predicted" and "predicted" not in by_row[14]
    assert len(doc["grid"]) == len(DEFAULT_GRID)
    # each metric's own medians and worst left-out row, and each fit row's left-out error
    tput = s["per_metric"]["tput_per_gpu"]
    assert tput["median_before"] == pytest.approx(0.2) and tput["median_after"] == pytest.approx(0.0)
    assert tput["median_loo"] == pytest.approx(0.0) and tput["rows"] >= 1
    assert tput["worst_loo_row"] in rows and tput["worst_loo"] == pytest.approx(0.0)
    assert by_row[17]["error_loo"]["tput_per_gpu"] == pytest.approx(0.0)


def test_a_failing_prediction_is_not_predicted_with_its_one_line_reason(monkeypatch):
    from jalapeno_emu.rack.mapping import FitError

    def refuse(plan, spec, mapping=None):
        raise FitError(f"{plan.model} on {spec.name}: 1,000.0 GB of weights exceed\n 180.0 GB")

    monkeypatch.setattr(vrun, "_predict_row", refuse)
    doc = vrun.run_validation([17], calibrate=False)
    r = doc["rows"][0]
    assert r["class"] == "not-predicted" and r["reasons"] == [
        "gpt-oss-120b on b200: 1,000.0 GB of weights exceed 180.0 GB"]
    assert doc["summary"]["classes"]["not-predicted"] == 1


def test_cli_json_and_errors(capsys):
    assert main(["validate", "--rows", "13-16", "--no-calibrate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["command"] == "validate" and len(doc["rows"]) == 4
    assert all(r["class"] == "not-predicted" for r in doc["rows"])
    assert doc["summary"]["mape_fit"]["before"] is None  # no fit row: NaN is written as null
    assert main(["validate", "--rows", "99"]) == 2
    err = capsys.readouterr().err
    assert "outside rows 1..61" in err and len(err.strip().splitlines()) == 1
    assert main(["validate", "--rows", "14", "--mtp", "1", "--mtp-acceptance", "0.9,0.8"]) == 2
    err = capsys.readouterr().err
    assert "2 mtp acceptance values for 1 draft tokens" in err and len(err.strip().splitlines()) == 1


def test_rows_on_threads_give_the_serial_report(monkeypatch):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from jalapeno_emu.errors import InvalidArgumentError
    from jalapeno_emu.rack.mapping import FitError

    def flaky(plan, spec, mapping=None):
        row = plan.point.row
        if row == 19 and "~" not in spec.name:  # at the preset's own knobs: the row is not predicted
            raise FitError(f"row {row} does not fit {spec.name}")
        if row == 22 and "hbm=0.6" in spec.name:  # at some settings only: NaN there
            raise InvalidArgumentError(f"row {row} refused on {spec.name}")
        if row == 1 and "~" in spec.name:  # the predicted-only row at the calibrated knobs
            raise InvalidArgumentError(f"row {row} refused on {spec.name}")
        return _stand_in(plan, spec, mapping)

    monkeypatch.setattr(vrun, "_predict_row", flaky)
    rows = [17, 19, 22, 25, 27, 1, 14]

    def run(executor=None):
        planned, labels, threads = [], [], set()

        def progress(label):
            labels.append(label)
            threads.add(threading.get_ident())

        doc = vrun.run_validation(rows, executor=executor, on_plan=planned.append, progress=progress)
        assert threads == {threading.get_ident()}  # progress is reported in the calling thread
        doc.pop("wall_s")
        return json.dumps(doc), planned, sorted(labels)  # JSON text: NaN compares equal to NaN

    serial = run()
    with ThreadPoolExecutor(2) as pool:
        assert run(pool) == serial
    doc = json.loads(serial[0])
    by_row = {r["row"]: r for r in doc["rows"]}
    assert by_row[19]["class"] == "not-predicted" and by_row[19]["reasons"] == ["row 19 does not fit h200"]
    assert by_row[1]["reasons"][-1].startswith("at the calibrated knobs: row 1 refused on")
    assert doc["summary"]["families"]["nvidia"]["setting"]["hbm_efficiency"] == 0.75
    # one label per prediction attempted: row 19 stops at its first, the others try every setting
    assert len(serial[2]) == 4 * len(DEFAULT_GRID) + 1 + 1


def test_rows_are_predicted_with_their_frameworks_stack_and_mtp(monkeypatch):
    from jalapeno_emu.serving.speculative import speculation

    seen = {}

    def record(plan, spec, mapping=None):
        seen[plan.point.row] = (plan.stack, plan.speculation)
        return "tp=8", np.array([plan.point.measured().get(c, 1.0) for c in METRICS])

    monkeypatch.setattr(vrun, "_predict_row", record)
    # row 55: Kimi K2.5 on MI355X with vLLM and MTP on; row 17: B200 with TensorRT-LLM, MTP off
    doc = vrun.run_validation([55, 17], calibrate=False)
    assert seen[17] == ("trtllm", None)
    assert seen[55] == ("vllm", vrun.DEFAULT_MTP) and vrun.DEFAULT_MTP.draft_tokens == 1
    by_row = {r["row"]: r for r in doc["rows"]}
    assert by_row[55]["mtp_predicted"]["draft_tokens"] == 1 and by_row[17]["mtp_predicted"] is None
    assert by_row[17]["stack"] == "trtllm"
    assert any("multi-token prediction on" in reason for reason in by_row[55]["reasons"])
    vrun.run_validation([55], calibrate=False, mtp=speculation(2, 0.7))
    assert seen[55][1].draft_tokens == 2
    vrun.run_validation([55], calibrate=False, mtp=None)
    assert seen[55][1] is None


def test_predict_row_serves_the_rows_stack_and_mtp(monkeypatch):
    from jalapeno_emu.chip import load_preset
    from jalapeno_emu.validation.points import load_points
    from jalapeno_emu.validation.rows import plan_row

    calls = []

    from types import SimpleNamespace

    class _Pred:
        mapping = SimpleNamespace(name="tp=8")

        def as_dict(self):
            return dict.fromkeys(METRICS.values(), 1.0)

    def fake_predict(cfg, spec, *args, **kwargs):
        calls.append((spec.software.stack, kwargs["speculation"]))
        return _Pred()

    monkeypatch.setattr(vrun, "predict", fake_predict)
    points = load_points()
    vrun._predict_row(plan_row(points[16]), load_preset("b200"))  # row 17: trt
    vrun._predict_row(plan_row(points[54]), load_preset("mi355x"))  # row 55: vllm, MTP on
    assert calls[0] == ("trtllm", None)
    assert calls[1][0] == "vllm" and calls[1][1].draft_tokens == 1


def test_per_metric_medians_and_the_worst_left_out_row():
    nan = float("nan")
    before = np.array([[0.1, -0.5, nan], [0.3, 0.2, 0.4], [-0.2, 0.1, nan]])
    loo = np.array([[0.05, -0.6, nan], [-0.3, 0.1, 0.2], [0.1, 0.0, nan]])
    out = vrun._per_metric(before, before / 2, loo, [7, 9, 11])
    first, second, third = (out[c] for c in vrun._COLS)
    assert first["median_before"] == pytest.approx(0.2) and first["median_after"] == pytest.approx(0.1)
    assert first["median_loo"] == pytest.approx(0.1) and first["worst_loo_row"] == 9
    assert first["worst_loo"] == pytest.approx(-0.3)
    assert second["worst_loo_row"] == 7 and second["worst_loo"] == pytest.approx(-0.6)
    assert third["rows"] == 1 and third["worst_loo_row"] == 9  # rows with nothing measured left out
    assert vrun._per_metric(before, None, None, [])[vrun._COLS[0]].keys() == {"field", "median_before"}
