"""Fused step and layer timings on disk: read back whole, only for their own question, and never
trusted when unreadable or written by other code."""

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.cli.main import main
from jalapeno_emu.model import Step, fused_timing, load_model_config, timing_cache
from jalapeno_emu.model.timing import time_layer, time_model

SPEC = load_preset("tiny")
CFG = load_model_config("tiny-gpt-oss")
STEP = Step("decode", batch=1, context=40)


def _count_builds(monkeypatch):
    calls = []
    real_model, real_layer = fused_timing.fused_model_timing, fused_timing.fused_layer_timing

    def model(*a, **kw):
        calls.append("model")
        return real_model(*a, **kw)

    def layer(*a, **kw):
        calls.append("layer")
        return real_layer(*a, **kw)

    monkeypatch.setattr(fused_timing, "fused_model_timing", model)
    monkeypatch.setattr(fused_timing, "fused_layer_timing", layer)
    return calls


def test_a_fused_step_is_timed_once_and_read_back_whole(tmp_path, monkeypatch):
    calls = _count_builds(monkeypatch)
    question = ("model", CFG, STEP, "step")
    assert not timing_cache.is_cached(question, SPEC, tmp_path)
    first = time_model(CFG, STEP, SPEC, fusion="step", disk_cache=tmp_path)
    assert timing_cache.is_cached(question, SPEC, tmp_path)
    assert not timing_cache.is_cached(question, SPEC, False)
    again = time_model(CFG, STEP, SPEC, fusion="step", disk_cache=tmp_path)
    assert calls == ["model"]
    assert again.as_dict() == first.as_dict()
    assert first.head.timelines and not again.head.timelines  # traces time afresh
    # another question is not answered by this one's file
    time_model(CFG, Step("decode", batch=1, context=41), SPEC, fusion="step", disk_cache=tmp_path)
    time_model(CFG, STEP, SPEC, fusion="layer", disk_cache=tmp_path)
    assert calls.count("model") == 3
    calls.clear()
    lt = time_layer(CFG, 1, STEP, SPEC, fusion="layer", disk_cache=tmp_path)
    assert time_layer(CFG, 1, STEP, SPEC, fusion="layer", disk_cache=tmp_path).as_dict() == lt.as_dict()
    assert calls == ["layer"]


def test_an_unreadable_file_or_other_code_is_a_miss(tmp_path, monkeypatch):
    calls = _count_builds(monkeypatch)
    first = time_model(CFG, STEP, SPEC, fusion="step", disk_cache=tmp_path)
    (path,) = timing_cache.cache_directory(SPEC, tmp_path).glob("*.pkl")
    path.write_bytes(path.read_bytes()[:40])  # cut short, as a crash mid-write of an old version would
    assert time_model(CFG, STEP, SPEC, fusion="step", disk_cache=tmp_path).as_dict() == first.as_dict()
    assert len(calls) == 2
    assert time_model(CFG, STEP, SPEC, fusion="step", disk_cache=tmp_path).as_dict() == first.as_dict()
    assert len(calls) == 2  # rewritten whole
    monkeypatch.setattr(timing_cache, "code_fingerprint", lambda: "edited-source")
    time_model(CFG, STEP, SPEC, fusion="step", disk_cache=tmp_path)
    assert len(calls) == 3
    other = load_preset("tiny").replace(**{"hbm.efficiency": 0.5})
    time_model(CFG, STEP, other, fusion="step", disk_cache=tmp_path)
    assert len(calls) == 4


@pytest.mark.parametrize("extra", [[], ["--no-cache"]])
def test_the_model_command_caches_unless_told_not_to(tmp_path, monkeypatch, capsys, extra):
    monkeypatch.setenv("JALAPENO_EMU_CACHE_DIR", str(tmp_path))
    argv = ["model", "--model", "tiny-gpt-oss", "--preset", "tiny", "--phase", "decode",
            "--context", "40", "--fusion", "step", "--json", *extra]
    assert main(argv) == 0
    written = list(tmp_path.glob("step-timings-*/*.pkl"))
    assert len(written) == (0 if extra else 1)


def test_model_timing_on_disk_says_what_time_model_would_read(tmp_path, monkeypatch):
    from jalapeno_emu.model.timing import model_timing_on_disk

    monkeypatch.setenv("JALAPENO_EMU_CACHE_DIR", str(tmp_path))
    assert not model_timing_on_disk(CFG, STEP, SPEC, fusion="step")
    time_model(CFG, STEP, SPEC, fusion="step", disk_cache=True)
    assert model_timing_on_disk(CFG, STEP, SPEC, fusion="step")
    assert not model_timing_on_disk(CFG, STEP, SPEC, fusion="layer")
    assert not model_timing_on_disk(CFG, STEP, SPEC, fusion="none")  # unfused steps are not kept
