"""Serving arguments are bounded at entry (issue 13): requests, concurrency, ISL + OSL (against the
model's max_position_embeddings and the simulator's limit), max_batch_tokens and the concurrencies
of a sweep, each refusal naming the argument and the limit, before any step is simulated or kernel
built. Without the bounds each of these ran for hours."""

from __future__ import annotations

import time

import pytest

from jalapeno_emu.cli.main import main
from jalapeno_emu.cli.rack import concurrencies_of
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.rack.deployment import compare_presets, predict, sweep_mappings
from jalapeno_emu.rack.step_model import RackStepModel
from jalapeno_emu.serving import simulate, sweep
from jalapeno_emu.serving.limits import (
    MAX_BATCH_TOKENS,
    MAX_CONCURRENCIES,
    MAX_CONCURRENCY,
    MAX_REQUESTS,
    MAX_SEQUENCE_TOKENS,
    distinct_concurrencies,
)
from tests.deadline import deadline

from .models import linear, roofline

HUGE = 99999999999999999999999


def _refused(fn, *fragments):
    """``fn()`` raises InvalidArgumentError within a second, every fragment in its message."""
    start = time.perf_counter()
    with deadline(10), pytest.raises(InvalidArgumentError) as info:
        fn()
    assert time.perf_counter() - start < 1.0
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_the_limits_say_why():
    for limit in (MAX_REQUESTS, MAX_CONCURRENCY, MAX_CONCURRENCIES, MAX_SEQUENCE_TOKENS, MAX_BATCH_TOKENS):
        assert limit.maximum > 0 and len(limit.why) > 20


@pytest.mark.parametrize(("kw", "fragments"), [
    (dict(requests=HUGE), ("requests=", "limit of 65,536")),
    (dict(warmup_requests=10**9), ("warmup_requests=1000000000", "limit of 65,536")),
    (dict(concurrency=100_000), ("concurrency=100000", "limit of 65,536")),
    (dict(isl=2**23), ("isl 8,388,608 + osl 10", "limit of 4,194,304 tokens per request")),
])
def test_simulate_refuses_counts_beyond_their_limits(kw, fragments):
    model = linear(kv_capacity_tokens=10**12, max_batch_tokens=10**6)
    args = dict(isl=100, osl=10, concurrency=2) | kw
    _refused(lambda: simulate(model, **args), *fragments)


def test_duplicate_concurrencies_are_one_point():
    assert distinct_concurrencies([1] * 3000 + [4, 1, 2]) == (1, 4, 2)
    with deadline(10):
        points = sweep([roofline()], [1] * 3000, isl=200, osl=20, requests=4)
    assert [p.concurrency for p in points] == [1]


def test_too_many_distinct_concurrencies_are_refused():
    many = list(range(1, MAX_CONCURRENCIES.maximum + 2))
    _refused(lambda: distinct_concurrencies(many), "65 distinct values", "limit of 64")
    _refused(lambda: sweep([roofline()], many, isl=200, osl=20), "65 distinct values")
    _refused(lambda: sweep_mappings("tiny-gpt-oss", "tiny", 128, 16, many), "65 distinct values")
    _refused(lambda: compare_presets("tiny-gpt-oss", ["tiny", "tiny"], 128, 16, many), "65 distinct values")


@pytest.mark.parametrize(("kw", "fragments"), [
    # used to build prefill attention at a million tokens of context on jalapeno-v1 for hours
    (dict(isl=1_000_000), ("isl 1,000,000 + osl 16 = 1,000,016 tokens",
                           "tiny-gpt-oss's max_position_embeddings of 131,072")),
    (dict(osl=10**10), ("max_position_embeddings of 131,072",)),
    (dict(requests=HUGE), ("requests=", "limit of 65,536")),
    (dict(concurrency=10**8), ("concurrency=100000000", "limit of 65,536")),
    (dict(max_batch_tokens=10**10), ("max_batch_tokens=10000000000", "limit of 65,536")),
])
def test_predict_refuses_at_entry(kw, fragments):
    args = dict(isl=128, osl=16, concurrency=1) | kw
    _refused(lambda: predict("tiny-gpt-oss", "jalapeno-v1", **args), *fragments)


def test_a_step_model_refuses_an_unbounded_step_budget():
    _refused(lambda: RackStepModel("tiny-gpt-oss", "tiny", "tp=1", max_batch_tokens=10**10),
             "max_batch_tokens=10000000000", "limit of 65,536")


def test_cli_concurrency_lists_are_deduplicated_in_order():
    assert concurrencies_of(",".join(["1"] * 3000) + ",8,1", "--concurrency") == [1, 8]


@pytest.mark.parametrize(("argv", "fragments"), [
    (["--requests", str(HUGE)], ("requests=", "limit of 65,536")),
    (["--isl", "1000000"], ("max_position_embeddings of 131,072",)),
])
def test_cli_serve_refuses_with_one_line(capsys, argv, fragments):
    with deadline(10):
        assert main(["serve", "--model", "tiny-gpt-oss", "--concurrency", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
