"""Serving stacks: their costs and provenance, and what the simulator charges for them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from jalapeno_emu.chip import list_presets, load_preset
from jalapeno_emu.cli.main import main
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.serving import LinearStepModel, StepWork, simulate
from jalapeno_emu.serving.stack import STACKS, load_stack, stack_for_framework


def test_every_cost_has_its_provenance_and_public_ones_a_source_to_open():
    for stack in STACKS.values():
        for row in stack.rows():
            assert row["kind"] in ("public", "assumed") and row["note"].strip(), (stack.name, row["field"])
            if row["kind"] == "public":
                assert "https://" in row["note"], (stack.name, row["field"])
    assert STACKS["sglang"].overlap == 1.0 and STACKS["trtllm"].overlap == 1.0
    assert STACKS["vllm"].provenance["overlap"].kind == "assumed"


def test_every_preset_names_a_stack():
    for name in list_presets():
        assert load_stack(load_preset(name).software.stack).name in STACKS
    assert load_preset("jalapeno-v1").software.stack == "jalapeno"


def test_step_time_hides_the_host_only_as_far_as_the_stack_overlaps():
    full = dataclasses.replace(STACKS["sglang"], host_step_s=1e-3, host_s_per_sequence=1e-5, sampling_s=2e-5)
    none = dataclasses.replace(full, overlap=0.0)
    host = 1e-3 + 4 * 1e-5
    assert full.step_s(5e-3, 4) == pytest.approx(5e-3 + 2e-5)  # hidden behind a longer device step
    assert full.step_s(1e-4, 4) == pytest.approx(host)  # a short device step waits for the host
    assert none.step_s(5e-3, 4) == pytest.approx(5e-3 + 2e-5 + host)
    assert np.allclose(full.step_s(np.array([5e-3, 1e-4]), 4), [5e-3 + 2e-5, host])


def _model():
    return LinearStepModel("m", chips=1, kv_capacity_tokens=1 << 20, max_batch_tokens=4096, fixed_s=1e-3,
                           prefill_s_per_token=1e-6)


def test_the_simulator_charges_requests_steps_and_responses():
    stack = dataclasses.replace(STACKS["vllm"], host_step_s=3e-4, host_s_per_sequence=0.0, sampling_s=1e-5,
                                request_s=2e-3, tokenize_s_per_token=1e-6, response_s=5e-4)
    model = _model()
    kw = dict(isl=100, osl=5, concurrency=1, range_ratio=1.0, requests=3)
    bare = simulate(model, **kw)
    got = simulate(model, **kw, stack=stack)
    prefill = model.step_time_s(StepWork((), ((100, 0),)))
    decode = model.step_time_s(StepWork((101,)))
    # overlap 0: every step pays the host's time after the device's
    assert bare.ttft_s.median == pytest.approx(prefill)
    assert got.ttft_s.median == pytest.approx(2e-3 + 100e-6 + prefill + 1e-5 + 3e-4 + 5e-4)
    assert got.tpot_s.median == pytest.approx(decode + 1e-5 + 3e-4)
    assert got.e2e_s.median == pytest.approx(got.ttft_s.median + 4 * got.tpot_s.median)
    # closed loop: the next request leaves the client when it has the last token, and nothing
    # runs while it is received and tokenized, so a request cycle is E2E plus the request's time in
    assert got.window_s / got.window_steps > bare.window_s / bare.window_steps


def test_no_stack_is_the_device_alone_and_a_wrong_one_is_refused():
    model = _model()
    kw = dict(isl=100, osl=5, concurrency=2, requests=4)
    assert simulate(model, **kw) == simulate(model, **kw, stack=None)
    with pytest.raises(InvalidArgumentError, match="is not a StackProfile"):
        simulate(model, **kw, stack="vllm")
    with pytest.raises(InvalidArgumentError, match="stack 'tgi' is not one of vllm, sglang"):
        load_stack("tgi")
    with pytest.raises(InvalidArgumentError, match="overlap must be in \\[0, 1\\]"):
        dataclasses.replace(STACKS["vllm"], overlap=1.5)


@pytest.mark.parametrize("framework, stack", [
    ("vllm", "vllm"), ("vllm v0.17.0 ROCm, TP8", "vllm"), ("sglang", "sglang"),
    ("mori-sglang (disagg)", "sglang"),
    ("trt (single node)", "trtllm"), ("dynamo-trt (disagg, multinode)", "dynamo"), ("atom", None),
    ("unstated (likely SGLang)", None),
])
def test_a_measured_rows_framework_names_its_stack(framework, stack):
    assert stack_for_framework(framework) == stack


def test_stack_show_and_serve_with_a_stack(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("JALAPENO_EMU_CACHE_DIR", str(tmp_path))
    assert main(["stack", "show", "--preset", "h100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["name"] == "vllm" and doc["preset"] == "h100" and doc["overlap"]["kind"] == "assumed"
    assert main(["stack", "show", "trtllm"]) == 0
    assert "overlap-scheduler" in capsys.readouterr().out
    serve = ["serve", "--model", "tiny-gpt-oss", "--isl", "128", "--osl", "16", "--concurrency", "2",
             "--mapping", "tp=1", "--json"]
    times = {}
    for stack in ("sglang", "vllm"):
        assert main([*serve, "--stack", stack.upper()]) == 0  # names are not case-sensitive
        out = json.loads(capsys.readouterr().out)
        assert out["stack"] == stack
        times[stack] = out["tpot_s"]
    assert times["vllm"] > times["sglang"]  # the same host work, not hidden behind the device
    assert main([*serve, "--stack", "tgi"]) == 2
    assert "invalid choice: 'tgi'" in capsys.readouterr().err


def test_choosing_a_stack_re_times_no_kernel():
    # The host's costs come after the device's times: a stack shares the kernel-timing caches
    # (their files and the process's timers are named by this fingerprint); fusion does not.
    from jalapeno_emu.fingerprint import spec_fingerprint

    spec = load_preset("h100")
    assert spec_fingerprint(spec) == spec_fingerprint(spec.replace(**{"software.stack": "sglang"}))
    assert spec_fingerprint(spec) != spec_fingerprint(spec.replace(**{"software.fusion": "step"}))
    assert spec_fingerprint(spec) != spec_fingerprint(spec.replace(**{"hbm.efficiency": 0.5}))
