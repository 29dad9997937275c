"""Layer plans: the launches, their order and their shapes follow the model's structure."""

import pytest

from jalapeno_emu.errors import ConfigError, InvalidArgumentError
from jalapeno_emu.model import Step, head_launches, layer_launches, load_model_config, tail_launches


def _labels(plan):
    return [x.label for x in plan]


def test_gpt_oss_decode_layer():
    cfg = load_model_config("gpt-oss-120b")
    plan = layer_launches(cfg, 0, Step("decode", batch=4, context=8192))
    assert _labels(plan) == ["attn_norm", "qkv_proj", "kv_append", "attention", "o_proj", "ffn_norm", "moe"]
    by = {x.label: x.shape_dict for x in plan}
    assert (by["qkv_proj"]["m"], by["qkv_proj"]["n"], by["qkv_proj"]["k"]) == (4, (64 + 16) * 64, 2880)
    assert by["qkv_proj"]["bias"] and by["qkv_proj"]["weight_fmt"] == "bf16"
    assert by["attention"]["window"] == 128 and by["attention"]["sinks"]
    assert layer_launches(cfg, 1, Step("decode", batch=4, context=8192))[3].shape_dict["window"] == 0
    assert (by["o_proj"]["n"], by["o_proj"]["k"]) == (2880, 4096)
    assert (by["moe"]["experts"], by["moe"]["top_k"], by["moe"]["activation"], by["moe"]["expert_bias"]) == (
        128, 4, "swiglu_oai", True)


def test_gpt_oss_prefill_chunk_attends_to_the_prior_context():
    cfg = load_model_config("gpt-oss-120b")
    plan = layer_launches(cfg, 1, Step("prefill", batch=1, seq=2048, prior=6144))
    assert _labels(plan) == ["attn_norm", "qkv_proj", "attention", "o_proj", "ffn_norm", "moe"]
    att = plan[2].shape_dict
    assert plan[2].kernel == "attention-prefill" and (att["seq"], att["prior"]) == (2048, 6144)
    assert plan[1].shape_dict["m"] == 2048 and plan[-1].shape_dict["tokens"] == 2048


def test_deepseek_dense_then_moe_layers_with_mla():
    cfg = load_model_config("deepseek-r1")
    step = Step("decode", batch=2, context=4096)
    dense, moe = layer_launches(cfg, 2, step), layer_launches(cfg, 3, step)
    assert _labels(dense) == ["attn_norm", "qkv_a_proj", "q_a_norm", "kv_a_norm", "q_b_proj", "mla_append",
                              "attention", "o_proj", "ffn_norm", "ffn"]
    ffn = dense[-1].shape_dict
    assert (ffn["experts"], ffn["shared_experts"], ffn["intermediate"]) == (0, 1, 18432)
    m = moe[-1].shape_dict
    keys = ("experts", "top_k", "shared_experts", "n_group", "topk_group", "score_bias")
    assert tuple(m[k] for k in keys) == (256, 8, 1, 8, 4, True)
    assert dense[1].shape_dict["n"] == 1536 + 512 + 64 and dense[2].shape_dict["residual"] is False
    att = dense[6].shape_dict
    assert dense[6].kernel == "mla-decode" and att["q_heads"] == 128 and att["kv_lora_rank"] == 512
    # DeepSeek's YaRN mscale^2 on 1/sqrt(192): (0.1 ln 40 + 1)^2 / sqrt(192)
    assert att["softmax_scale"] == pytest.approx((0.1 * 3.6888794541139363 + 1) ** 2 / 192 ** 0.5)


def test_identical_layers_give_identical_plans():
    cfg = load_model_config("gpt-oss-120b")
    step = Step("decode", batch=64, context=8192)
    plans = {layer_launches(cfg, i, step) for i in range(cfg.layers)}
    assert len(plans) == 2  # sliding and full attention


def test_head_and_tail():
    cfg = load_model_config("gpt-oss-120b")
    step = Step("prefill", batch=2, seq=1024)
    (emb,) = head_launches(cfg, step)
    assert emb.kernel == "embedding" and emb.shape_dict["tokens"] == 2048
    _, logits = tail_launches(cfg, step)
    assert logits.shape_dict["tokens"] == 2 and logits.shape_dict["vocab"] == 201088  # last token only


def test_bad_steps_and_layers_are_refused():
    cfg = load_model_config("gpt-oss-20b")
    with pytest.raises(ConfigError, match="layer 24 does not exist"):
        layer_launches(cfg, 24, Step("decode", batch=1, context=10))
    with pytest.raises(InvalidArgumentError, match="context"):
        Step("decode", batch=1, context=0)
    with pytest.raises(InvalidArgumentError, match="phase"):
        Step("train", batch=1)
    with pytest.raises(InvalidArgumentError, match="batch"):
        Step("prefill", batch=0, seq=32)
