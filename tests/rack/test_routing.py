"""Routing distributions: pick probabilities, per-expert-group hits, distinct experts, parsing."""

import math

import numpy as np
import pytest

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.kernels.moe import expected_distinct_experts
from jalapeno_emu.rack.routing import UNIFORM, ExpertLoad, Routing, parse_routing


def test_uniform_matches_the_kernels_expected_distinct_experts_and_hypergeometric_hits():
    load = ExpertLoad(128, 4, 1)
    for t in (1, 7, 64, 1000):
        assert float(load.distinct(t)) == pytest.approx(expected_distinct_experts(128, 4, t), rel=1e-12)
    eight = ExpertLoad(128, 4, 8)
    miss = math.comb(112, 4) / math.comb(128, 4)  # none of a token's 4 experts among 16
    assert np.allclose(eight.hit, 1 - miss)
    # every token's 4 expert picks land somewhere: picks per needing token x hit x groups = k
    assert eight.picks_per_token() * eight.hit[0] * 8 == pytest.approx(4)
    assert float(eight.received(1000)) == pytest.approx(1000 * (1 - miss))


def test_distinct_experts_over_groups_add_up_to_the_whole_layer():
    for routing in (UNIFORM, parse_routing("zipf:1.2")):
        whole = float(ExpertLoad(256, 8, 1, routing).distinct(300))
        split = ExpertLoad(256, 8, 16, routing)
        assert sum(float(split.distinct(300, g)) for g in range(16)) == pytest.approx(whole, rel=1e-12)


def test_zipf_probabilities_sum_to_top_k_capped_at_one_and_fall_with_rank():
    pick = parse_routing("zipf:1.2").pick_probabilities(128, 4)
    assert pick.sum() == pytest.approx(4) and pick.max() == 1.0 and np.all(np.diff(pick) <= 1e-15)
    assert np.allclose(Routing("zipf", 0.0).pick_probabilities(16, 2), 2 / 16)


def test_skew_concentrates_load_on_the_first_group_unless_placed_round_robin():
    uniform = ExpertLoad(128, 4, 8)
    zipf = ExpertLoad(128, 4, 8, parse_routing("zipf:0.8"))
    spread = ExpertLoad(128, 4, 8, parse_routing("zipf:0.8:round_robin"))
    assert zipf.busiest == 0 and zipf.hit[0] > spread.hit.max() > uniform.hit.max()
    assert float(zipf.received(512)) > float(spread.received(512)) > float(uniform.received(512))
    assert np.array_equal(spread.members[1], np.arange(1, 128, 8))


@pytest.mark.parametrize(
    "text, message",
    [
        ("zipf", "is not 'uniform' or 'zipf:S'"),
        ("zipf:x", "zipf exponent 'x' is not a number"),
        ("zipf:-1", "exponent -1.0 must be a finite number >= 0"),
        ("normal:2", "is not 'uniform' or 'zipf:S'"),
    ],
)
def test_parse_routing_errors(text, message):
    with pytest.raises(InvalidArgumentError, match=message):
        parse_routing(text)


def test_names_round_trip():
    for text in ("uniform", "zipf:1.2", "zipf:0.5:round_robin"):
        assert parse_routing(text).name == text
    with pytest.raises(InvalidArgumentError, match="ep=3 must divide the 128 experts"):
        ExpertLoad(128, 4, 3)
