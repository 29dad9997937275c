"""What a model keeps in HBM: weight bytes per layer in the checkpoint's formats, KV-cache bytes.

Stage: model. Pure arithmetic on a :class:`ModelConfig` (no kernels are built), so the capacity
check of a 1-trillion-parameter model is instant. Formats: BF16 is 2 bytes per element; MXFP4 is
4-bit codes plus one 8-bit E8M0 scale per 32 elements, 4.25 bits per element (what the kernels'
packed expert tables hold: ``kernels.moe`` stores 1.59375 * H * I bytes per expert = 3 * H * I
elements at 4.25 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

from jalapeno_emu.chip import MX_BLOCK, ChipSpec
from jalapeno_emu.isa.table import DTYPES

from .config import ModelConfig

__all__ = ["Footprint", "fmt_bytes_per_element", "footprint", "kv_cache_bytes", "layer_weight_bytes",
           "model_weight_bytes"]

def fmt_bytes_per_element(fmt: str) -> float:
    """Bytes one element of ISA dtype ``fmt`` takes in HBM; MX formats include their share of
    the one-byte E8M0 scale of each 32-element block."""
    dt = DTYPES[fmt]
    return dt.bits / 8 + (1 / MX_BLOCK if dt.mx_fmt else 0.0)


def _attention_weight_bytes(cfg: ModelConfig) -> float:
    w = fmt_bytes_per_element(cfg.weight_fmt)
    h = cfg.hidden
    if cfg.attention == "gqa":
        qkv = (cfg.q_heads + 2 * cfg.kv_heads) * cfg.head_dim
        o_in = cfg.q_heads * cfg.head_dim
        elems = h * qkv + o_in * h
        bias = (qkv + h) * 2 if cfg.attention_bias else 0
        sinks = cfg.q_heads * 4 if cfg.sinks else 0
        return elems * w + bias + sinks
    qk = cfg.qk_nope_dim + cfg.qk_rope_dim
    lora = cfg.q_lora_rank
    q = h * lora + lora * cfg.q_heads * qk if lora else h * cfg.q_heads * qk
    kv_a = h * (cfg.kv_lora_rank + cfg.qk_rope_dim)
    kv_b = cfg.kv_lora_rank * cfg.q_heads * (cfg.qk_nope_dim + cfg.v_head_dim)
    o = cfg.q_heads * cfg.v_head_dim * h
    norms = (cfg.q_lora_rank + cfg.kv_lora_rank) * 2
    return (q + kv_a + kv_b + o) * w + norms


def _ffn_weight_bytes(cfg: ModelConfig, layer: int) -> float:
    e = fmt_bytes_per_element(cfg.expert_weight_fmt)
    h = cfg.hidden
    if not cfg.is_moe(layer):
        return 3 * h * cfg.dense_intermediate * e
    i = cfg.moe_intermediate
    per_expert = 3 * h * i * e + ((2 * i + h) * 2 if cfg.expert_bias else 0)
    router = h * cfg.experts * 2 + (cfg.experts * 2 if cfg.router_bias else 0)
    score_bias = cfg.experts * 4 if cfg.score_bias else 0
    return (cfg.experts + cfg.shared_experts) * per_expert + router + score_bias


def layer_weight_bytes(cfg: ModelConfig, layer: int) -> dict[str, float]:
    """Weight bytes of one decoder layer: ``attention``, ``ffn`` (router and experts included),
    ``norms`` and ``total``."""
    cfg.window(layer)
    out = {"attention": _attention_weight_bytes(cfg), "ffn": _ffn_weight_bytes(cfg, layer),
           "norms": 2 * cfg.hidden * 2}
    out["total"] = sum(out.values())
    return out


def kv_cache_bytes(cfg: ModelConfig, tokens: int, *, kv_dtype_bytes: int = 2) -> int:
    """KV-cache bytes of ONE sequence holding ``tokens`` tokens, all layers.

    Sliding-window layers keep only their last ``window`` tokens (a ring buffer: what a serving
    runtime allocates for them); full layers keep every token.
    """
    total = 0
    for layer in range(cfg.layers):
        w = cfg.window(layer)
        kept = min(tokens, w) if w else tokens
        total += kept * cfg.kv_bytes_per_token(layer, kv_dtype_bytes)
    return total


@dataclass(frozen=True)
class Footprint:
    """HBM use of a model serving ``batch`` sequences of ``tokens`` tokens on one die.

    Attributes:
        weight_bytes: all weights (layers, embedding, final norm, unembedding).
        kv_cache_bytes: the KV cache of every sequence.
        capacity_bytes: the die's HBM.
        fits: weights plus KV cache fit the HBM.
        weight_share, kv_share: shares of the capacity.
        max_sequences: sequences of this length the space after the weights holds (0 if none).
    """

    weight_bytes: float
    kv_cache_bytes: float
    capacity_bytes: int
    fits: bool
    weight_share: float
    kv_share: float
    max_sequences: int

    def as_dict(self) -> dict[str, float | int | bool]:
        """JSON form."""
        return {"weight_bytes": self.weight_bytes, "kv_cache_bytes": self.kv_cache_bytes,
                "capacity_bytes": self.capacity_bytes, "fits": self.fits,
                "weight_share": self.weight_share, "kv_share": self.kv_share,
                "max_sequences": self.max_sequences}


def model_weight_bytes(cfg: ModelConfig) -> float:
    """Every weight of the model in HBM, bytes."""
    layers = sum(layer_weight_bytes(cfg, i)["total"] for i in range(cfg.layers))
    embed = cfg.vocab * cfg.hidden * 2
    unembed = 0 if cfg.tie_word_embeddings else cfg.vocab * cfg.hidden * fmt_bytes_per_element(cfg.weight_fmt)
    return layers + embed + unembed + cfg.hidden * 2


def footprint(cfg: ModelConfig, spec: ChipSpec, *, batch: int, tokens: int) -> Footprint:
    """Weights and KV cache of ``batch`` sequences of ``tokens`` tokens against one die's HBM."""
    cap = spec.hbm.capacity_bytes
    w = model_weight_bytes(cfg)
    per_seq = kv_cache_bytes(cfg, tokens)
    kv = batch * per_seq
    room = cap - w
    return Footprint(weight_bytes=w, kv_cache_bytes=kv, capacity_bytes=cap, fits=w + kv <= cap,
                     weight_share=w / cap, kv_share=kv / cap,
                     max_sequences=int(room // per_seq) if room > 0 and per_seq else 0)
