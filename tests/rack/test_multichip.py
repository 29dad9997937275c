"""ShardedModel: a tiny model under tensor and expert parallelism gives the one-chip reference's tokens.

The reductions are checked in this process with ``jax.vmap`` axis names standing for the mesh axes
(JAX's collectives work under vmap, no devices needed). Whole models run on 4 emulated chips in a
subprocess, because XLA's host device count must be set before JAX starts its backend.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jalapeno_emu import mx
from jalapeno_emu.emu.functional import inorder_block_matmul
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.model import load_model_config
from jalapeno_emu.model.reference import _experts_sum, _params, route
from jalapeno_emu.model.weights import init_weights
from jalapeno_emu.rack import multichip
from jalapeno_emu.rack.multichip import EP, TP, ShardedModel

PSUM_LOGIT_TOLERANCE = 0.03
"""psum mode: max |logit difference| over every step, as a fraction of the largest |logit|.
Measured (tp=2, ep=2): 0 on every tiny model at batch 2 x 16 tokens (seeds 0-2); 0.97 % on
tiny-gpt-oss at batch 8 x 32 tokens (seed 3), where reordered FP32 sums crossed BF16 rounding
boundaries. One BF16 ulp of a logit is 0.4 %; the bound leaves 3x the measured worst case."""


@pytest.fixture(scope="module")
def gpt_oss():
    cfg = load_model_config("tiny-gpt-oss")
    return cfg, init_weights(cfg, 0)


def _bf16_values(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> jnp.ndarray:
    return jnp.asarray((scale * rng.standard_normal(shape)).astype(jnp.bfloat16).astype(np.float32))


# --- partitions the model does not allow ------------------------------------------------------
@pytest.mark.parametrize("name, kwargs, message", [
    ("tiny-gpt-oss", {"tp": 4, "ep": 1}, "kv_heads=2 does not split into 4"),
    ("tiny-gpt-oss", {"tp": 1, "ep": 3}, "experts=8 does not split into 3"),
    ("tiny-deepseek", {"tp": 4, "ep": 1}, "moe_intermediate=64 does not split into 4 equal parts of whole"),
    ("tiny-gpt-oss", {"tp": 0, "ep": 1}, "tp=0 must be an integer >= 1"),
    ("tiny-gpt-oss", {"tp": 1, "ep": 1, "reduce": "ring"}, "reduce='ring' is not one of"),
    ("tiny-gpt-oss", {"tp": 1, "ep": 1, "batch": 0}, "batch=0 must be an integer >= 1"),
])
def test_bad_partitions_are_refused_before_anything_is_built(name, kwargs, message):
    args = {"batch": 1, "max_positions": 8, **kwargs}
    with pytest.raises(InvalidArgumentError, match=message):
        ShardedModel(load_model_config(name), None, **args)


def test_too_few_devices_says_how_to_get_more(gpt_oss):
    cfg, w = gpt_oss
    with pytest.raises(InvalidArgumentError, match="needs 4 devices, 1 available") as err:
        ShardedModel(cfg, w, tp=2, ep=2, batch=1, max_positions=8, devices=jax.devices()[:1])
    assert "xla_force_host_platform_device_count=4" in str(err.value)


def test_forward_refuses_bad_ids(gpt_oss):
    cfg, w = gpt_oss
    model = ShardedModel(cfg, w, tp=1, ep=1, batch=2, max_positions=4, devices=jax.devices()[:1])
    with pytest.raises(InvalidArgumentError, match="must be \\[batch=2"):
        model.forward(np.zeros((1, 3), np.int64))
    with pytest.raises(InvalidArgumentError, match="5 positions exceed max_positions=4"):
        model.forward(np.zeros((2, 5), np.int64))


# --- layouts ---------------------------------------------------------------------------------
def test_qkv_columns_are_regrouped_rank_by_rank(gpt_oss):
    cfg, _ = gpt_oss  # 4 query heads, 2 KV heads, head_dim 32: q 0..127, k 128..191, v 192..255
    cols = multichip._qkv_rank_major(cfg, 2)
    assert sorted(cols.tolist()) == list(range(256))
    rank0 = np.r_[0:64, 128:160, 192:224]  # q heads 0-1 (they share KV head 0), k head 0, v head 0
    rank1 = np.r_[64:128, 160:192, 224:256]
    np.testing.assert_array_equal(cols, np.concatenate([rank0, rank1]))
    np.testing.assert_array_equal(multichip._qkv_rank_major(cfg, 1), np.arange(256))


def test_chosen_experts_come_in_index_order_then_zero_weights():
    dense = jnp.array([[0.0, 0.7, 0.0, 0.3], [0.6, 0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(multichip._chosen_in_order(dense, 2), [[1, 3], [0, 1]])


# --- the reductions, with vmap axes standing for the mesh ------------------------------------
def test_row_parallel_exact_is_the_one_chip_sum_and_chip_order_is_not():
    rng = np.random.default_rng(3)
    tp, m, k, n = 4, 8, 256, 64  # 8 K blocks, 2 per chip
    x, w, b = _bf16_values(rng, (m, k)), _bf16_values(rng, (k, n)), _bf16_values(rng, (n,))
    xs = x.reshape(m, tp, k // tp).transpose(1, 0, 2)
    ws = w.reshape(tp, k // tp, n)
    one_chip_f32 = inorder_block_matmul(x, w)

    def exact(xc, wc):
        terms = jax.lax.all_gather(multichip._bf16_block_terms(xc, wc), TP, axis=0, tiled=True)
        return multichip._ordered_sum(terms, 0)

    exact_f32 = jax.vmap(exact, axis_name=TP)(xs, ws)
    for chip in range(tp):
        np.testing.assert_array_equal(np.asarray(exact_f32[chip]).view(np.uint32),
                                      np.asarray(one_chip_f32).view(np.uint32))
    # chip partials added in chip order round differently somewhere: the exact path is needed
    partials = jax.vmap(inorder_block_matmul)(xs, ws)
    chip_order = ((partials[0] + partials[1]) + partials[2]) + partials[3]
    assert np.any(np.asarray(chip_order) != np.asarray(one_chip_f32))

    for reduce in ("exact", "psum"):
        out = jax.vmap(lambda xc, wc, r=reduce: multichip._row_parallel(xc, wc, b, r), axis_name=TP)(xs, ws)
        want = (one_chip_f32 + b[None]).astype(jnp.bfloat16).astype(jnp.float32)
        if reduce == "exact":
            np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(want))
        else:  # one BF16 ulp at most
            np.testing.assert_allclose(np.asarray(out[1]), np.asarray(want), rtol=2**-7, atol=0)


def _per_chip(x: np.ndarray, spec, ep: int, tp: int) -> np.ndarray:
    """[ep, tp, *local]: what chip (r, c) holds of x under ``spec`` (what shard_map passes it)."""
    axes = tuple(spec) + (None,) * (x.ndim - len(spec))
    parts = {EP: ep, TP: tp, None: 1}

    def shard(rank: dict) -> np.ndarray:
        return x[tuple(slice(rank[a] * (d // parts[a]), (rank[a] + 1) * (d // parts[a]))
                       for a, d in zip(axes, x.shape, strict=True))]

    return np.stack([np.stack([shard({EP: r, TP: c, None: 0}) for c in range(tp)]) for r in range(ep)])


def test_routed_experts_over_ep_and_tp_give_the_one_chip_sum_bit_for_bit(gpt_oss):
    cfg, w = gpt_oss  # 8 experts of width 64, top-2, MXFP4, with biases
    ep, tp = 2, 2
    p = _params(w.layers[0])
    y = _bf16_values(np.random.default_rng(5), (6, cfg.hidden))
    xq = mx.quantize(y, "e4m3", axis=1)
    dense = route(cfg, p, y)
    # traced like the sharded path (the reference's eager loop rounds every product separately)
    want = np.asarray(jax.jit(lambda d: _experts_sum(cfg, p["experts"], xq, d))(dense))

    specs = multichip._expert_specs(EP, "exact")
    chips = {k: jax.tree.map(lambda a, s=specs[k]: _per_chip(np.asarray(a), s, ep, tp), v)
             for k, v in p["experts"].items()}
    # under jit, as the model runs it: XLA fuses the reference's `down + weight * bias` into one
    # multiply-add there, and the sharded path writes the same expression to get the same rounding
    got = jax.jit(jax.vmap(jax.vmap(lambda ex: multichip._routed_exact(cfg, ex, xq, dense), axis_name=TP),
                           axis_name=EP))(chips)
    cols = cfg.hidden // tp  # chip (r, c) holds output columns c*cols.. of every token
    assert got.shape == (ep, tp, y.shape[0], cols)
    for r in range(ep):
        for c in range(tp):
            np.testing.assert_array_equal(np.asarray(got[r, c]).view(np.uint32),
                                          want[:, c * cols:(c + 1) * cols].view(np.uint32))
    assert np.count_nonzero(dense) == 2 * y.shape[0]  # every token really used two experts


# --- whole models on 4 emulated chips (subprocess: the device count must precede jax) ----------
_SCRIPT = """
import json, sys
import jax
from jalapeno_emu.model import load_model_config
from jalapeno_emu.model.weights import init_weights
from jalapeno_emu.rack.multichip import ShardedModel, compare_greedy
assert jax.device_count() == 4, jax.devices()
out = []
for name, reduce in json.loads(sys.argv[1]):
    r = compare_greedy(name, tp=2, ep=2, tokens=8, prompt_len=4, chunk=1, reduce=reduce)
    cfg = load_model_config(name)
    m = ShardedModel(cfg, init_weights(cfg, 0), tp=2, ep=2, batch=1, max_positions=4 + 8, reduce=reduce)
    last = m.params[-1]
    arrays = {"wo": last["wo"], "gate": last["experts"]["gate"].codes, "cache": m.cache[-1][0]}
    r["chip_shapes"] = {k: [list(s.data.shape) for s in a.addressable_shards] for k, a in arrays.items()}
    out.append(r)
