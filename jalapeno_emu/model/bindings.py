"""Bindings between a model's tensors (natural layouts) and each kernel's HBM layout.

Stage: model. ``run_layer`` runs one decoder layer's launches on a :class:`~model.die.DieModel`:
for each launch it lays the tensors out the way the kernel's docstring specifies (K^T blocks for
attention-decode's cache, stacked router panels and packed expert tables for moe, ...), runs it
and converts what the model keeps (the new residual stream, the updated KV cache) back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from .plan import Launch, Step
from .weights import LayerWeights

if TYPE_CHECKING:  # the die imports this module
    from .die import DieModel

__all__ = ["CONSTANT_INPUTS", "pack_layer", "run_layer"]

_BF16 = ml_dtypes.bfloat16

CONSTANT_INPUTS = frozenset({"eps", "mask", "ones", "causal_mask"})
"""Inputs a kernel's own ``make_inputs`` fills with constants that depend only on its shape
(rmsnorm's eps, attention's additive mask tiles, moe's ones row): taken from there, never bound."""


def pack_layer(lw: LayerWeights) -> dict[str, Any]:
    """Per-layer weights in forms every step reuses (row vectors as [1, n], sinks as [Hq, 1]).

    The MoE tables depend on the launch's shape (the kernel's slice plan), so ``moe_inputs``
    packs them per distinct launch and caches them here under ``("moe", shape)``.
    """
    out: dict[str, Any] = {"attn_norm": lw.attn_norm[None, :], "ffn_norm": lw.ffn_norm[None, :]}
    if lw.bqkv is not None:
        out["bqkv"] = lw.bqkv[None, :]
    if lw.bo is not None:
        out["bo"] = lw.bo[None, :]
    if lw.sinks is not None:
        out["sinks"] = np.asarray(lw.sinks, np.float32)[:, None]
    if lw.q_a_norm is not None:
        out["q_a_norm"], out["kv_a_norm"] = lw.q_a_norm[None, :], lw.kv_a_norm[None, :]
    return out


def _by_label(plan: tuple[Launch, ...]) -> dict[str, Launch]:
    return {x.label: x for x in plan}


# --- GQA ----------------------------------------------------------------------------------------
def _k_cache_layout(k: np.ndarray, cap: int, width: int) -> np.ndarray:
    """Logical rotated keys [B, G, T, D] -> attention-decode's K^T rows [B*G*D, width] (T <= cap,
    zero beyond: those columns are masked)."""
    b, g, t, d = k.shape
    out = np.zeros((b, g, d, width), _BF16)
    out[..., :t] = k.transpose(0, 1, 3, 2)
    return out.reshape(b * g * d, width)


def _v_cache_layout(v: np.ndarray, cap: int) -> np.ndarray:
    b, g, t, d = v.shape
    out = np.zeros((b, g, cap, d), _BF16)
    out[:, :, :t] = v
    return out.reshape(b * g * cap, d)


def _gqa_decode(die: DieModel, i: int, lw: LayerWeights, pk: dict, launches: dict[str, Launch],
                y: np.ndarray, step: Step) -> np.ndarray:
    cfg = die.cfg
    b, ctx, hq, hkv, d = step.batch, step.context, cfg.q_heads, cfg.kv_heads, cfg.head_dim
    qkv = die.run(launches["qkv_proj"], {"x": y, "w": lw.wqkv, "bias": pk.get("bqkv")})["y"]
    q, k_new, v_new = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d], qkv[:, (hq + hkv) * d:]
    app = launches["kv_append"]
    width = die.tensor_shape(app, "k_cache")[1]
    cap = -(-ctx // 32) * 32
    kc = _k_cache_layout(die.k_cache[i][:, :, :ctx - 1], cap, width)
    vc = _v_cache_layout(die.v_cache[i][:, :, :ctx - 1], cap)
    pos = slice(ctx - 1, ctx)
    caches = die.run(app, {"k_new": k_new, "v_new": v_new, "rope_cos": die.cos[pos], "rope_sin": die.sin[pos],
                           "k_cache": kc, "v_cache": vc})
    kt = caches["k_cache"].reshape(b, hkv, d, width)
    die.k_cache[i][:, :, ctx - 1] = kt[..., ctx - 1]
    die.v_cache[i][:, :, ctx - 1] = caches["v_cache"].reshape(b, hkv, cap, d)[:, :, ctx - 1]
    data = {"q": q.reshape(b * hq, d), "k_cache": caches["k_cache"], "v_cache": caches["v_cache"],
            "rope_cos": die.cos[:ctx], "rope_sin": die.sin[:ctx]}
    if cfg.sinks:
        data["sinks"] = pk["sinks"]
    out = die.run(launches["attention"], data)["out"].reshape(b, hq * d)
    return die.run(launches["o_proj"], {"x": out, "w": lw.wo, "bias": pk.get("bo")})["y"]


def _gqa_prefill(die: DieModel, i: int, lw: LayerWeights, pk: dict, launches: dict[str, Launch],
                 y: np.ndarray, step: Step) -> np.ndarray:
    cfg = die.cfg
    b, s, prior, hq, hkv, d = step.batch, step.seq, step.prior, cfg.q_heads, cfg.kv_heads, cfg.head_dim
    ctx = prior + s
    qkv = die.run(launches["qkv_proj"], {"x": y, "w": lw.wqkv, "bias": pk.get("bqkv")})["y"]
    q, k, v = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d], qkv[:, (hq + hkv) * d:]
    att = launches["attention"]
    width = die.tensor_shape(att, "k_cache")[1]
    cap = die.tensor_shape(att, "v_cache")[0] // (b * hkv)
    kt = k.reshape(b, s, hkv, d).transpose(0, 2, 3, 1).reshape(b * hkv * d, s)
    data = {"q": q, "k": np.ascontiguousarray(kt), "v": v,
            "k_cache": _k_cache_layout(die.k_cache[i][:, :, :prior], cap, width),
            "v_cache": _v_cache_layout(die.v_cache[i][:, :, :prior], cap),
            "rope_cos": die.cos[:ctx], "rope_sin": die.sin[:ctx],
            "rope_cos_t": np.ascontiguousarray(die.cos[:ctx].T),
            "rope_sin_t": np.ascontiguousarray(die.sin[:ctx].T)}
    if cfg.sinks:
        data["sinks"] = pk["sinks"]
    got = die.run(att, data)
    new_k = got["k_cache"].reshape(b, hkv, d, width)[..., prior:ctx]
    die.k_cache[i][:, :, prior:ctx] = new_k.transpose(0, 1, 3, 2)
    die.v_cache[i][:, :, prior:ctx] = got["v_cache"].reshape(b, hkv, cap, d)[:, :, prior:ctx]
    return die.run(launches["o_proj"], {"x": got["out"], "w": lw.wo, "bias": pk.get("bo")})["y"]


