"""Shared helpers of the moe tests: the layer in float64 from the models' definitions (an oracle
independent of the kernel's references), and routers crafted to route each token to given experts."""

import ml_dtypes
import numpy as np

from jalapeno_emu import mx
from jalapeno_emu.kernels.moe import plan_moe, router_panels, unpack_expert_biases, unpack_experts


def oracle(inputs, shape, spec, use_biases=True, **route_kw):
    """The layer in float64 from the model's definition (no activation quantisation, any order):
    (y [T, H], chosen expert ids [T, k])."""
    p = plan_moe(shape, spec)
    x = np.asarray(inputs["x"], np.float64)
    y = np.zeros_like(x)
    ids = np.zeros((p.t, 0), np.int64)
    if p.e:
        ids, w = route_oracle(inputs, shape, p, x, **route_kw)
        routed = unpack_experts(inputs["experts"], p)
        biases = unpack_expert_biases(inputs["experts"], p) if p.expert_bias and use_biases else [None] * p.e
        for t in range(p.t):
            for j in range(p.k):
                e = ids[t, j]
                y[t] += w[t, j] * ffn_oracle(routed[e], x[t:t + 1], shape, biases[e])[0]
    shared_b = unpack_expert_biases(inputs["shared"], p) if p.s and p.expert_bias and use_biases else \
        [None] * p.s
    for weights, b in zip(unpack_experts(inputs["shared"], p) if p.s else [], shared_b, strict=True):
        y += ffn_oracle(weights, x, shape, b)
    return y, ids


def ffn_oracle(weights, xs, shape, biases=None):
    g, u, d = (np.asarray(mx.dequantize(a), np.float64) for a in weights)
    gate, up = xs @ g, xs @ u
    if biases is not None:  # gpt-oss mlp1 bias before the activation
        gate, up = gate + biases[0], up + biases[1]
    if shape["activation"] == "swiglu_oai":
        gate, up = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
        act = gate / (1 + np.exp(-1.702 * gate)) * (up + 1)
    else:
        act = gate / (1 + np.exp(-gate)) * up
    return act @ d + (biases[2] if biases is not None else 0.0)  # mlp2 bias, inside the weighting


def route_oracle(inputs, shape, p, x, groups=True, score_bias=True):
    """(ids [T, k], weights [T, k]): gpt-oss softmax over the top-k biased logits; DeepSeek-V3's
    MoEGate (HF): sigmoid scores, noaux_tc selection on scores + e_score_correction_bias within
    the top topk_group groups (group score: the sum of its best two; other groups masked to 0),
    weights the chosen unbiased scores / (sum + 1e-20) * routed_scaling_factor."""
    panels = np.asarray(inputs["router"], np.float64)
    wr = np.concatenate([panels[r * p.h:(r + 1) * p.h] for r in range(p.router_parts)], axis=1)
    logits = x @ wr
    if shape["router"] == "softmax_topk":
        logits = logits + np.asarray(inputs["router_bias"], np.float64)
        ids = np.argsort(-logits, axis=1, kind="stable")[:, :p.k]
        vals = np.take_along_axis(logits, ids, axis=1)
        w = np.exp(vals - vals[:, :1])
        return ids, w / w.sum(axis=1, keepdims=True)
    scores = 1 / (1 + np.exp(-logits))
    sel = scores.copy()
    if shape["score_bias"] and score_bias:
        sel = sel + np.asarray(inputs["score_bias"], np.float64)
    n_group, width = shape["n_group"], p.e // shape["n_group"]
    if n_group > 1 and groups:
        group_scores = np.sort(sel.reshape(p.t, n_group, width), axis=-1)[..., -2:].sum(-1)
        kept = np.argsort(-group_scores, axis=1, kind="stable")[:, :shape["topk_group"]]
        keep = np.zeros((p.t, n_group))
        np.put_along_axis(keep, kept, 1.0, axis=1)
        sel = np.where(np.repeat(keep, width, axis=1) > 0, sel, 0.0)
    ids = np.argsort(-sel, axis=1, kind="stable")[:, :p.k]
    w = np.take_along_axis(scores, ids, axis=1)
    return ids, w / (w.sum(axis=1, keepdims=True) + 1e-20) * shape["routed_scaling_factor"]


def route_tokens(inputs: dict, p, picks: list[tuple[int, ...]], scale: float = 8.0) -> None:
    """Make ``inputs`` route token t to experts ``picks[t]`` (in that order of preference): x's
    first T columns become ``scale`` * one-hot(t) and the router's row t gives expert picks[t][j]
    a logit of 1 - 0.1 j (0 elsewhere); router and score biases 0. The other columns of x keep their
    random values, so the experts' inputs stay varied."""
    t, h, e = p.t, p.h, p.e
    x = np.asarray(inputs["x"], np.float32).copy()
    x[:, :t] = 0
    x[np.arange(t), np.arange(t)] = scale
    wr = np.zeros((h, e), np.float32)
    for tok, experts in enumerate(picks):
        for j, ex in enumerate(experts):
            wr[tok, ex] = 1.0 - 0.1 * j
    inputs["x"] = x.astype(ml_dtypes.bfloat16)
    inputs["router"] = router_panels(wr.astype(ml_dtypes.bfloat16), p)
    for name in ("router_bias", "score_bias"):
        if name in inputs:
            inputs[name] = np.zeros_like(inputs[name])


def rel(got, want) -> float:
    """Relative L2 error of ``got`` against ``want``."""
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))
