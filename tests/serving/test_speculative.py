"""Speculative decoding (MTP): the acceptance model, and the simulator's steps under it."""

from __future__ import annotations

import numpy as np
import pytest

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.serving import LinearStepModel, StepWork, simulate
from jalapeno_emu.serving.speculative import DEFAULT_ACCEPTANCE, parse_acceptance, speculation


def test_expected_tokens_per_step_is_one_plus_the_accepted_prefixes():
    assert speculation(1).expected_tokens_per_step == pytest.approx(1 + DEFAULT_ACCEPTANCE)
    assert speculation(2, (0.9, 0.8)).expected_tokens_per_step == pytest.approx(1 + 0.9 + 0.9 * 0.8)
    assert speculation(3, 1.0).expected_tokens_per_step == 4.0
    assert speculation(0) is None


def test_draws_follow_the_acceptance_model():
    spec = speculation(2, (0.9, 0.5))
    drawn = spec.draw(np.random.default_rng(3), 200_000)
    assert drawn.min() == 0 and drawn.max() == 2
    # P(a = 0) = 0.1, P(a = 1) = 0.9 x 0.5, P(a = 2) = 0.9 x 0.5
    shares = np.bincount(drawn, minlength=3) / drawn.size
    assert shares == pytest.approx([0.1, 0.45, 0.45], abs=0.005)
    assert 1 + drawn.mean() == pytest.approx(spec.expected_tokens_per_step, abs=0.01)
    assert (speculation(2, 1.0).draw(np.random.default_rng(0), 5) == 2).all()
    assert (speculation(2, 0.0).draw(np.random.default_rng(0), 5) == 0).all()


@pytest.mark.parametrize("args, match", [
    ((9,), "from 0 to 8"),
    ((-1,), "from 0 to 8"),
    ((True,), "from 0 to 8"),
    ((1, 1.5), "probability in \\[0, 1\\]"),
    ((2, (0.9,)), "1 mtp acceptance values for 2 draft tokens"),
    ((0, 0.9), "without draft tokens"),
])
def test_speculation_refuses_bad_values(args, match):
    with pytest.raises(InvalidArgumentError, match=match):
        speculation(*args)


def test_parse_acceptance_takes_one_value_or_one_per_position():
    assert parse_acceptance("0.85") == 0.85
    assert parse_acceptance(" 0.9, 0.8 ") == (0.9, 0.8)
    with pytest.raises(InvalidArgumentError, match="comma-separated probabilities"):
        parse_acceptance("high")


def _linear(**kw):
    return LinearStepModel("m", chips=1, kv_capacity_tokens=1 << 20, max_batch_tokens=256, fixed_s=1e-3,
                           decode_s_per_sequence=2e-4, **kw)


def test_every_draft_accepted_halves_the_steps_and_tpot_is_their_time():
    model = _linear()
    osl = 11  # ten tokens after the first: five steps of two
    plain = simulate(model, isl=64, osl=osl, concurrency=1, range_ratio=1.0, requests=4)
    mtp = simulate(model, isl=64, osl=osl, concurrency=1, range_ratio=1.0, requests=4,
                   speculation=speculation(1, 1.0))
    plain_step = model.step_time_s(StepWork((100,)))
    verify_step = model.step_time_s(StepWork((100,), (), 2))
    assert plain.tpot_s.median == pytest.approx(plain_step)
    assert mtp.tpot_s.median == pytest.approx(5 * verify_step / 10)
    assert mtp.tokens_per_decode_step == 2.0 and plain.tokens_per_decode_step == 1.0
    assert mtp.draft_tokens == 1 and plain.draft_tokens == 0


def test_the_last_step_emits_no_more_than_the_output_left():
    model = _linear()
    mtp = simulate(model, isl=64, osl=4, concurrency=2, range_ratio=1.0, requests=6,
                   speculation=speculation(3, 1.0))
    # three tokens after the first: one step, capped at 3 of its 4
    assert mtp.measured_output_tokens == 6 * 4
    assert mtp.tokens_per_decode_step == 3.0


def test_partial_acceptance_speeds_decode_by_the_tokens_accepted():
    model = _linear()
    spec = speculation(1, 0.7)
    mtp = simulate(model, isl=64, osl=256, concurrency=4, range_ratio=1.0, requests=64, speculation=spec)
    assert mtp.tokens_per_decode_step == pytest.approx(spec.expected_tokens_per_step, rel=0.03)
    again = simulate(model, isl=64, osl=256, concurrency=4, range_ratio=1.0, requests=64, speculation=spec)
    assert again == mtp  # seeded: the same draws
    other = simulate(model, isl=64, osl=256, concurrency=4, range_ratio=1.0, requests=64, speculation=spec,
                     seed=1)
    assert other.tokens_per_decode_step != mtp.tokens_per_decode_step


def test_the_lengths_drawn_do_not_depend_on_mtp():
    model = _linear()
    plain = simulate(model, isl=64, osl=32, concurrency=3, requests=20, warmup_requests=0)
    mtp = simulate(model, isl=64, osl=32, concurrency=3, requests=20, warmup_requests=0,
                   speculation=speculation(2))
    assert (plain.measured_input_tokens, plain.measured_output_tokens) == \
        (mtp.measured_input_tokens, mtp.measured_output_tokens)


def test_mtp_needs_its_query_tokens_in_the_step_budget():
    with pytest.raises(InvalidArgumentError, match="concurrency 100 x 3 tokens per decoding sequence"):
        simulate(_linear(), isl=64, osl=8, concurrency=100, speculation=speculation(2))
