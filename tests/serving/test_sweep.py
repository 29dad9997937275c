"""Sweeps, Pareto fronts, plots and the CSV/JSON writers."""

from __future__ import annotations

import csv
import json
import os

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.serving import (
    SCHEMA_VERSION,
    pareto_front,
    pareto_fronts,
    plot_pareto,
    point_value,
    power_w_from_spec,
    read_points_json,
    simulate,
    sweep,
    write_points_csv,
    write_points_json,
)
from jalapeno_emu.serving.output import atomic_write

from .models import roofline

WORKLOAD = dict(isl=400, osl=40, requests=12, seed=1)


def _pt(name, x, y, series="s"):
    return {"mapping": name, "series": series, "interactivity_tok_s_user": x, "throughput_tok_s_per_chip": y,
            "tok_s_per_kw": {"package": y / 2}, "concurrency": 1}


def test_pareto_front_by_hand():
    pts = [_pt("a", 10, 100), _pt("b", 20, 90), _pt("c", 15, 80), _pt("d", 30, 50), _pt("e", 5, 100),
           _pt("f", 30, 40), _pt("g", 1, 120), _pt("h", 20, 90), _pt("nan", None, 500)]
    front = pareto_front(pts)
    # c < b on both; e has a's y with less x; f has d's x with less y; h equals b (both kept)
    assert [p["mapping"] for p in front] == ["g", "a", "b", "h", "d"]
    assert [p["mapping"] for p in pareto_front(pts, y="tok_s_per_kw.package")] == ["g", "a", "b", "h", "d"]
    swapped = pareto_front(pts, x="throughput_tok_s_per_chip", y="interactivity_tok_s_user")
    assert [p["mapping"] for p in swapped] == ["d", "b", "h", "a", "g"]
    with pytest.raises(InvalidArgumentError, match=r"tok_s_per_kw\.nope"):
        pareto_front(pts, y="tok_s_per_kw.nope")


def test_pareto_fronts_per_series():
    pts = [_pt("a", 10, 100, "x"), _pt("b", 20, 50, "x"), _pt("c", 5, 10, "y"), _pt("d", 1, 20, "y")]
    fronts = pareto_fronts(pts)
    assert {k: [p["mapping"] for p in v] for k, v in fronts.items()} == {"x": ["a", "b"], "y": ["d", "c"]}


def test_sweep_points_and_frontier_shape():
    models = [roofline(name="tp4"), roofline(name="tp8", chips=8, flops_per_s=8e15, bytes_per_s=4e13)]
    power = power_w_from_spec(load_preset("jalapeno-v1"))
    points = sweep(models, [1, 4, 16], power_w=power, **WORKLOAD)
    assert [(p.mapping, p.concurrency) for p in points] == [
        (m, c) for m in ("tp4", "tp8") for c in (1, 4, 16)]
    # the same point simulated alone gives the same metrics (sweep adds nothing of its own)
    alone = simulate(models[1], concurrency=4, power_w=power, **WORKLOAD)
    assert points[4].metrics == alone
    # more concurrency: more throughput, less interactivity (the trade-off the frontier draws)
    for group in (points[:3], points[3:]):
        tput = [p.metrics.throughput_tok_s_per_chip for p in group]
        inter = [p.metrics.interactivity_tok_s_user for p in group]
        assert tput == sorted(tput) and inter == sorted(inter, reverse=True)
    assert points[0].as_dict()["tok_s_per_kw"]["all_in"] == pytest.approx(
        points[0].metrics.throughput_tok_s_per_chip / 1.18)
    assert point_value(points[0], "tok_s_per_kw.sustained") == pytest.approx(
        points[0].metrics.throughput_tok_s_per_chip / 0.55)


def test_sweep_in_a_process_pool_matches_in_process():
    models = [roofline(name="a"), roofline(name="b", chips=2)]
    local = sweep(models, [2, 8], **WORKLOAD)
    pooled = sweep(models, [2, 8], workers=2, progress=True, **WORKLOAD)
    assert pooled == local


