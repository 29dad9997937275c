"""Whole tiny models on the emulated die against the pure-JAX reference forward pass.

Each test prefills a 32-token prompt (one chunk), feeds one more prompt token as a decode step and
generates a few tokens, every kernel launch run functionally; the reference runs the same steps
on the same weights. Compilation dominates (each kernel's instruction signatures compile once per
process), so the runs are short.
"""

import numpy as np
import pytest

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.model import load_model_config
from jalapeno_emu.model.die import DieModel
from jalapeno_emu.model.generate import LOGIT_TOLERANCE, generate, prompt_feeds
from jalapeno_emu.model.weights import init_weights


# jalapeno-v1's software fuses each step into one program (software.fusion = step): every kernel
# runs as an emitter, activations on chip, checked against the reference. One model runs on the
# 64-core preset itself (its programs compile ~2,000 instruction signatures: minutes on two
# cores), the MLA models on the 2-core tiny preset under the same step fusion.
@pytest.mark.parametrize(("name", "preset"), [("tiny-gpt-oss", "jalapeno-v1"), ("tiny-deepseek", "tiny"),
                                              ("tiny-kimi", "tiny")])
def test_tiny_model_generates_the_reference_tokens(name, preset):
    gen = generate(load_model_config(name), prompt_len=33, tokens=2, batch=2, check=True, preset=preset,
                   fusion="step")
    assert gen.check["passed"], gen.check
    assert gen.check["tokens_identical"], gen.check
    assert gen.tokens.shape == (2, 2)
    phases = [s["phase"] for s in gen.steps]
    assert phases == ["prefill", "decode", "decode"]
    # the prefill chunk is bit-exact: same MX numerics, same summation orders, single KV tile
    assert gen.steps[0]["check"]["rel_rms"] == 0.0
    for s in gen.steps:
        assert s["time_s"] > 0 and 0 <= s["hbm_utilization"] <= 1
        assert s["check"]["rel_rms"] <= LOGIT_TOLERANCE["rel_rms"]


def test_a_broken_binding_is_caught_by_the_check(monkeypatch):
    """Swap two query heads' rows before attention: the reference check must fail."""
    from jalapeno_emu.model import bindings

    real = bindings._gqa_decode

    def swapped(die, i, lw, pk, launches, y, step):
        run = die.run

        def run_swapping(launch, data):
            if launch.label == "attention":
                q = data["q"].copy()
                q[[0, 1]] = q[[1, 0]]
                data = dict(data, q=q)
            return run(launch, data)

        die.run = run_swapping
        try:
            return real(die, i, lw, pk, launches, y, step)
        finally:
            die.run = run

    monkeypatch.setattr(bindings, "_gqa_decode", swapped)
    # one decode step at context 1: heads 0 and 1 differ only by their sink logits (launch by
    # launch: the bindings feed each launch; a fused step binds per operator in model.fused_die)
    gen = generate(load_model_config("tiny-gpt-oss"), prompt_len=1, tokens=1, batch=1, check=True,
                   fusion="none")
    assert not gen.check["passed"]


def test_prompt_feeds_split_into_32_token_chunks_and_single_steps():
    prompt = np.arange(2 * 75).reshape(2, 75)
    feeds = prompt_feeds(prompt, 32)
    assert [f.shape[1] for f in feeds] == [32, 32] + [1] * 11
    assert np.array_equal(np.concatenate(feeds, axis=1), prompt)
    assert [f.shape[1] for f in prompt_feeds(prompt)] == [64] + [1] * 11
    with pytest.raises(InvalidArgumentError, match="multiple of 32"):
        prompt_feeds(prompt, 40)


def test_bad_requests_are_refused():
    cfg = load_model_config("tiny-gpt-oss")
    die = DieModel(cfg, init_weights(cfg, 0), batch=1, max_positions=4)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        die.forward(np.array([[cfg.vocab]]))
    with pytest.raises(InvalidArgumentError, match="exceed max_positions"):
        die.forward(np.zeros((1, 5), np.int64))
    with pytest.raises(InvalidArgumentError, match="too large"):
        generate(load_model_config("gpt-oss-120b"), prompt_len=1, tokens=1)


