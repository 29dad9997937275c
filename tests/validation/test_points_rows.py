"""The packaged CSV and the row classification, on the real 61 rows."""

from collections import Counter

import pytest

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.validation.points import load_points
from jalapeno_emu.validation.rows import CLASSES, model_config, plan_row
from jalapeno_emu.validation.run import parse_rows


@pytest.fixture(scope="module")
def plans():
    return [plan_row(p) for p in load_points()]


def test_the_packaged_csv_is_the_shared_one_with_its_provenance():
    points = load_points()
    assert len(points) == 61 and [p.row for p in points] == list(range(1, 62))
    first = points[0]
    assert (first.hardware, first.model, first.isl, first.osl, first.concurrency) == (
        "B200", "DeepSeek-R1-0528", 8192, 1024, 1691)
    assert first.tok_s_user == 29.85 and first.tput_per_gpu == 13429.7 and first.e2e_s is None
    assert all(p.source for p in points)
    assert points[12].concurrency is None and points[12].measured() == {"tput_per_gpu": 5856.9}


def test_every_row_has_a_class_and_no_row_is_dropped(plans):
    assert len(plans) == 61 and all(p.cls in CLASSES for p in plans)
    counts = Counter(p.cls for p in plans)
    # 5 without a concurrency; 13 disaggregated, MTP-on or FP8-expert rows
    assert counts == {"fit": 43, "predicted-only": 13, "not-predicted": 5}
    for p in plans:
        assert (p.cls == "fit") == (not p.reasons), p.point.row


def test_hardware_maps_to_presets_keeping_the_row_caveat(plans):
    by_row = {p.point.row: p for p in plans}
    assert {p.preset for p in plans} == {"b200", "h100", "h200", "mi300x", "mi325x", "mi355x"}
    nv = by_row[38]  # "NVIDIA (label 'nv1126'; most likely B200 8-GPU, TP8 inferred)"
    assert nv.preset == "b200" and "not stated" in nv.hardware_note and "most likely B200" in nv.hardware_note
    b = by_row[31]  # "B200 (8-GPU node; TP8 inferred from tput/intvty ratio)"
    assert b.preset == "b200" and "TP8 inferred" in b.hardware_note and b.mapping == "tp=8"
    assert by_row[53].mapping == "tp=8"  # "vllm v0.17.0 ROCm, TP8" in the framework column
    assert by_row[17].mapping is None  # the best mapping is searched


def test_precisions_map_to_formats_and_say_how(plans):
    by_row = {p.point.row: p for p in plans}
    int4 = by_row[58]  # Kimi INT4 on H200
    assert int4.expert_weight_fmt == "fp4" and "INT4" in int4.format_note and int4.cls == "fit"
    nvfp4 = by_row[56]
    assert nvfp4.expert_weight_fmt == "fp4" and "NVFP4" in nvfp4.format_note
    fp8 = by_row[4]  # DeepSeek FP8 on MI325X, aggregated sglang: the MoE kernel cannot read FP8 experts
    assert (fp8.expert_weight_fmt, fp8.weight_fmt, fp8.cls) == ("fp8e4", "fp8e4", "predicted-only")
    cfg = model_config(fp8)
    assert (cfg.expert_weight_fmt, cfg.weight_fmt, cfg.name) == ("fp8e4", "fp8e4", "deepseek-r1")


def test_disaggregated_and_mtp_rows_are_predicted_only_with_the_reason(plans):
    by_row = {p.point.row: p for p in plans}
    assert by_row[1].cls == "predicted-only" and "disaggregated" in by_row[1].reasons[0]
    assert by_row[55].cls == "predicted-only" and any("multi-token" in r for r in by_row[55].reasons)
    assert by_row[14].cls == "not-predicted" and by_row[14].reasons == ("the source gives no concurrency",)


def test_row_selection():
    assert parse_rows("3-5,1,4", 61) == [3, 4, 5, 1]
    for bad in ("0-2", "60-62", "x", "5-3"):
        with pytest.raises(InvalidArgumentError, match="--rows"):
            parse_rows(bad, 61)
