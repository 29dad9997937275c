"""Model configurations: the shipped configs carry the public numbers; bad configs are refused."""

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.errors import ConfigError
from jalapeno_emu.model import (
    MODEL_NAMES,
    footprint,
    from_hf_config,
    kv_cache_bytes,
    load_model_config,
    model_weight_bytes,
)


def test_every_shipped_model_loads_with_its_sources():
    for name in MODEL_NAMES:
        cfg = load_model_config(name)
        assert cfg.name == name and cfg.source, name
        assert len(cfg.layer_windows) == cfg.layers


def test_gpt_oss_120b_structure_matches_the_public_config():
    c = load_model_config("gpt-oss-120b")
    assert (c.hidden, c.layers, c.vocab, c.q_heads, c.kv_heads, c.head_dim) == (2880, 36, 201088, 64, 8, 64)
    assert (c.experts, c.top_k, c.moe_intermediate, c.shared_experts) == (128, 4, 2880, 0)
    # layer 0 slides (window 128), layer 1 is full, alternating: 18 of each
    assert c.window(0) == 128 and c.window(1) == 0 and sum(1 for w in c.layer_windows if w) == 18
    assert c.sinks and c.attention_bias and c.expert_bias and c.router == "softmax_topk"
    assert c.expert_weight_fmt == "fp4" and c.weight_fmt == "bf16"
    assert c.rope.theta == 150000 and c.rope.factor == 32
    assert load_model_config("gpt-oss-20b").layers == 24 and load_model_config("gpt-oss-20b").experts == 32


def test_deepseek_and_kimi_structures():
    d = load_model_config("deepseek-r1")
    assert (d.layers, d.first_dense_layers, d.experts, d.top_k, d.shared_experts) == (61, 3, 256, 8, 1)
    assert (d.q_heads, d.kv_lora_rank, d.qk_rope_dim, d.qk_nope_dim, d.v_head_dim, d.q_lora_rank) == (
        128, 512, 64, 128, 128, 1536)
    assert (d.n_group, d.topk_group, d.routed_scaling_factor, d.score_bias) == (8, 4, 2.5, True)
    assert not d.is_moe(2) and d.is_moe(3) and d.attention == "mla"
    k = load_model_config("kimi-k2.5")
    assert (k.layers, k.first_dense_layers, k.experts, k.q_heads, k.n_group) == (61, 1, 384, 64, 1)
    assert k.routed_scaling_factor == pytest.approx(2.827)


def test_tiny_variants_keep_the_structure():
    pairs = (("tiny-gpt-oss", "gpt-oss-120b"), ("tiny-deepseek", "deepseek-r1"), ("tiny-kimi", "kimi-k2.5"))
    for tiny, full in pairs:
        t, f = load_model_config(tiny), load_model_config(full)
        assert (t.family, t.attention, t.router, t.activation, t.sinks, t.expert_bias, t.score_bias) == (
            f.family, f.attention, f.router, f.activation, f.sinks, f.expert_bias, f.score_bias)
        assert t.hidden < f.hidden and t.experts < f.experts


def test_weights_and_kv_cache_against_public_estimates():
    spec = load_preset("jalapeno-v1")
    g = load_model_config("gpt-oss-120b")
    # the checkpoint at https://huggingface.co/openai/gpt-oss-120b: ~65.1 GB (60.9 GB MXFP4 experts
    # + 4.2 GB BF16)
    assert model_weight_bytes(g) == pytest.approx(65.1e9, rel=0.01)
    # 18 full layers x (K + V) x 8 heads x 64 x 2 B per token, plus 18 sliding layers' 128 tokens
    assert kv_cache_bytes(g, 8192) == 8192 * 36864 + 18 * 128 * 2048
    d = load_model_config("deepseek-r1")
    assert kv_cache_bytes(d, 1) == 61 * 576 * 2  # the MLA latent row, 70272 B per token
    fp = footprint(d, spec, batch=1, tokens=8192)
    assert not fp.fits and fp.weight_bytes > spec.hbm.capacity_bytes and fp.max_sequences == 0
    fg = footprint(g, spec, batch=64, tokens=8192)
    assert fg.fits and 0.25 < fg.weight_share < 0.3 and fg.max_sequences > 64


def test_bad_configs_are_refused_with_the_field_named(tmp_path):
    with pytest.raises(ConfigError, match="did you mean gpt-oss-120b"):
        load_model_config("gpt-oss-12b")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(str(bad))
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        from_hf_config({"model_type": "llama"})
    cfg = {"model_type": "gpt_oss", "hidden_size": 64}
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        from_hf_config(cfg)
    ds = dict(model_type="deepseek_v3", num_hidden_layers=2, num_attention_heads=2, qk_nope_head_dim=32,
              qk_rope_head_dim=32, n_routed_experts=6, n_group=4, hidden_size=64, vocab_size=10,
              rope_theta=1e4,
              kv_lora_rank=32, v_head_dim=32, intermediate_size=64, moe_intermediate_size=32,
              num_experts_per_tok=2, q_lora_rank=32)
    with pytest.raises(ConfigError, match="n_group 4 must divide"):
        from_hf_config(ds)


def test_a_config_file_by_path_loads(tmp_path):
    from importlib import resources

    text = resources.files("jalapeno_emu.model").joinpath("configs", "tiny-kimi.json").read_text()
    path = tmp_path / "my-kimi.json"
    path.write_text(text)
    cfg = load_model_config(str(path))
    assert cfg.name == "my-kimi" and cfg.experts == load_model_config("tiny-kimi").experts