def test_model_power_attribute_used_when_no_power_given():
    class Powered:
        name, chips, kv_capacity_tokens, max_batch_tokens = "p", 1, 10**6, 1024
        series = "chipX"
        def __init__(self):
            self.power_w = {"package": 500.0, "sustained": 400.0, "all_in": 1000.0}

        def step_time_s(self, work):
            return 1e-3 + 1e-6 * work.batch_tokens

    (point,) = sweep([Powered()], [2], **WORKLOAD)
    assert point.series == "chipX"
    assert point.metrics.tok_s_per_kw["all_in"] == pytest.approx(point.metrics.throughput_tok_s_per_chip)


@pytest.mark.parametrize("args, match", [
    (([], [1]), "at least one step model"),
    (([roofline(), roofline()], [1]), "names must be unique"),
    (([roofline()], []), "at least one concurrency"),
    (([roofline()], [0]), "concurrencies must be integers"),
])
def test_sweep_bad_input(args, match):
    with pytest.raises(InvalidArgumentError, match=match):
        sweep(*args, **WORKLOAD)
    with pytest.raises(InvalidArgumentError, match="workers"):
        sweep([roofline()], [1], workers=0, **WORKLOAD)


@pytest.fixture(scope="module")
def points():
    models = [roofline(name="tp4"), roofline(name="tp8", chips=8, flops_per_s=8e15, bytes_per_s=4e13)]
    power = {"package": 700, "sustained": 550, "all_in": 1180}
    return sweep(models, [1, 2, 8, 32], power_w=power, **WORKLOAD)


def test_csv_and_json_round_trip(tmp_path, points):
    write_points_csv(points, tmp_path / "p.csv")
    write_points_json(points, tmp_path / "p.json", meta={"model": "toy", "isl": 400, "osl": 40})
    with open(tmp_path / "p.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(points)
    tput = points[5].metrics.throughput_tok_s_per_chip
    assert float(rows[5]["throughput_tok_s_per_chip"]) == pytest.approx(tput)
    assert float(rows[0]["tok_s_per_kw.all_in"]) == pytest.approx(points[0].metrics.tok_s_per_kw["all_in"])
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and doc["model"] == "toy"
    meta, back = read_points_json(tmp_path / "p.json")
    assert meta == {"model": "toy", "isl": 400, "osl": 40}
    assert back == [p.as_dict() for p in points]
    # the frontier computed from the file equals the one from the objects
    assert [p["concurrency"] for p in pareto_front(back)] == [p.concurrency for p in pareto_front(points)]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_read_rejects_other_documents(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"kind": "jalapeno-emu/serving-sweep", "schema_version": 99}))
    with pytest.raises(InvalidArgumentError, match="schema_version 99"):
        read_points_json(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("[]")
    with pytest.raises(InvalidArgumentError, match="not a serving sweep"):
        read_points_json(tmp_path / "y.json")


def test_plot_files_exist_and_parse(tmp_path, points):
    png, svg = tmp_path / "f.png", tmp_path / "f.svg"
    plot_pareto(points, png, svg, model_name="toy-model", log_x=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and text.rstrip().endswith("</svg>")
    assert "toy-model" in text and "400/40" in text  # the title with model and ISL/OSL
    plot_pareto([p.as_dict() for p in points], None, tmp_path / "kw.svg", y="tok_s_per_kw.all_in")
    assert "all-in" in (tmp_path / "kw.svg").read_text()
    assert sorted(os.listdir(tmp_path)) == ["f.png", "f.svg", "kw.svg"]


def test_plot_bad_input(tmp_path, points):
    with pytest.raises(InvalidArgumentError, match="path_png or path_svg"):
        plot_pareto(points, None, None)
    with pytest.raises(InvalidArgumentError, match="not a field"):
        plot_pareto(points, tmp_path / "a.png", y="watts")
    assert not os.listdir(tmp_path)


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    target = tmp_path / "keep.txt"
    target.write_text("old")

    def broken(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["keep.txt"]
