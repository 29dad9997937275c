"""Mapping search: candidates that fit, the analytic screen, shortlists, the best mapping."""

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.model import load_model_config
from jalapeno_emu.rack.mapping import FitError, check_mapping, chip_memory
from jalapeno_emu.rack.search import best_mapping, candidate_mappings, screen, shortlist


@pytest.fixture(scope="module")
def v1():
    return load_preset("jalapeno-v1")


def test_candidates_are_valid_fit_and_stay_in_the_domain(v1):
    ds = load_model_config("deepseek-r1")
    cands = candidate_mappings(ds, v1, kv_tokens=9216, sequence_tokens=9216)
    assert cands and all(m.chips <= 128 and m.chips & (m.chips - 1) == 0 for m in cands)
    for m in cands:
        check_mapping(ds, m, v1)
        mem = chip_memory(ds, v1, m, sequence_tokens=9216)
        assert mem.weight_bytes + 9216 * mem.kv_bytes_per_token <= mem.capacity_bytes
    assert min(m.chips for m in cands) == 2  # 376 GB of weights need two 232 GB chips
    assert {m.ep for m in cands} >= {1, 2, 64, 128} and {m.pp for m in cands} == {1, 2, 4, 8}
    eight = candidate_mappings(ds, v1, chips=8, kv_tokens=9216)
    assert eight and all(m.chips == 8 for m in eight)


def test_nothing_fits_is_a_fit_error_with_numbers(v1):
    with pytest.raises(FitError, match=r"no mapping of deepseek-r1 fits 1 chips: e\.g\. .* GB of weights"):
        candidate_mappings(load_model_config("deepseek-r1"), v1, chips=1)
    with pytest.raises(InvalidArgumentError, match=r"chips=256 must be an integer in 1\.\.128"):
        candidate_mappings(load_model_config("gpt-oss-120b"), v1, chips=256)


def test_screen_trades_interactivity_for_throughput_as_concurrency_grows(v1):
    gpt = load_model_config("gpt-oss-120b")
    cands = candidate_mappings(gpt, v1, kv_tokens=9216, sequence_tokens=9216)
    points = screen(gpt, v1, cands, isl=8192, osl=1024, concurrencies=[1, 64])
    assert len(points) == 2 * len(cands)
    one = {p.mapping: p for p in points if p.concurrency == 1}
    many = {p.mapping: p for p in points if p.concurrency == 64}
    for m in cands:
        assert one[m].interactivity_tok_s_user >= many[m].interactivity_tok_s_user > 0
        assert many[m].throughput_tok_s_per_chip > one[m].throughput_tok_s_per_chip
    top = shortlist([p for p in points if p.concurrency == 64], "throughput", 3)
    assert len({(p.mapping.tp, p.mapping.dp, p.mapping.pp) for p in top}) == 3
    assert top[0].throughput_tok_s_per_chip == max(p.throughput_tok_s_per_chip for p in many.values())
    with pytest.raises(InvalidArgumentError, match="objective 'speed'"):
        shortlist(points, "speed", 1)


def test_best_mapping_is_the_best_simulated_finalist(v1):
    tiny = load_model_config("tiny-gpt-oss")
    choice = best_mapping(tiny, v1, isl=128, osl=16, concurrency=4, objective="throughput", finalists=2)
    assert len(choice.finalists) == 2 and choice.screened > 2
    assert choice.mapping == choice.finalists[0][0]
    assert choice.metrics.throughput_tok_s_per_chip >= choice.finalists[1][1].throughput_tok_s_per_chip
