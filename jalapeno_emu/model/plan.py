"""A layer as a sequence of kernel launches: which kernels, with which shapes, in which order.

Stage: model. Pure functions from a :class:`ModelConfig` and a step (decode: ``batch`` sequences
of ``context`` cached tokens, one new token each; prefill: ``batch`` sequences each adding a chunk
of ``seq`` prompt tokens after ``prior`` cached ones) to a tuple of :class:`Launch`. The timing
and functional runners both read these plans, so what is timed is what runs.

gpt-oss layer (GQA)::

    attn_norm   rmsnorm        h = x + residual; y = norm(h)      (the residual add is fused here)
    qkv_proj    gemm           [q | k | v] = y @ Wqkv + b          (BF16 weights)
    kv_append   kv-append      rotate k, write k and v into the cache      (decode)
    attention   attention-*    decode: one query per sequence; prefill: causal over the chunk,
                               rotating and writing the chunk's k and v into the cache itself
    o_proj      gemm           o @ Wo + b
    ffn_norm    rmsnorm        h' = attn_out + h; y' = norm(h')
    moe         moe            router, top-k, MXFP4 experts, combine (its output is the next
                               layer's ``x``; the residual add is fused into the next norm)

DeepSeek-V3 / Kimi layer (MLA)::

    attn_norm   rmsnorm
    qkv_a_proj  gemm           [q_a | c_kv | k_pe] = y @ [Wq_a | Wkv_a]     (fused, as vLLM does)
    q_a_norm    rmsnorm        (no residual)
    kv_a_norm   rmsnorm        (no residual)
    q_b_proj    gemm           q = norm(q_a) @ Wq_b
    mla_append  mla-append     rotate q_pe and k_pe, write [c_kv | k_pe] rows into the latent cache
    attention   mla-decode (absorbed) / mla-prefill (naive)
    o_proj      gemm
    ffn_norm    rmsnorm
    moe | ffn   moe            routed + shared experts; dense layers: experts=0, shared=1

Model head and tail: ``embedding`` before layer 0; ``final_norm`` (rmsnorm, fusing the last
residual add) and ``logits`` (the unembedding GEMM) after the last layer. Prefill computes logits
only for each sequence's last token (what generation needs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.kernels.registry import get_kernel

from .config import ModelConfig

__all__ = ["Launch", "Step", "head_launches", "launch", "layer_launches", "tail_launches"]

Phase = Literal["decode", "prefill"]


@dataclass(frozen=True)
class Step:
    """What one forward step computes.

    Attributes:
        phase: ``decode`` (one new token per sequence) or ``prefill`` (a chunk of prompt tokens).
        batch: sequences in the step.
        context: decode: tokens in each sequence's cache counting the new one.
        seq: prefill: new prompt tokens per sequence in this chunk.
        prior: prefill: tokens already cached per sequence before this chunk.
        routing: MoE expert slots: ``uniform`` (expected distinct experts under uniform routing,
            for timing) or ``any`` (enough for every routing, for functional runs).
    """

    phase: Phase
    batch: int
    context: int = 0
    seq: int = 0
    prior: int = 0
    routing: str = "uniform"

    def __post_init__(self) -> None:
        if self.phase not in ("decode", "prefill"):
            raise InvalidArgumentError(f"phase {self.phase!r} must be decode or prefill")
        if self.batch < 1:
            raise InvalidArgumentError(f"batch {self.batch} must be >= 1")
        if self.phase == "decode" and self.context < 1:
            raise InvalidArgumentError(f"decode context {self.context} must be >= 1 (the new token counts)")
        if self.phase == "prefill" and self.seq < 1:
            raise InvalidArgumentError(f"prefill seq {self.seq} must be >= 1")
        if self.prior < 0:
            raise InvalidArgumentError(f"prior {self.prior} must be >= 0")

    @property
    def tokens(self) -> int:
        """New tokens the step computes (rows of every GEMM)."""
        return self.batch if self.phase == "decode" else self.batch * self.seq

    @property
    def positions(self) -> int:
        """Tokens in each sequence's cache after the step."""
        return self.context if self.phase == "decode" else self.prior + self.seq


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a plan.

    Attributes:
        label: its role in the layer (``qkv_proj``, ``attention``, ``moe``, ...).
        kernel: the registered kernel name.
        shape: its full shape (every key of the kernel, defaults filled in), as sorted items so
            that launches hash (identical launches are timed once).
    """

    label: str
    kernel: str
    shape: tuple[tuple[str, Any], ...]

    @property
    def shape_dict(self) -> dict[str, Any]:
        """The shape as a dict."""
        return dict(self.shape)


def _launch(label: str, kernel: str, **keys: Any) -> Launch:
    """A launch with its full shape; a key the kernel does not have is a planner bug."""
    full = get_kernel(kernel).shape(keys)
    return Launch(label, kernel, tuple(sorted(full.items())))


def launch(label: str, kernel: str, **keys: Any) -> Launch:
    """A launch of ``kernel`` with its full shape (the kernel's defaults for keys not given).

    The planner's own helper, public for code that builds launches the plan does not (the rack
    model's per-chip slices, e.g. a MoE launch for the tokens routed to one chip).

    Raises:
        InvalidArgumentError: a key the kernel does not have, or a value out of its range.
    """
    return _launch(label, kernel, **keys)


def _rmsnorm(label: str, cfg: ModelConfig, tokens: int, hidden: int, residual: bool = True) -> Launch:
    return _launch(label, "rmsnorm", tokens=tokens, hidden=hidden, eps=cfg.rms_eps, residual=residual)


def _gemm(label: str, cfg: ModelConfig, m: int, n: int, k: int, bias: bool) -> Launch:
    return _launch(label, "gemm", m=m, n=n, k=k, weight_fmt=cfg.weight_fmt, act_fmt="bf16", bias=bias)


def _ffn(cfg: ModelConfig, layer: int, tokens: int, routing: str) -> Launch:
    if not cfg.is_moe(layer):
        return _launch("ffn", "moe", tokens=tokens, hidden=cfg.hidden, intermediate=cfg.dense_intermediate,
                       experts=0, top_k=1, shared_experts=1, activation=cfg.activation)
    keys: dict[str, Any] = dict(
        tokens=tokens, hidden=cfg.hidden, intermediate=cfg.moe_intermediate, experts=cfg.experts,
        top_k=cfg.top_k, shared_experts=cfg.shared_experts, activation=cfg.activation,
        router=cfg.router, routing=routing, expert_bias=cfg.expert_bias)
    if cfg.router == "sigmoid_topk":
        keys.update(routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group,
                    topk_group=cfg.topk_group, score_bias=cfg.score_bias)
    return _launch("moe", "moe", **keys)


def _gqa_attention(cfg: ModelConfig, layer: int, step: Step) -> list[Launch]:
    common = dict(q_heads=cfg.q_heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                  window=cfg.window(layer), sinks=cfg.sinks)
    if step.phase == "decode":
        return [_launch("kv_append", "kv-append", batch=step.batch, context=step.context,
                        kv_heads=cfg.kv_heads, head_dim=cfg.head_dim),
                _launch("attention", "attention-decode", batch=step.batch, context=step.context, **common)]
    return [_launch("attention", "attention-prefill", batch=step.batch, seq=step.seq, prior=step.prior,
                    **common)]


def _mla_attention(cfg: ModelConfig, step: Step) -> list[Launch]:
    dims = dict(q_heads=cfg.q_heads, kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_dim,
                nope_dim=cfg.qk_nope_dim, v_head_dim=cfg.v_head_dim, softmax_scale=mla_softmax_scale(cfg))
    append = dict(q_heads=cfg.q_heads, nope_dim=cfg.qk_nope_dim, rope_dim=cfg.qk_rope_dim,
                  kv_lora_rank=cfg.kv_lora_rank)
    if step.phase == "decode":
        return [_launch("mla_append", "mla-append", batch=step.batch, context=step.context, **append),
                _launch("attention", "mla-decode", batch=step.batch, context=step.context, **dims)]
    return [_launch("mla_append", "mla-append", batch=step.batch, context=step.positions,
                    tokens=step.seq, **append),
            _launch("attention", "mla-prefill", batch=step.batch, seq=step.seq, prior=step.prior, **dims)]


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """DeepSeek-V3's attention scale: 1/sqrt(qk_head_dim) times mscale^2 under YaRN
    (mscale = 0.1 * mscale_all_dim * ln(factor) + 1 when factor > 1)."""
    import math

    scale = 1.0 / math.sqrt(cfg.qk_nope_dim + cfg.qk_rope_dim)
    r = cfg.rope
    if r.factor > 1.0 and r.mscale_all_dim:
        m = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
        scale *= m * m
    return scale


def layer_launches(cfg: ModelConfig, layer: int, step: Step) -> tuple[Launch, ...]:
    """The kernel launches of decoder layer ``layer`` (0-based) for ``step``, in order.

    Raises:
        ConfigError: no such layer. InvalidArgumentError: a shape a kernel refuses (from the
            kernel's own checks, e.g. a context past what the plan allows).
    """
    cfg.window(layer)  # validates the index
    t = step.tokens
    out = [_rmsnorm("attn_norm", cfg, t, cfg.hidden)]
    if cfg.attention == "gqa":
        qkv = (cfg.q_heads + 2 * cfg.kv_heads) * cfg.head_dim
        out.append(_gemm("qkv_proj", cfg, t, qkv, cfg.hidden, cfg.attention_bias))
        out += _gqa_attention(cfg, layer, step)
        out.append(_gemm("o_proj", cfg, t, cfg.hidden, cfg.q_heads * cfg.head_dim, cfg.attention_bias))
    else:
        q_width = cfg.q_heads * (cfg.qk_nope_dim + cfg.qk_rope_dim)
        if cfg.q_lora_rank:
            out.append(_gemm("qkv_a_proj", cfg, t, cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_dim,
                             cfg.hidden, False))
            out.append(_rmsnorm("q_a_norm", cfg, t, cfg.q_lora_rank, residual=False))
            out.append(_rmsnorm("kv_a_norm", cfg, t, cfg.kv_lora_rank, residual=False))
            out.append(_gemm("q_b_proj", cfg, t, q_width, cfg.q_lora_rank, False))
        else:
            out.append(_gemm("qkv_a_proj", cfg, t, q_width + cfg.kv_lora_rank + cfg.qk_rope_dim,
                             cfg.hidden, False))
            out.append(_rmsnorm("kv_a_norm", cfg, t, cfg.kv_lora_rank, residual=False))
        out += _mla_attention(cfg, step)
        out.append(_gemm("o_proj", cfg, t, cfg.hidden, cfg.q_heads * cfg.v_head_dim, False))
    out.append(_rmsnorm("ffn_norm", cfg, t, cfg.hidden))
    out.append(_ffn(cfg, layer, t, step.routing))
    return tuple(out)


def head_launches(cfg: ModelConfig, step: Step) -> tuple[Launch, ...]:
    """Before layer 0: the embedding lookup of the step's new tokens."""
    return (_launch("embedding", "embedding", tokens=step.tokens, vocab=cfg.vocab, hidden=cfg.hidden),)


def tail_launches(cfg: ModelConfig, step: Step) -> tuple[Launch, ...]:
    """After the last layer: the final norm (fusing the last residual add) and the logits GEMM,
    for one token per sequence (decode: the new one; prefill: the chunk's last)."""
    rows = step.batch
    return (_rmsnorm("final_norm", cfg, rows, cfg.hidden),
            _launch("logits", "logits", tokens=rows, hidden=cfg.hidden, vocab=cfg.vocab,
                    weight_fmt=cfg.weight_fmt, act_fmt="bf16"))

