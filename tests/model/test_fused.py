"""Fused layer and step programs (model/fused.py): wiring, placement, and bit-identity with the
launches they replace."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.errors import ConfigError, InvalidArgumentError
from jalapeno_emu.kernels.gemm import gemm_reference
from jalapeno_emu.kernels.norm import rmsnorm_reference
from jalapeno_emu.model import Step, load_model_config
from jalapeno_emu.model.fused import build_fused, build_part, check_fusion, layer_windows, replicate_rows
from jalapeno_emu.model.plan import launch
from jalapeno_emu.model.timing import resolve_fusion

V1 = load_preset("jalapeno-v1")
BF16 = ml_dtypes.bfloat16


def test_fusion_levels_and_preset_defaults():
    assert [check_fusion(f) for f in ("none", "layer", "step")] == ["none", "layer", "step"]
    with pytest.raises(InvalidArgumentError, match="not one of"):
        check_fusion("kernel")
    assert resolve_fusion(None, V1) == "step"  # Jalapeño's own stack: one program per step
    assert resolve_fusion(None, load_preset("h100")) == "none"  # vLLM/SGLang/TRT-LLM: per-kernel launches
    assert load_preset("h100").provenance["software.fusion"].kind == "public"
    assert resolve_fusion("layer", V1) == "layer"
    with pytest.raises(ConfigError, match=r"software\.fusion"):
        V1.replace(**{"software.fusion": "megakernel"})


def test_layer_windows_find_the_repeating_pattern():
    assert layer_windows(["s", "f", "s", "f", "s", "f"]) == (0, 2)  # gpt-oss: sliding/full
    assert layer_windows(["d", "d", "d", "m", "m", "m", "m"]) == (3, 1)  # DeepSeek: 3 dense, then MoE
    assert layer_windows(["d", "m", "m"]) == (1, 1)
    assert layer_windows(["a"]) == (1, 1)  # nothing repeats: all of it is warm-up


def test_norms_replicate_only_when_cheaper_than_an_exchange():
    assert replicate_rows(1, 2880, V1)  # a few vector passes of 2880 elements
    assert not replicate_rows(64, 7168, V1)  # 460k elements: an exchange is cheaper


def test_fused_head_and_tail_are_bit_identical_to_their_launches():
    """Embedding -> final norm -> logits as one program: the rows gathered on chip, normalised
    on every core, multiplied by the unembedding; the same bits as the three launches."""
    cfg = load_model_config("tiny-gpt-oss")
    step = Step("decode", batch=2, context=40)
    fb = build_fused(cfg, step, V1, layers=[])
    assert [op.split(".")[1] for op in fb.ops] == ["embedding", "final_norm", "logits"]
    check_program(fb.program, V1)
    rng = np.random.default_rng(0)
    h, vocab = cfg.hidden, cfg.vocab
    table = rng.standard_normal((vocab, h)).astype(BF16)
    ids = rng.integers(0, vocab, (2, 1)).astype(np.int32)
    norm_w = (1 + 0.1 * rng.standard_normal((1, h))).astype(BF16)
    unembed = (0.05 * rng.standard_normal((h, vocab))).astype(BF16)
    data = {"head.embedding/table": table, "head.embedding/ids": ids, "tail.final_norm/w": norm_w,
            "tail.logits/w": unembed, "residual0": np.zeros((2, h), BF16), **fb.consts}
    got = run_functional(fb.program, data).read(fb.results["logits"], "bf16", (2, vocab))
    x = table[ids[:, 0]]
    y, _ = rmsnorm_reference(x, np.zeros_like(x), norm_w, cfg.rms_eps)
    want = gemm_reference(np.asarray(y), unembed, None)
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_fused_head_and_tail_time_one_launch_and_keep_the_rows_on_chip():
    cfg = load_model_config("gpt-oss-120b")
    step = Step("decode", batch=1, context=8192)
    fb = build_fused(cfg, step, V1, layers=[])
    tl = run_timing(fb.program, V1)
    unembed = cfg.hidden * cfg.vocab * 2
    assert tl.launch_s == V1.sync.kernel_launch_s  # once for the program
    # Nothing but the weights, the table rows and the logits cross HBM: the hidden state stays on chip.
    assert unembed <= tl.hbm_bytes < unembed * 1.01
    assert tl.time_s >= tl.lower_bound_s()


def test_bad_layer_selections_are_refused():
    cfg = load_model_config("tiny-gpt-oss")
    step = Step("decode", batch=1, context=8)
    with pytest.raises(InvalidArgumentError, match="consecutive"):
        build_fused(cfg, step, V1, layers=[0, 2])
    with pytest.raises(InvalidArgumentError, match="outside"):
        build_fused(cfg, step, V1, layers=[7])
    with pytest.raises(InvalidArgumentError, match="head"):
        build_fused(cfg, step, V1, layers=[1], head=True)


def test_a_streamed_gemm_input_from_a_tiled_norm_does_not_deadlock():
    """The rack's token part of a gpt-oss-120b layer at tp=8 and 512 tokens: the norm walks its
    rows in tiles (later tiles loaded in its rest part) and the QKV projection streams x in K
    chunks. The projection's x fetches used to sit in its prefetch part, on the DMA queues ahead
    of the norm's later tile loads, waiting for rows those loads feed: a deadlock."""
    t, spec = 512, load_preset("jalapeno-v1")
    las = (launch("attn_norm", "rmsnorm", hidden=2880, tokens=t),
           launch("qkv_proj", "gemm", act_fmt="bf16", bias=True, k=2880, m=t, n=640, weight_fmt="bf16"),
           launch("o_proj", "gemm", act_fmt="bf16", bias=True, k=512, m=t, n=2880, weight_fmt="bf16"),
           launch("ffn_norm", "rmsnorm", hidden=2880, tokens=t))
    fb = build_part(load_model_config("gpt-oss-120b"), Step("decode", batch=t, context=32), spec, 0, las)
    tl = run_timing(fb.program, spec)  # raises Deadlock if an engine can never proceed
    assert tl.time_s >= tl.lower_bound_s()
