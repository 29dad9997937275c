"""The serving simulator: hand-computed times, an independent oracle, tokens, KV capacity, budget."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.serving.simulate import _Engine, _Lengths, default_requests, length_bounds, simulate
from jalapeno_emu.serving.step_model import StepWork

from .models import NoStretch, Recording, linear, roofline
from .reference import reference_run


def test_concurrency_one_times_by_hand():
    # fixed 1 ms per step + 1 us per prefill token + 20 us per decoding sequence, no context cost:
    # TTFT = one prefill step, every later token one decode step.
    model = linear(decode_s_per_context_token=0.0)
    m = simulate(model, isl=1000, osl=100, concurrency=1, range_ratio=1.0, requests=8)
    ttft = 1e-3 + 1000 * 1e-6
    tpot = 1e-3 + 2e-5
    assert m.ttft_s.mean == pytest.approx(ttft, rel=1e-9)
    assert m.ttft_s.p99 == pytest.approx(ttft, rel=1e-9)
    assert m.tpot_s.median == pytest.approx(tpot, rel=1e-9)
    assert m.e2e_s.median == pytest.approx(ttft + 99 * tpot, rel=1e-9)
    assert m.interactivity_tok_s_user == pytest.approx(1 / tpot, rel=1e-9)
    # one request at a time: 1100 tokens per (TTFT + 99 TPOT)
    assert m.throughput_tok_s_per_chip == pytest.approx(1100 / (ttft + 99 * tpot), rel=1e-9)
    assert m.mean_decode_batch == pytest.approx(99 / 100)
    assert m.window_steps == 8 * 100
    assert m.kv_bound_step_share == 0


def test_decode_context_grows_by_one_per_token():
    model = Recording(linear())
    simulate(model, isl=10, osl=5, concurrency=1, range_ratio=1.0, requests=1, warmup_requests=0)
    # the prefill step, then 4 decode steps reading prompt + tokens generated so far
    assert model.works[0].prefill_chunks == ((10, 0),)
    assert model.works[0].decode_contexts == ()
    assert [w.decode_contexts for w in model.works[1:5]] == [(11,), (12,), (13,), (14,)]


def test_context_cost_enters_tpot():
    model = linear(decode_s_per_context_token=1e-6)
    m = simulate(model, isl=1000, osl=11, concurrency=1, range_ratio=1.0, requests=4)
    decode_steps = [1e-3 + 2e-5 + 1e-6 * (1000 + g) for g in range(1, 11)]
    assert m.tpot_s.median == pytest.approx(sum(decode_steps) / 10, rel=1e-9)


@pytest.mark.parametrize("case", [
    dict(isl=300, osl=40, concurrency=7, budget=256, capacity=1_000_000),   # chunked prefill, no KV limit
    dict(isl=300, osl=40, concurrency=12, budget=512, capacity=1500),       # KV capacity binds
    dict(isl=50, osl=1, concurrency=5, budget=64, capacity=10_000),         # single output token
    dict(isl=1, osl=30, concurrency=3, budget=3, capacity=100),             # budget == concurrency
])
@pytest.mark.parametrize("stretch", [True, False], ids=["stretch-hook", "step-by-step"])
def test_matches_the_reference_simulator(case, stretch):
    model = roofline(max_batch_tokens=case["budget"], kv_capacity_tokens=case["capacity"])
    model = model if stretch else NoStretch(model)
    kw = dict(isl=case["isl"], osl=case["osl"], concurrency=case["concurrency"])
    m = simulate(model, **kw, requests=20, warmup_requests=6, seed=3)
    ref = reference_run(model, **kw, requests=20, warmup=6, seed=3)
    reqs = ref["measured"]
    ttft = np.array([r.first_s - r.arrival_s for r in reqs])
    e2e = np.array([r.end_s - r.arrival_s for r in reqs])
    assert m.ttft_s.mean == pytest.approx(ttft.mean(), rel=1e-12)
    assert m.ttft_s.p99 == pytest.approx(np.percentile(ttft, 99), rel=1e-12)
    assert m.e2e_s.median == pytest.approx(np.median(e2e), rel=1e-12)
    assert m.measured_input_tokens == sum(r.isl for r in reqs)
    assert m.measured_output_tokens == sum(r.osl for r in reqs)
    assert (m.window_tokens, m.window_steps) == (ref["tokens"], ref["steps"])
    assert m.window_s == pytest.approx(ref["seconds"], rel=1e-12)
    assert m.kv_bound_step_share == pytest.approx(ref["kv_steps"] / ref["steps"])
    kv_limited = case["capacity"] < case["concurrency"] * (case["isl"] + case["osl"])
    assert (m.kv_bound_step_share > 0) == kv_limited
    if case["osl"] == 1:
        assert m.tpot_s.median is None or math.isnan(m.tpot_s.median)
        assert m.as_dict()["interactivity_tok_s_user"] is None


def test_stretch_hook_is_exact():
    kw = dict(isl=2000, osl=300, concurrency=16, requests=40, seed=5)
    a = simulate(roofline(), **kw).as_dict()
    b = simulate(NoStretch(roofline()), **kw).as_dict()
    a.pop("mapping"), b.pop("mapping")
    assert a == b


def test_tokens_are_conserved():
    model = roofline(max_batch_tokens=700, kv_capacity_tokens=20_000)
    engine = _Engine(model, 9, _Lengths(900, 120, 0.8, seed=1))
    for _ in range(400):
        engine.step()
    in_flight = int(np.sum(engine.prefilled + engine.generated))
    done = engine.completed
    finished = sum(int(np.sum(a + b)) for a, b in zip(done.isl, done.osl, strict=True))
    assert engine.completed_count > 9
    assert engine.counters.tokens == finished + in_flight
    # a lone request measured from t = 0: the window's tokens are exactly its input + output
    m = simulate(model, isl=900, osl=120, concurrency=1, requests=5, warmup_requests=0)
    assert m.window_tokens == m.measured_input_tokens + m.measured_output_tokens


def test_chunked_prefill_respects_the_budget():
    model = Recording(roofline(max_batch_tokens=300))
    simulate(model, isl=1000, osl=20, concurrency=6, requests=10, seed=2)
    assert max(w.batch_tokens for w in model.works) == 300
    for w in model.works:
        assert w.batch_tokens <= 300
        # chunks continue a prompt where it stopped: the cached part of each chunk is < prompt length
        assert all(new > 0 and cached >= 0 for new, cached in w.prefill_chunks)
    # a 1000-token prompt over a 300-token budget is split: some chunk starts after cached tokens
    assert any(cached > 0 for w in model.works for _, cached in w.prefill_chunks)


def test_kv_capacity_makes_requests_queue():
    roomy = roofline(kv_capacity_tokens=10**7)
    tight = roofline(kv_capacity_tokens=4 * 1100)  # at most 4 requests of <= 1000 + 100 tokens
    model = Recording(tight)
    kw = dict(isl=1000, osl=100, concurrency=16, requests=40, seed=4)
    free, bound = simulate(roomy, **kw), simulate(model, **kw)
    assert bound.kv_bound_step_share > 0.5
    assert free.kv_bound_step_share == 0
    assert bound.ttft_s.median > 3 * free.ttft_s.median
    # never more sequences in flight than the capacity allows
    engine = _Engine(tight, 16, _Lengths(1000, 100, 0.8, seed=4))
    for _ in range(300):
        engine.step()
        in_cache = engine.admitted.sum()
        assert engine.reserved_tokens <= tight.kv_capacity_tokens
        assert in_cache <= 4
    assert max(w.decode_count + len(w.prefill_chunks) for w in model.works) <= 4


def test_seeds_make_runs_reproducible():
    kw = dict(isl=800, osl=64, concurrency=8, requests=20)
    a = simulate(roofline(), seed=11, **kw)
    b = simulate(roofline(), seed=11, **kw)
    c = simulate(roofline(), seed=12, **kw)
    assert a == b
    assert a.measured_input_tokens != c.measured_input_tokens


def test_lengths_drawn_in_range():
    draws = _Lengths(8192, 1024, 0.8, seed=0)
    pairs = np.array([draws.draw() for _ in range(3000)])
    assert length_bounds(8192, 0.8) == (6554, 8192)
    assert pairs[:, 0].min() >= 6554 and pairs[:, 0].max() <= 8192
    assert pairs[:, 1].min() >= 820 and pairs[:, 1].max() <= 1024
    assert abs(pairs[:, 0].mean() - (6554 + 8192) / 2) < 40


def test_measured_requests_start_after_warmup():
    model = Recording(roofline())
    m = simulate(model, isl=500, osl=50, concurrency=8, seed=1)
    assert m.measured_requests == default_requests(8) == 64
    assert m.warmup_requests == 8
    assert m.window_s < m.simulated_s
    assert default_requests(1024) == 2048 and default_requests(4096) == 2048


def test_power_per_kw():
    power = {"package": 700.0, "sustained": 550.0, "all_in": 1180.0}
    m = simulate(roofline(), isl=500, osl=50, concurrency=4, requests=10, power_w=power)
    for kind, watts in power.items():
        assert m.tok_s_per_kw[kind] == pytest.approx(m.throughput_tok_s_per_chip / (watts / 1000))
    d = m.as_dict()
    for key in ("interactivity_tok_s_user", "ttft_s", "tpot_s", "e2e_s", "throughput_tok_s_per_chip",
                "tok_s_per_kw", "concurrency", "chips", "ttft_s_mean", "ttft_s_p99", "tpot_s_p99"):
        assert key in d
    assert d["ttft_s"] == m.ttft_s.median and d["chips"] == 4


@pytest.mark.parametrize("kw, match", [
    (dict(isl=0), "isl must be an integer >= 1"),
    (dict(osl=2.5), "osl must be an integer >= 1"),
    (dict(concurrency=0), "concurrency must be"),
    (dict(concurrency=5000), "concurrency 5000 exceeds"),
    (dict(isl=250_000), "can never fit"),
    (dict(requests=0), "requests must be"),
    (dict(range_ratio=0.0), "range_ratio"),
    (dict(mtp_accept_tokens=0.5), "give speculative decoding as speculation="),
    (dict(speculation=0.85), "is not a Speculation"),
    (dict(power_w={"package": 700}), "power_w must have exactly"),
    (dict(power_w={"package": 700, "sustained": -1, "all_in": 9}), "power_w\\['sustained'\\]"),
])
def test_bad_input(kw, match):
    args = dict(isl=100, osl=10, concurrency=2) | kw
    with pytest.raises(InvalidArgumentError, match=match):
        simulate(roofline(), **args)


def test_bad_models():
    with pytest.raises(InvalidArgumentError, match="not a StepTimeModel"):
        simulate(object(), isl=10, osl=10, concurrency=1)

    class Negative(NoStretch):
        def step_time_s(self, work):
            return -1.0

    with pytest.raises(InvalidArgumentError, match=r"returned step time -1\.0"):
        simulate(Negative(roofline()), isl=10, osl=10, concurrency=1)
    with pytest.raises(InvalidArgumentError, match="fixed_s must be > 0"):
        linear(fixed_s=0.0)


def test_step_work_summaries():
    w = StepWork((5, 7), ((100, 0), (30, 200)))
    summary = (w.decode_count, w.decode_context_tokens, w.prefill_tokens, w.prefill_cached_tokens)
    assert summary == (2, 12, 130, 200)
    assert w.batch_tokens == 132
