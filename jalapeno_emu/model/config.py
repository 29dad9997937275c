"""Model configurations: HF-style ``config.json`` files read into one frozen :class:`ModelConfig`.

Stage: model (on top of the kernel library). Two structures cover the models we serve:

- ``gpt_oss`` (gpt-oss-120b/20b): grouped-query attention with biases, learned sinks, sliding
  window on every other layer, YaRN RoPE; every layer a top-k MoE with softmax over the selected
  logits, clamped SwiGLU experts with biases; MXFP4 experts, BF16 elsewhere.
- ``deepseek_v3`` (DeepSeek-R1, Kimi K2.5; HF ``model_type`` deepseek_v3, kimi_k2, kimi_k25):
  multi-head latent attention (q and kv low-rank projections, a compressed KV cache), the first
  ``first_k_dense_replace`` layers a dense SiLU FFN, then MoE with sigmoid scores, group-limited
  top-k with a score-correction bias, a routed scaling factor and shared experts.

The shipped configurations (``configs/*.json``) carry the public HF fields verbatim where they were
read, plus ``_source`` and ``_notes`` (what is unverified, which checkpoint's quantisation we
model). ``load_model_config`` takes one of :data:`MODEL_NAMES` or a path to any ``config.json``
of these structures.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from importlib import resources
from typing import Any, Literal

from jalapeno_emu.errors import ConfigError
from jalapeno_emu.files import read_input_bytes

__all__ = ["MODEL_NAMES", "ModelConfig", "RopeConfig", "from_hf_config", "load_model_config"]

MODEL_NAMES = ("gpt-oss-120b", "gpt-oss-20b", "deepseek-r1", "kimi-k2.5",
               "tiny-gpt-oss", "tiny-deepseek", "tiny-kimi")
"""Models shipped with the package (``--model NAME``); the tiny ones run functionally."""

_GPT_OSS_TYPES = ("gpt_oss",)
_DEEPSEEK_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding with YaRN scaling, as the HF ``rope_scaling`` dict gives it.

    Attributes:
        theta: base of the frequencies (``rope_theta``).
        factor: YaRN context extension factor (1 = plain RoPE).
        original_max_position_embeddings: context the model was pre-trained at.
        beta_fast, beta_slow: YaRN ramp bounds (in rotations).
        mscale, mscale_all_dim: DeepSeek's attention-scale knobs (1.0 where absent).
    """

    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        """The HF-style dict (``rope_theta`` plus the ``rope_scaling`` keys) kernels' tables take."""
        return {"rope_theta": self.theta, "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
                "mscale": self.mscale, "mscale_all_dim": self.mscale_all_dim}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """One model's structure and sizes, in the terms the layer planner needs.

    Attributes (sizes in elements unless named otherwise):
        name: the name it was loaded by (``gpt-oss-120b``) or the config file's stem.
        family: ``gpt_oss`` or ``deepseek_v3`` (the layer structure).
        source: where the numbers come from.
        hidden, layers, vocab: hidden size, decoder layers, vocabulary.
        q_heads, kv_heads, head_dim: attention heads; for MLA ``kv_heads == q_heads`` and
            ``head_dim`` is the query/key head width (nope + rope).
        attention: ``gqa`` or ``mla``.
        attention_bias: q/k/v/o projections have biases (gpt-oss).
        sliding_window: the window of sliding layers in tokens (0: none).
        layer_windows: per layer, its window (0 = full attention).
        sinks: one learned sink logit per query head (gpt-oss).
        rope: RoPE/YaRN parameters.
        q_lora_rank, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim: MLA widths (0 for GQA).
        dense_intermediate: FFN width of dense layers (DeepSeek: 18432).
        moe_intermediate: width of one expert.
        experts, top_k, shared_experts: routed experts, experts per token, always-on experts.
        first_dense_layers: layers before the first MoE layer.
        router: ``softmax_topk`` (gpt-oss) or ``sigmoid_topk`` (DeepSeek/Kimi).
        routed_scaling_factor, n_group, topk_group: DeepSeek routing.
        score_bias: routing adds ``e_score_correction_bias`` to the scores for selection.
        router_bias: the router linear has a bias (gpt-oss).
        activation: ``swiglu_oai`` (gpt-oss clamped) or ``silu``.
        expert_bias: expert gate/up/down projections have biases (gpt-oss).
        rms_eps: RMSNorm epsilon.
        expert_weight_fmt: HBM format of FFN expert weights (``fp4`` = MXFP4).
        weight_fmt: HBM format of every other weight (``bf16``).
        max_position_embeddings: longest context the config allows.
        tie_word_embeddings: the unembedding reuses the embedding table.
        eos_token_id: the end-of-sequence token (generation does not stop on it: InferenceX).
    """

    name: str
    family: Literal["gpt_oss", "deepseek_v3"]
    source: tuple[str, ...]
    hidden: int
    layers: int
    vocab: int
    q_heads: int
    kv_heads: int
    head_dim: int
    attention: Literal["gqa", "mla"]
    attention_bias: bool
    sliding_window: int
    layer_windows: tuple[int, ...]
    sinks: bool
    rope: RopeConfig
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    dense_intermediate: int
    moe_intermediate: int
    experts: int
    top_k: int
    shared_experts: int
    first_dense_layers: int
    router: Literal["softmax_topk", "sigmoid_topk"]
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    score_bias: bool
    router_bias: bool
    activation: Literal["swiglu_oai", "silu"]
    expert_bias: bool
    rms_eps: float
    expert_weight_fmt: str
    weight_fmt: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_id: int | None

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has a routed-expert FFN."""
        self._check_layer(layer)
        return layer >= self.first_dense_layers and self.experts > 0

    def window(self, layer: int) -> int:
        """The attention window of ``layer`` in tokens; 0 = full causal attention."""
        self._check_layer(layer)
        return self.layer_windows[layer]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.layers:
            raise ConfigError(f"layer {layer} does not exist: {self.name} has layers 0..{self.layers - 1}")

    def kv_bytes_per_token(self, layer: int, kv_dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token adds to ``layer`` (GQA: K and V of every KV head; MLA: the
        latent row ``kv_lora_rank + qk_rope_dim``)."""
        self._check_layer(layer)
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_dim) * kv_dtype_bytes
        return 2 * self.kv_heads * self.head_dim * kv_dtype_bytes

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict of every field."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["rope"] = self.rope.as_dict()
        out["source"] = list(self.source)
        out["layer_windows"] = list(self.layer_windows)
        return out