def test_recurring_launches_run_compiled_whole_with_the_same_logits(monkeypatch):
    """compile="program": from its second step a launch that recurs runs as one compiled program;
    the logits stay bit-identical to per-instruction runs, and launches new each step (attention,
    the append: their shapes hold the context) stay per-instruction. compile="auto" switches a
    launch once its per-instruction runs have cost what compiling it whole would."""
    from jalapeno_emu.model import die as die_module

    cfg = load_model_config("tiny-gpt-oss")
    w = init_weights(cfg, 0)
    modes: list[tuple[str, str]] = []
    real = die_module.run_functional

    def spy(program, inputs=None, **kw):
        modes.append((program.name, kw.get("compile", "instruction")))
        return real(program, inputs, **kw)

    monkeypatch.setattr(die_module, "run_functional", spy)

    def logits(policy: str) -> list[np.ndarray]:
        modes.clear()
        die = DieModel(cfg, w, batch=1, max_positions=4, preset="tiny", fusion="none", compile=policy)
        return [die.forward(np.array([[t]])).logits for t in (3, 7, 11)]

    per_instruction = logits("instruction")
    assert {m for _, m in modes} == {"instruction"}
    whole = logits("program")
    for a, b in zip(per_instruction, whole, strict=True):
        assert np.array_equal(a, b)
    compiled = {name for name, m in modes if m == "program"}
    assert any(n.startswith("moe") for n in compiled) and any(n.startswith("rmsnorm") for n in compiled)
    assert not any(n.startswith(("attention", "kv_append")) for n in compiled)
    assert all(m == "instruction" for _, m in modes[:len(modes) // 3])  # nothing recurs yet
    # auto: an estimate of ~0 s to compile switches at once; a huge one never
    monkeypatch.setattr(die_module, "WHOLE_COMPILE_S_PER_INSTRUCTION", 0.0)
    logits("auto")
    assert {n for n, m in modes if m == "program"} == compiled
    monkeypatch.setattr(die_module, "WHOLE_COMPILE_S_PER_INSTRUCTION", 1e9)
    logits("auto")
    assert {m for _, m in modes} == {"instruction"}
    with pytest.raises(InvalidArgumentError, match="compile 'jit'"):
        DieModel(cfg, w, batch=1, max_positions=4, preset="tiny", compile="jit")


def test_builds_of_earlier_contexts_are_dropped():
    """Each decode step's attention and append are new programs (their shapes hold the context):
    the die keeps those of the last two steps only, so a long generation's memory does not grow."""
    cfg = load_model_config("tiny-gpt-oss")
    die = DieModel(cfg, init_weights(cfg, 0), batch=1, max_positions=6, preset="tiny", fusion="none",
                   compile="instruction")
    for t in range(5):
        die.forward(np.array([[t]]))
        contexts = {dict(shape)["context"] for kernel, shape in die._builds if kernel == "attention-decode"}
        assert contexts == {t, t + 1} - {0}
    assert any(kernel == "moe" for kernel, _ in die._builds)  # what recurs stays
    fused = DieModel(cfg, init_weights(cfg, 0), batch=1, max_positions=4, preset="tiny", fusion="step")
    for t in range(3):
        fused.forward(np.array([[t]]))
        assert {key[0].context for key in fused._fused._builds} == {t + 1}


def test_the_step_is_timed_on_the_programs_it_ran(monkeypatch):
    """Launch by launch, the timer takes each program the step ran instead of building it again
    (an attention launch is new every step), and its figures are a fresh timer's."""
    import jalapeno_emu.model.timing as timing
    from jalapeno_emu.model.plan import head_launches, layer_launches, tail_launches

    cfg = load_model_config("tiny-gpt-oss")
    die = DieModel(cfg, init_weights(cfg, 0), batch=1, max_positions=4, preset="tiny", fusion="none",
                   compile="instruction")
    die.forward(np.array([[1]]))
    fresh = timing.StepTimer("tiny")
    real = timing.get_kernel
    by_timer = []
    monkeypatch.setattr(timing, "get_kernel", lambda name: by_timer.append(name) or real(name))
    step = die.forward(np.array([[2]]))
    assert by_timer == []  # the attention and append of this context: built once, by the run
    st = step.step
    launches = {x.label: x for x in (*head_launches(cfg, st),
                                     *(x for i in range(cfg.layers) for x in layer_launches(cfg, i, st)),
                                     *tail_launches(cfg, st))}
    for lt in step.timing:
        for k in lt.kernels:
            want, _ = fresh.time_launch(launches[k.label])
            assert (k.time_s, k.hbm_bytes, k.flops) == (want.time_s, want.hbm_bytes, want.flops)
    assert "attention-decode" in by_timer  # (the fresh timer did build them)