# --- MLA ----------------------------------------------------------------------------------------
def _mla(die: DieModel, i: int, lw: LayerWeights, pk: dict, launches: dict[str, Launch],
         y: np.ndarray, step: Step) -> np.ndarray:
    """MLA for decode (one new token) and prefill (a chunk after ``prior`` cached tokens): the
    projections, ``mla-append`` writing the new latent rows, then mla-decode / mla-prefill."""
    cfg = die.cfg
    b, h, new, ctx = step.batch, cfg.q_heads, step.tokens // step.batch, step.positions
    ql, r, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_dim
    a = die.run(launches["qkv_a_proj"], {"x": y, "w": lw.wqkv_a})["y"]
    qa = die.run(launches["q_a_norm"], {"x": np.ascontiguousarray(a[:, :ql]), "w": pk["q_a_norm"]})["y"]
    c = die.run(launches["kv_a_norm"], {"x": np.ascontiguousarray(a[:, ql:ql + r]),
                                        "w": pk["kv_a_norm"]})["y"]
    q = die.run(launches["q_b_proj"], {"x": qa, "w": lw.wq_b})["y"].reshape(b * new * h, -1)
    # The latent cache is padded to whole 32-token blocks per sequence (rows b*cap + position),
    # the layout mla-append, mla-decode and mla-prefill share.
    cap = die.tensor_shape(launches["mla_append"], "kv_cache")[0] // b
    lat = np.zeros((b, cap, r + rope), _BF16)
    lat[:, :ctx - new] = die.latent[i][:, :ctx - new]
    pos = slice(ctx - new, ctx)
    got = die.run(launches["mla_append"], {"q": q, "kv_a": np.concatenate([c, a[:, -rope:]], axis=1),
                                           "rope_cos": die.cos[pos], "rope_sin": die.sin[pos],
                                           "kv_cache": lat.reshape(b * cap, r + rope)})
    cache = got["kv_cache"]
    die.latent[i][:, ctx - new:ctx] = cache.reshape(b, cap, r + rope)[:, ctx - new:ctx]
    out = die.run(launches["attention"], {"q": got["q_rot"], "kv_cache": cache, "w_kv_b": lw.w_kv_b})["out"]
    return die.run(launches["o_proj"], {"x": out.reshape(b * new, -1), "w": lw.wo})["y"]


# --- layer --------------------------------------------------------------------------------------
def run_layer(die: DieModel, i: int, plan: tuple[Launch, ...], step: Step, x: np.ndarray,
              residual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Run decoder layer ``i``'s launches; returns (FFN output, residual stream) [tokens, H] BF16."""
    from .moe_binding import moe_inputs

    cfg, lw, pk = die.cfg, die.w.layers[i], die.packed[i]
    launches = _by_label(plan)
    normed = die.run(launches["attn_norm"], {"x": x, "residual": residual, "w": pk["attn_norm"]})
    y, h = normed["y"], normed["h"]
    if cfg.attention == "gqa":
        attn = (_gqa_decode if step.phase == "decode" else _gqa_prefill)(die, i, lw, pk, launches, y, step)
    else:
        attn = _mla(die, i, lw, pk, launches, y, step)
    normed = die.run(launches["ffn_norm"], {"x": attn, "residual": h, "w": pk["ffn_norm"]})
    ffn = launches.get("moe") or launches["ffn"]
    out = die.run(ffn, moe_inputs(die, i, ffn, normed["y"]))["y"]
    return out, normed["h"]
