"""Timing-only layer and model step times at full size: bounds, reuse of identical layers, fit."""

import json

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.model import Step, footprint, layer_weight_bytes, load_model_config
from jalapeno_emu.model.timing import StepTimer, time_layer, time_model, write_layer_trace

SPEC = load_preset("jalapeno-v1")


@pytest.fixture(scope="module")
def timer():
    return StepTimer(SPEC)


def test_gpt_oss_120b_decode_layer_is_bounded_below_by_its_bytes(timer):
    cfg = load_model_config("gpt-oss-120b")
    lt = time_layer(cfg, 1, Step("decode", batch=1, context=8192), timer=timer, fusion="none")
    labels = [k.label for k in lt.kernels]
    assert labels == ["attn_norm", "qkv_proj", "kv_append", "attention", "o_proj", "ffn_norm", "moe"]
    w = layer_weight_bytes(cfg, 1)
    expert_bytes = 3 * 2880 * 2880 * (0.5 + 1 / 32)
    kv_bytes = 8192 * 8 * 64 * 2 * 2
    must_read = w["attention"] + 4 * expert_bytes + kv_bytes  # batch 1: the 4 experts its token picks
    assert lt.totals["hbm_bytes"] >= 0.99 * must_read
    floor = lt.totals["hbm_bytes"] / SPEC.derived()["hbm_achievable_bytes_per_s"]
    assert lt.time_s > floor
    assert all(k.time_s >= SPEC.sync.kernel_launch_s for k in lt.kernels)
    assert lt.totals["time_s"] == pytest.approx(sum(k.time_s for k in lt.kernels))


def test_longer_context_costs_more_attention_time_on_full_layers_only(timer):
    cfg = load_model_config("gpt-oss-120b")

    def attention_s(layer, ctx):
        lt = time_layer(cfg, layer, Step("decode", batch=8, context=ctx), timer=timer, fusion="none")
        return next(k for k in lt.kernels if k.label == "attention").time_s

    assert attention_s(1, 8192) > 1.5 * attention_s(1, 2048)
    assert attention_s(0, 8192) == pytest.approx(attention_s(0, 2048), rel=0.1)  # window 128


def test_model_step_reuses_identical_layers_and_adds_up(timer):
    cfg = load_model_config("gpt-oss-20b")
    rep = time_model(cfg, Step("decode", batch=4, context=4096), timer=timer, fusion="none")
    assert [len(idx) for idx, _ in rep.groups] == [12, 12]
    total = rep.head.time_s + rep.tail.time_s + sum(len(idx) * lt.time_s for idx, lt in rep.groups)
    assert rep.totals["time_s"] == pytest.approx(total)
    doc = rep.as_dict()
    assert doc["fits_one_die"] and doc["time_s"] == pytest.approx(total)
    assert {"time_s", "hbm_bytes", "flops", "hbm_utilization", "bound", "footprint", "layers"} <= set(doc)
    json.dumps(doc)


def test_a_model_that_does_not_fit_has_no_step_time_but_the_numbers(timer):
    cfg = load_model_config("deepseek-r1")
    rep = time_model(cfg, Step("decode", batch=1, context=1024), timer=timer, fusion="none")
    doc = rep.as_dict()
    assert doc["fits_one_die"] is False and doc["time_s"] is None and doc["time_s_unconstrained"] > 0
    fp = footprint(cfg, SPEC, batch=1, tokens=1024)
    assert doc["footprint"]["weight_bytes"] == fp.weight_bytes > SPEC.hbm.capacity_bytes
    kinds = [lt.kind for _, lt in rep.groups]
    assert kinds == ["mla dense", "mla moe"]


def test_layer_trace_has_one_slice_per_launch(tmp_path, timer):
    cfg = load_model_config("tiny-gpt-oss")
    lt = time_layer(cfg, 0, Step("decode", batch=2, context=40), timer=timer, fusion="none")
    path = tmp_path / "layer.json"
    write_layer_trace([lt], path)
    events = json.loads(path.read_text())["traceEvents"]
    slices = [e for e in events if e.get("pid") == 0 and e.get("ph") == "X"]
    assert len(slices) == len(lt.kernels)
    assert slices[-1]["ts"] + slices[-1]["dur"] == pytest.approx(lt.time_s * 1e6)
