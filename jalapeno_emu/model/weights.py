"""Seeded random weights for functional runs, in natural layouts and the checkpoints' formats.

Stage: model. Weights are what the real checkpoints hold, in their formats: BF16 matrices for
attention, router, embedding and unembedding; MXFP4 (E2M1 codes, E8M0 scales, 32-blocks along
the contraction axis) for FFN experts. Layouts are the mathematical ones (``x @ W`` with ``W``
[in, out]); the kernel bindings (``model.bindings``) turn them into each kernel's HBM layout.
Values are drawn so that activations keep unit scale through the layers (standard deviation
1/sqrt(fan_in)), which keeps tiny models numerically well-conditioned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from jalapeno_emu import mx

from .config import ModelConfig

__all__ = ["ExpertWeights", "LayerWeights", "ModelWeights", "init_weights"]

_BF16 = ml_dtypes.bfloat16


@dataclass(frozen=True)
class ExpertWeights:
    """One FFN expert: gate and up [H, I], down [I, H] (MXArrays blocked along axis 0 in MXFP4, or
    BF16 arrays), biases (gpt-oss) gate_bias/up_bias [I], down_bias [H] BF16 or None."""

    gate: Any
    up: Any
    down: Any
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights (natural layouts; None where the structure has none).

    GQA (gpt-oss): ``wqkv`` [H, (Hq + 2 Hkv) D], ``bqkv``, ``sinks`` F32 [Hq], ``wo`` [Hq D, H], ``bo``.
    MLA (DeepSeek/Kimi): ``wqkv_a`` [H, q_lora + kv_lora + rope], ``q_a_norm``, ``kv_a_norm``,
    ``wq_b`` [q_lora, Hq (nope + rope)], ``w_kv_b`` [Hq (nope + v), kv_lora] (DeepSeek's
    kv_b_proj.weight, rows W_UK[h] then W_UV[h] per head), ``wo`` [Hq v, H].
    FFN: ``router`` [H, E] BF16, ``router_bias`` [E] BF16 (gpt-oss), ``score_bias`` F32 [E]
    (DeepSeek's e_score_correction_bias), ``experts`` and ``shared`` lists of ExpertWeights.
    """

    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    wo: np.ndarray
    wqkv: np.ndarray | None = None
    bqkv: np.ndarray | None = None
    bo: np.ndarray | None = None
    sinks: np.ndarray | None = None
    wqkv_a: np.ndarray | None = None
    q_a_norm: np.ndarray | None = None
    kv_a_norm: np.ndarray | None = None
    wq_b: np.ndarray | None = None
    w_kv_b: np.ndarray | None = None
    router: np.ndarray | None = None
    router_bias: np.ndarray | None = None
    score_bias: np.ndarray | None = None
    experts: tuple[ExpertWeights, ...] = ()
    shared: tuple[ExpertWeights, ...] = ()


@dataclass(frozen=True)
class ModelWeights:
    """All weights: ``embed`` [V, H] BF16, ``layers``, ``final_norm`` [H], ``unembed`` [H, V] BF16."""

    embed: np.ndarray
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray
    unembed: np.ndarray


def _mat(rng: np.random.Generator, rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
    return (scale * rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(_BF16)


def _vec(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    return (scale * rng.standard_normal(n)).astype(_BF16)


def _norm_w(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(_BF16)


def _expert(rng: np.random.Generator, h: int, i: int, fmt: str, bias: bool,
            out_scale: float) -> ExpertWeights:
    def w(rows: int, cols: int, scale: float) -> Any:
        values = (scale * rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)
        return mx.quantize(values, "e2m1", axis=0) if fmt == "fp4" else values.astype(_BF16)

    # gate/up scaled up a little so that the clamped SwiGLU's limit (7) is reached now and then.
    ex = ExpertWeights(gate=w(h, i, 2.0), up=w(h, i, 2.0), down=w(i, h, out_scale))
    if bias:
        ex = ExpertWeights(gate=ex.gate, up=ex.up, down=ex.down, gate_bias=_vec(rng, i, 0.1),
                           up_bias=_vec(rng, i, 0.1), down_bias=_vec(rng, h, 0.1))
    return ex


def _layer(cfg: ModelConfig, layer: int, rng: np.random.Generator) -> LayerWeights:
    h = cfg.hidden
    # GPT-2's scaled initialisation of the projections into the residual stream (1/sqrt(2 L)):
    # the skip path dominates, as in trained models, so rounding differences do not grow
    # layer over layer the way they would in a random network of unit-gain blocks.
    out_scale = 1.0 / np.sqrt(2 * cfg.layers)
    kw: dict[str, Any] = {"attn_norm": _norm_w(rng, h), "ffn_norm": _norm_w(rng, h)}
    if cfg.attention == "gqa":
        qkv = (cfg.q_heads + 2 * cfg.kv_heads) * cfg.head_dim
        kw.update(wqkv=_mat(rng, h, qkv), wo=_mat(rng, cfg.q_heads * cfg.head_dim, h, out_scale))
        if cfg.attention_bias:
            kw.update(bqkv=_vec(rng, qkv, 0.1), bo=_vec(rng, h, 0.1))
        if cfg.sinks:
            kw["sinks"] = rng.standard_normal(cfg.q_heads).astype(np.float32)
    else:
        qk = cfg.qk_nope_dim + cfg.qk_rope_dim
        kw.update(wqkv_a=_mat(rng, h, cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_dim),
                  q_a_norm=_norm_w(rng, cfg.q_lora_rank), kv_a_norm=_norm_w(rng, cfg.kv_lora_rank),
                  wq_b=_mat(rng, cfg.q_lora_rank, cfg.q_heads * qk),
                  w_kv_b=(rng.standard_normal((cfg.q_heads * (cfg.qk_nope_dim + cfg.v_head_dim),
                                               cfg.kv_lora_rank)) / np.sqrt(cfg.kv_lora_rank)).astype(_BF16),
                  wo=_mat(rng, cfg.q_heads * cfg.v_head_dim, h, out_scale))
    fmt = cfg.expert_weight_fmt
    if cfg.is_moe(layer):
        kw["router"] = _mat(rng, h, cfg.experts)
        if cfg.router_bias:
            kw["router_bias"] = _vec(rng, cfg.experts, 0.5)
        if cfg.score_bias:
            kw["score_bias"] = (0.05 * rng.standard_normal(cfg.experts)).astype(np.float32)
        kw["experts"] = tuple(_expert(rng, h, cfg.moe_intermediate, fmt, cfg.expert_bias, out_scale)
                              for _ in range(cfg.experts))
        kw["shared"] = tuple(_expert(rng, h, cfg.moe_intermediate, fmt, cfg.expert_bias, out_scale)
                             for _ in range(cfg.shared_experts))
    else:
        kw["shared"] = (_expert(rng, h, cfg.dense_intermediate, fmt, cfg.expert_bias, out_scale),)
    return LayerWeights(**kw)


def init_weights(cfg: ModelConfig, seed: int = 0) -> ModelWeights:
    """Random weights for ``cfg`` from ``seed`` (the same seed gives the same bytes).

    Meant for the tiny variants: a full-size model's weights would take hundreds of GB.
    """
    rng = np.random.default_rng(seed)
    return ModelWeights(
        embed=rng.standard_normal((cfg.vocab, cfg.hidden)).astype(_BF16),
        layers=tuple(_layer(cfg, i, rng) for i in range(cfg.layers)),
        final_norm=_norm_w(rng, cfg.hidden),
        unembed=_mat(rng, cfg.hidden, cfg.vocab),
    )