def _get(cfg: Mapping[str, Any], key: str, where: str, default: Any = ...) -> Any:
    if key in cfg:
        return cfg[key]
    if default is ...:
        raise ConfigError(f"{where}: config.json lacks {key!r}",
                          hint="is this a gpt_oss / deepseek_v3 config?")
    return default


def _positive(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key} = {value!r} must be a positive integer")
    return value


def _rope(cfg: Mapping[str, Any], where: str) -> RopeConfig:
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(scaling, Mapping):
        raise ConfigError(f"{where}: rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "yarn" if scaling else "default"))
    if kind not in ("yarn", "default"):
        raise ConfigError(f"{where}: rope_scaling type {kind!r} is not supported (yarn or none)")
    return RopeConfig(
        theta=float(_get(cfg, "rope_theta", where)),
        factor=float(scaling.get("factor", 1.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 4096)),
        beta_fast=float(scaling.get("beta_fast", 32.0)), beta_slow=float(scaling.get("beta_slow", 1.0)),
        mscale=float(scaling.get("mscale", 1.0)), mscale_all_dim=float(scaling.get("mscale_all_dim", 1.0)))


def _gpt_oss(cfg: Mapping[str, Any], name: str, source: tuple[str, ...]) -> ModelConfig:
    w = name
    layers = _positive(_get(cfg, "num_hidden_layers", w), "num_hidden_layers", w)
    window = int(_get(cfg, "sliding_window", w, 0) or 0)
    types = _get(cfg, "layer_types", w, None)
    if types is None:  # the reference code: even layers slide
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ConfigError(f"{w}: layer_types has {len(types)} entries for {layers} layers")
    bad = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
    if bad:
        raise ConfigError(f"{w}: unknown layer_types {bad}")
    quant = cfg.get("quantization_config") or {}
    experts = _positive(_get(cfg, "num_local_experts", w), "num_local_experts", w)
    hidden = _positive(_get(cfg, "hidden_size", w), "hidden_size", w)
    inter = _positive(_get(cfg, "intermediate_size", w), "intermediate_size", w)
    heads = _positive(_get(cfg, "num_attention_heads", w), "num_attention_heads", w)
    return ModelConfig(
        name=name, family="gpt_oss", source=source, hidden=hidden, layers=layers,
        vocab=_positive(_get(cfg, "vocab_size", w), "vocab_size", w), q_heads=heads,
        kv_heads=_positive(_get(cfg, "num_key_value_heads", w), "num_key_value_heads", w),
        head_dim=_positive(_get(cfg, "head_dim", w, hidden // heads), "head_dim", w),
        attention="gqa", attention_bias=bool(_get(cfg, "attention_bias", w, True)),
        sliding_window=window,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        sinks=True, rope=_rope(cfg, w), q_lora_rank=0, kv_lora_rank=0, qk_nope_dim=0, qk_rope_dim=0,
        v_head_dim=0, dense_intermediate=inter, moe_intermediate=inter, experts=experts,
        top_k=_positive(_get(cfg, "num_experts_per_tok", w, cfg.get("experts_per_token")),
                        "num_experts_per_tok", w),
        shared_experts=0, first_dense_layers=0, router="softmax_topk", routed_scaling_factor=1.0,
        n_group=1, topk_group=1, score_bias=False, router_bias=True, activation="swiglu_oai",
        expert_bias=True, rms_eps=float(_get(cfg, "rms_norm_eps", w)),
        expert_weight_fmt="fp4" if quant.get("quant_method") == "mxfp4" else "bf16", weight_fmt="bf16",
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", w, 131072)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_id=cfg.get("eos_token_id"))


def _deepseek(cfg: Mapping[str, Any], name: str, source: tuple[str, ...]) -> ModelConfig:
    w = name
    if "text_config" in cfg:  # Kimi K2.5 wraps the decoder config (the vision tower is not modelled)
        outer_quant = cfg.get("quantization_config")
        cfg = dict(cfg["text_config"], **({"quantization_config": outer_quant} if outer_quant else {}))
    layers = _positive(_get(cfg, "num_hidden_layers", w), "num_hidden_layers", w)
    heads = _positive(_get(cfg, "num_attention_heads", w), "num_attention_heads", w)
    nope = _positive(_get(cfg, "qk_nope_head_dim", w), "qk_nope_head_dim", w)
    rope_dim = _positive(_get(cfg, "qk_rope_head_dim", w), "qk_rope_head_dim", w)
    experts = int(_get(cfg, "n_routed_experts", w))
    n_group = int(_get(cfg, "n_group", w, 1) or 1)
    topk_group = int(_get(cfg, "topk_group", w, 1) or 1)
    scoring = _get(cfg, "scoring_func", w, "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"{w}: scoring_func {scoring!r} is not supported (DeepSeek-V3 uses sigmoid)")
    quant = cfg.get("quantization_config") or {}
    if experts % n_group or topk_group > n_group:
        raise ConfigError(f"{w}: n_group {n_group} must divide n_routed_experts {experts} and be "
                          f">= topk_group {topk_group}")
    if int(_get(cfg, "moe_layer_freq", w, 1)) != 1:
        raise ConfigError(f"{w}: moe_layer_freq other than 1 is not supported")
    return ModelConfig(
        name=name, family="deepseek_v3", source=source,
        hidden=_positive(_get(cfg, "hidden_size", w), "hidden_size", w), layers=layers,
        vocab=_positive(_get(cfg, "vocab_size", w), "vocab_size", w), q_heads=heads, kv_heads=heads,
        head_dim=nope + rope_dim, attention="mla", attention_bias=bool(cfg.get("attention_bias", False)),
        sliding_window=0, layer_windows=(0,) * layers, sinks=False, rope=_rope(cfg, w),
        q_lora_rank=int(_get(cfg, "q_lora_rank", w) or 0),
        kv_lora_rank=_positive(_get(cfg, "kv_lora_rank", w), "kv_lora_rank", w),
        qk_nope_dim=nope, qk_rope_dim=rope_dim,
        v_head_dim=_positive(_get(cfg, "v_head_dim", w), "v_head_dim", w),
        dense_intermediate=_positive(_get(cfg, "intermediate_size", w), "intermediate_size", w),
        moe_intermediate=_positive(_get(cfg, "moe_intermediate_size", w), "moe_intermediate_size", w),
        experts=experts, top_k=_positive(_get(cfg, "num_experts_per_tok", w), "num_experts_per_tok", w),
        shared_experts=int(_get(cfg, "n_shared_experts", w, 0) or 0),
        first_dense_layers=int(_get(cfg, "first_k_dense_replace", w, 0)), router="sigmoid_topk",
        routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", w, 1.0)), n_group=n_group,
        topk_group=topk_group, score_bias=_get(cfg, "topk_method", w, "noaux_tc") == "noaux_tc",
        router_bias=False, activation="silu", expert_bias=False,
        rms_eps=float(_get(cfg, "rms_norm_eps", w, 1e-6)),
        expert_weight_fmt="fp4" if quant.get("quant_method") == "mxfp4" else "bf16", weight_fmt="bf16",
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", w, 163840)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_id=cfg.get("eos_token_id"))


def from_hf_config(cfg: Mapping[str, Any], name: str = "model") -> ModelConfig:
    """A :class:`ModelConfig` from an HF ``config.json`` dict.

    Args:
        cfg: the parsed JSON (``model_type`` gpt_oss, deepseek_v3, kimi_k2 or kimi_k25; keys
            starting with ``_`` are our annotations: ``_source`` is kept, the rest ignored).
        name: what to call the model in reports.

    Raises:
        ConfigError: an unsupported model type or a missing/invalid field (named).
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{name}: config.json must hold a JSON object")
    source = tuple(str(s) for s in cfg.get("_source", ()))
    kind = cfg.get("model_type")
    if kind in _GPT_OSS_TYPES:
        out = _gpt_oss(cfg, name, source)
    elif kind in _DEEPSEEK_TYPES:
        out = _deepseek(cfg, name, source)
    else:
        raise ConfigError(f"{name}: model_type {kind!r} is not supported",
                          hint=f"supported: {', '.join(_GPT_OSS_TYPES + _DEEPSEEK_TYPES)}")
    if out.top_k > max(out.experts, 1) and out.experts:
        raise ConfigError(f"{name}: num_experts_per_tok {out.top_k} > experts {out.experts}")
    return out


def load_model_config(name_or_path: str) -> ModelConfig:
    """Load a shipped model by name (:data:`MODEL_NAMES`) or any ``config.json`` by path.

    Raises:
        ConfigError: unknown name (with the known ones), unreadable or invalid JSON, bad fields.
    """
    if name_or_path in MODEL_NAMES:
        text = resources.files("jalapeno_emu.model").joinpath("configs", f"{name_or_path}.json").read_text()
        name = name_or_path
    elif os.path.exists(name_or_path):
        # Not a plain open(): a FIFO or a device at the path would block or never end.
        data = read_input_bytes(name_or_path, what="model config", error=ConfigError)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{name_or_path}: not UTF-8 text (byte {exc.start}); expected a "
                              "config.json") from None
        name = os.path.splitext(os.path.basename(name_or_path))[0]
    else:
        import difflib

        close = difflib.get_close_matches(name_or_path, MODEL_NAMES, n=2)
        hint = f"did you mean {' or '.join(close)}?" if close else f"known: {', '.join(MODEL_NAMES)}"
        raise ConfigError(f"no model named {name_or_path!r} (and no such config.json file)", hint=hint)
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name_or_path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    return from_hf_config(cfg, name)