print(json.dumps(out))
"""


def _run_on_four_chips(runs: list[tuple[str, str]]) -> list[dict]:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(runs)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("name, reductions", [("tiny-gpt-oss", ["exact", "psum"]),
                                              ("tiny-deepseek", ["exact"])])
def test_tp2_ep2_gives_the_one_chip_tokens_and_logits_bit_for_bit(name, reductions):
    exact, *others = _run_on_four_chips([(name, r) for r in reductions])
    assert exact["chips"] == 4 and len(exact["tokens_one_chip"][0]) == 8
    assert exact["tokens_identical"], exact
    assert exact["logits_bit_identical"] and exact["max_abs_logit_diff"] == 0.0, exact
    assert len(set(exact["tokens_one_chip"][0])) > 1  # a real decode, not a constant
    cfg = load_model_config(name)
    shapes = exact["chip_shapes"]  # each chip holds its share, not a replica
    o_rows = cfg.q_heads * (cfg.head_dim if cfg.attention == "gqa" else cfg.v_head_dim)
    assert shapes["wo"] == [[o_rows // 2, cfg.hidden]] * 4
    assert shapes["gate"] == [[cfg.experts // 2, cfg.hidden, cfg.moe_intermediate // 2]] * 4
    if cfg.attention == "gqa":  # KV heads split over tp; MLA's latent cache is replicated
        assert shapes["cache"] == [[1, cfg.kv_heads // 2, 12, cfg.head_dim]] * 4
    else:
        assert shapes["cache"] == [[1, 12, cfg.kv_lora_rank + cfg.qk_rope_dim]] * 4
    for res in others:  # plain all-reduces: other FP32 sums, BF16 outputs, the same tokens
        assert res["reduce"] == "psum" and res["tokens_identical"], res
        assert res["max_abs_logit_diff_of_peak"] <= PSUM_LOGIT_TOLERANCE, res


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_processes_with_jax_distributed_run_the_same_code():
    """Two processes of 2 CPU devices each form one 4-chip mesh over gloo, as two machines would."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "jalapeno_emu.rack.multichip", "--model", "tiny-gpt-oss", "--tp", "2",
           "--ep", "2", "--tokens", "3", "--prompt-len", "1", "--json",
           "--coordinator", f"localhost:{_free_port()}", "--num-processes", "2"]
    procs = [subprocess.Popen([*cmd, "--process-id", str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for i in (0, 1)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    res = json.loads(outs[0][0].strip().splitlines()[-1])  # process 0 reports
    assert res["chips"] == 4 and res["tokens_identical"] and res["logits_bit_identical"], res
