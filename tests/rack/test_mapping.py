"""Mapping: parsing, validation against a model and a domain, per-chip memory and fit errors."""

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.model import load_model_config, model_weight_bytes
from jalapeno_emu.rack.mapping import (
    FitError,
    Mapping,
    attention_weight_bytes,
    check_mapping,
    chip_memory,
    fits,
    kv_capacity_tokens,
    parse_mapping,
    stage_layers,
)


@pytest.fixture(scope="module")
def v1():
    return load_preset("jalapeno-v1")


@pytest.fixture(scope="module")
def gpt():
    return load_model_config("gpt-oss-120b")


def test_parse_reads_keys_in_any_order_with_defaults_and_round_trips():
    m = parse_mapping(" ep = 16 , tp=8,dp=2")
    assert (m.tp, m.ep, m.dp, m.pp) == (8, 16, 2, 1)
    assert m.chips == 16 and m.stage_chips == 16 and m.expert_tp == 1
    assert parse_mapping(m.name) == m and m.name == "tp=8,ep=16,dp=2,pp=1"
    assert parse_mapping("pp=4") == Mapping(pp=4)
    assert Mapping(tp=4, ep=2).expert_tp == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "is empty"),
        ("tp=8;ep=2", "is not key=integer"),
        ("tp=x", "tp='x' is not a positive integer"),
        ("tp=-1", "tp='-1' is not a positive integer"),
        ("xp=2", "unknown key 'xp'"),
        ("tp=2,tp=4", "tp is given twice"),
        ("tp=0", "tp=0 must be an integer >= 1"),
        ("tp=2,ep=4", "ep=4 must divide the chips of a pipeline stage, tp*dp = 2*1 = 2"),
    ],
)
def test_parse_refuses_bad_strings_with_one_clear_message(text, message):
    with pytest.raises(InvalidArgumentError, match=message.replace("*", r"\*").replace("(", r"\(")):
        parse_mapping(text)


def test_check_mapping_names_the_model_number_it_breaks(gpt, v1):
    check_mapping(gpt, Mapping(tp=16), v1)  # 16 > 8 KV heads: each replicated twice
    for mapping, message in [
        (Mapping(tp=3, dp=1), "tp=3 must divide the 64 attention heads"),
        (Mapping(tp=1, dp=6, ep=6), "ep=6 must divide the 128 routed experts"),
        (Mapping(pp=37), "pp=37 stages for 36 layers"),
        (Mapping(tp=64, dp=4), "256 chips exceed jalapeno-v1's scale-up domain of 128"),
    ]:
        with pytest.raises(InvalidArgumentError, match=message):
            check_mapping(gpt, mapping, v1)
    tiny = load_model_config("tiny-gpt-oss")  # 4 query heads, 2 KV heads
    check_mapping(tiny, Mapping(tp=4))
    with pytest.raises(InvalidArgumentError, match="tp=8 must divide the 4 attention heads"):
        check_mapping(tiny, Mapping(tp=8))


def test_stage_layers_split_contiguously_first_stages_longer(gpt):
    stages = stage_layers(gpt, 5)
    assert [len(s) for s in stages] == [8, 7, 7, 7, 7]
    assert [i for s in stages for i in s] == list(range(36))


def test_one_chip_holds_exactly_the_models_weights(gpt, v1):
    assert chip_memory(gpt, v1, Mapping()).weight_bytes == pytest.approx(model_weight_bytes(gpt), rel=1e-12)


def test_tensor_parallel_attention_conserves_weights_but_the_replicated_o_bias(gpt):
    # gpt-oss: 8 KV heads, so tp=8 splits every head; the o_proj bias row (hidden BF16) is on every chip
    whole = attention_weight_bytes(gpt, 1)
    assert 8 * attention_weight_bytes(gpt, 8) == pytest.approx(whole + 7 * gpt.hidden * 2)
    # beyond the KV heads each chip keeps a whole KV head: more than 1/16 of the whole
    assert 16 * attention_weight_bytes(gpt, 16) > whole + 15 * gpt.hidden * 2


def test_expert_parallel_spreads_routed_experts_without_replication(v1):
    ds = load_model_config("deepseek-r1")
    one = chip_memory(ds, v1, Mapping(tp=8, ep=8), sequence_tokens=9216).by_part["ffn"]
    two = chip_memory(ds, v1, Mapping(tp=8, ep=1), sequence_tokens=9216).by_part["ffn"]
    assert one == pytest.approx(two, rel=1e-3)  # experts over ep or columns over tp*dp/ep: same bytes


def test_kv_capacity_adds_over_dp_groups_and_grows_with_tp_for_gqa(gpt, v1):
    base = kv_capacity_tokens(gpt, v1, Mapping(), sequence_tokens=9216)
    assert kv_capacity_tokens(gpt, v1, Mapping(tp=1, dp=2, ep=2), sequence_tokens=9216) > 2 * base
    assert kv_capacity_tokens(gpt, v1, Mapping(tp=8), sequence_tokens=9216) > 8 * base
    # MLA's latent cache is replicated over tp: per-chip KV bytes per token do not shrink
    ds = load_model_config("deepseek-r1")
    a = chip_memory(ds, v1, Mapping(tp=4)).kv_bytes_per_token
    assert a == chip_memory(ds, v1, Mapping(tp=8)).kv_bytes_per_token == 61 * 576 * 2


def test_fit_errors_carry_the_numbers(v1, gpt):
    ds = load_model_config("deepseek-r1")
    with pytest.raises(FitError, match=r"376\.1 GB of weights per chip exceed its 231\.9 GB of HBM"):
        fits(ds, v1, Mapping(), 0)
    with pytest.raises(FitError, match=r"65\.2 GB of weights \+ .* GB of KV cache \(4,194,304 tokens x "):
        fits(gpt, v1, Mapping(), 4 * 1024 * 1024)
    mem = fits(gpt, v1, Mapping(), 64 * 9216, sequence_tokens=9216)
    assert mem.weight_bytes + 64 * 9216 * mem.kv_bytes_per_token <= mem.capacity_bytes
    with pytest.raises(InvalidArgumentError, match="kv_tokens=-1"):
        fits(gpt, v1, Mapping(), -1)
