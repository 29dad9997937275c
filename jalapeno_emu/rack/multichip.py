"""Multi-chip functional emulation: a tiny model under tensor and expert parallelism.

Stage: rack, functional side. ``ShardedModel`` runs the reference forward pass
(``model.reference``) partitioned over a ``jax.sharding.Mesh`` of ``ep * tp`` emulated chips, one
JAX device per chip, with ``jax.shard_map``; JAX collectives stand for the scale-up links.

Partitioning (mesh axes ``("ep", "tp")``, ``N = ep * tp`` chips):

- attention: query and KV heads split over ``tp`` (GQA: ``wqkv``'s columns regrouped rank by rank
  so each chip holds whole KV heads with their query heads; MLA: ``wq_b``/``w_kv_b`` by head, the
  shared down projections and the latent cache replicated, as MLA tensor parallelism does). Each
  chip keeps the KV cache of its heads. ``o_proj`` is row-parallel: its partial sums are combined
  over ``tp``.
- FFN (dense layers, shared experts, routed experts): each expert's gate/up columns (the
  intermediate dimension, whole 32-blocks per chip) split over ``tp``; the down projection split
  by output column (``exact``) or by input row (``psum``).
- routed experts: split over ``ep`` (chip group ``r`` holds experts ``r*E/ep ..``). Each group
  computes its experts; a token's ``top_k`` expert outputs are combined over ``ep``.
- embedding, norms, router and residual stream replicated; the LM head vocabulary-parallel over
  ``tp`` (logits all-gathered). Attention is replicated across the ``ep`` groups (no data-parallel
  attention: every chip sees every sequence). In ``rack.mapping`` terms: tp=tp, dp=ep, ep=ep.

Each layer kind is one jitted shard_map program, so XLA fuses operations as it does in
``ReferenceModel(jit=True)`` (a multiply feeding an add becomes a fused multiply-add); that is
the one-chip baseline the sharded model matches bit for bit. The op-by-op
``ReferenceModel(jit=False)`` rounds such pairs separately; against it the logits differ in the
last bits and the tokens agree (docs/multichip.md). Running shard_map op by op instead (outside
jit) gives unfused roundings too, but dispatches every operation across the chips: ~200 s per
tiny-model step here, too slow to use.

Two ways of combining partial sums (``reduce``):

- ``"exact"`` (default): bit-identical with one chip. ``o_proj`` sends its 32-element K-block
  terms (the matrix unit's block sums, ``inorder_block_matmul`` semantics) with an
  ``all_gather`` and every chip adds them in block order, the one-chip summation order. An expert
  all-gathers its MXFP8 activation over ``tp`` (quantised in chip-local blocks, so it is the
  one-chip activation) and each chip computes whole down-projection columns. A token's
  routed-expert outputs travel one per (token, slot) through a ``psum`` over ``ep`` in which
  exactly one group contributes a non-zero value (adding +0 is exact) and are added in expert
  order, as the reference's expert scan does. Link traffic: ``K/32`` times a plain all-reduce's
  for ``o_proj``; ``top_k * T * H / tp`` values per chip and MoE layer, an EP combine's payload.
- ``"psum"``: plain ``lax.psum`` all-reduces of partial sums (what ``rack.collectives`` prices).
  The FP32 summation order differs from one chip's; every layer rounds to BF16, so the logits
  differ only when an FP32 sum sits within an ulp of a BF16 rounding boundary (docs/multichip.md
  has the measured differences); greedy tokens are the same on the tiny models.

Across machines (``jax.distributed``): nothing in this module changes. Each process calls
``jax.distributed.initialize(coordinator_address="host0:1234", num_processes=P, process_id=i)``
before touching devices; ``jax.devices()`` then lists every process's devices, ``ShardedModel``
builds its mesh over them, every input is made with ``jax.make_array_from_callback`` (each process
supplies the shards its devices own) and replicated outputs are read from a local shard. Run the
same script on every machine. ``python -m jalapeno_emu.rack.multichip --coordinator ...`` does
this; docs/multichip.md gives the commands.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jalapeno_emu import mx
from jalapeno_emu.emu.unit_math import inorder_block_matmul
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.model.config import ModelConfig, load_model_config
from jalapeno_emu.model.reference import (
    ReferenceModel,
    _bf16,
    _expert,
    _experts_sum,
    _f32,
    _linear,
    _params,
    _rmsnorm,
    deepseek_rope_tables,
    gqa_heads,
    mla_heads,
    rope_tables,
    route,
)
from jalapeno_emu.model.weights import ModelWeights, init_weights

__all__ = ["EP", "REDUCTIONS", "TP", "ShardedModel", "compare_greedy", "greedy_decode", "make_mesh"]

EP, TP = "ep", "tp"
"""Mesh axis names: expert parallelism (experts split), tensor parallelism (heads, FFN columns)."""
REDUCTIONS = ("exact", "psum")
_BLOCK = 32  # the matrix unit's K block and the MX block: row-parallel splits keep whole blocks

# Weights split over tp along one axis (natural layouts, wqkv/bqkv after regrouping by rank).
_TP_SPECS = {"wqkv": P(None, TP), "bqkv": P(TP), "sinks": P(TP), "wo": P(TP, None),
             "wq_b": P(None, TP), "w_kv_b": P(TP, None)}


def _expert_specs(expert_axis: str | None, reduce: str) -> dict[str, P]:
    """Specs of stacked experts [E, ...]: E over ``expert_axis``; gate/up columns over tp; the
    down projection's output columns over tp (``exact``) or its input rows (``psum``)."""
    specs = {"gate": P(expert_axis, None, TP), "up": P(expert_axis, None, TP),
             "gate_bias": P(expert_axis, TP), "up_bias": P(expert_axis, TP)}
    if reduce == "exact":
        return {**specs, "down": P(expert_axis, None, TP), "down_bias": P(expert_axis, TP)}
    return {**specs, "down": P(expert_axis, TP, None), "down_bias": P(expert_axis, None)}


# --- setting up -----------------------------------------------------------------------------
def make_mesh(tp: int, ep: int, devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh of ``ep * tp`` devices, axes ``("ep", "tp")``: chips ``r*tp .. r*tp + tp - 1``
    form expert group ``r``. ``devices`` defaults to the first ``ep * tp`` of ``jax.devices()``
    (all processes' devices under ``jax.distributed``).

    Raises:
        InvalidArgumentError: fewer devices than chips.
    """
    n = tp * ep
    pool = list(jax.devices() if devices is None else devices)
    if len(pool) < n:
        raise InvalidArgumentError(
            f"tp={tp} x ep={ep} needs {n} devices, {len(pool)} available",
            hint=f"run with XLA_FLAGS=--xla_force_host_platform_device_count={n} set before jax is "
                 "imported (or jax.config.update('jax_num_cpu_devices', n)), or use jax.distributed")
    return Mesh(np.array(pool[:n], dtype=object).reshape(ep, tp), (EP, TP))


def _check_split(what: str, size: int, parts: int, multiple: int = 1) -> None:
    if size % (parts * multiple):
        unit = f" of whole {multiple}-element blocks" if multiple > 1 else ""
        raise InvalidArgumentError(f"{what}={size} does not split into {parts} equal parts{unit}")


def _check_args(cfg: ModelConfig, tp: int, ep: int, batch: int, max_positions: int, reduce: str) -> None:
    """Raise InvalidArgumentError (naming the argument) for a partition the model does not allow."""
    for name, v in (("tp", tp), ("ep", ep), ("batch", batch), ("max_positions", max_positions)):
        if not isinstance(v, int | np.integer) or v < 1:
            raise InvalidArgumentError(f"{name}={v!r} must be an integer >= 1")
    if reduce not in REDUCTIONS:
        raise InvalidArgumentError(f"reduce={reduce!r} is not one of {REDUCTIONS}")
    pre = f"{cfg.name} with tp={tp}, ep={ep}: "
    try:
        if cfg.attention == "gqa":
            _check_split(f"{pre}kv_heads", cfg.kv_heads, tp)
            _check_split(f"{pre}o_proj rows (q_heads*head_dim)", cfg.q_heads * cfg.head_dim, tp, _BLOCK)
        else:
            _check_split(f"{pre}q_heads", cfg.q_heads, tp)
            _check_split(f"{pre}o_proj rows (q_heads*v_head_dim)", cfg.q_heads * cfg.v_head_dim, tp, _BLOCK)
        _check_split(f"{pre}vocab", cfg.vocab, tp)
        _check_split(f"{pre}hidden", cfg.hidden, tp)
        moe_layers = [cfg.is_moe(i) for i in range(cfg.layers)]
        if any(moe_layers) or cfg.shared_experts:
            _check_split(f"{pre}moe_intermediate", cfg.moe_intermediate, tp, _BLOCK)
        if not all(moe_layers):
            _check_split(f"{pre}dense_intermediate", cfg.dense_intermediate, tp, _BLOCK)
        if ep > 1 and not any(moe_layers):
            raise InvalidArgumentError(f"{pre}ep > 1 needs routed experts; {cfg.name} has none")
        if any(moe_layers):
            _check_split(f"{pre}experts", cfg.experts, ep)
    except InvalidArgumentError as err:
        hint = ("tp must divide the (KV) heads and leave each chip whole 32-element blocks of o_proj rows "
                "and FFN columns; ep must divide the routed experts")
        raise InvalidArgumentError(err.message, hint=hint) from None


def _qkv_rank_major(cfg: ModelConfig, tp: int) -> np.ndarray:
    """Column order of ``wqkv`` [H, (Hq + 2 Hkv) D] that puts rank r's q, k, v heads side by side,
    ranks in order, so that an even split of the columns over tp gives each chip whole heads."""
    d, hq, hkv = cfg.head_dim, cfg.q_heads, cfg.kv_heads
    ql, kl = hq // tp * d, hkv // tp * d
    k0, v0 = hq * d, (hq + hkv) * d
    return np.concatenate([np.r_[r * ql:(r + 1) * ql, k0 + r * kl:k0 + (r + 1) * kl,
                                 v0 + r * kl:v0 + (r + 1) * kl] for r in range(tp)])


def _layer_params(cfg: ModelConfig, params: dict, tp: int, reduce: str) -> tuple[dict, dict]:
    """(params, specs): the reference's layer pytree with wqkv/bqkv regrouped by rank, and a
    PartitionSpec per leaf (None where the weight is absent)."""
    params = dict(params)
    if params["wqkv"] is not None:
        cols = _qkv_rank_major(cfg, tp)
        params["wqkv"] = params["wqkv"][:, cols]
        if params["bqkv"] is not None:
            params["bqkv"] = params["bqkv"][cols]
    specs: dict[str, Any] = {}
    for key, value in params.items():
        if key in ("experts", "shared"):
            table = _expert_specs(EP if key == "experts" else None, reduce)
            specs[key] = {k: jax.tree.map(lambda _, s=table[k]: s, v) for k, v in value.items()}
        else:
            specs[key] = None if value is None else _TP_SPECS.get(key, P())
    return params, specs


def _global(mesh: Mesh, value: Any, spec: P) -> jax.Array:
    """A global array of ``value`` laid out by ``spec``; each process supplies its own shards, so
    this is the same call with one process or many (``jax.distributed``)."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx: host[idx])


def _local_value(x: jax.Array) -> np.ndarray:
    """The value of a replicated global array from one of this process's shards."""
    return np.asarray(x.addressable_data(0))


# --- the partitioned math (runs per chip under shard_map) -------------------------------------
# shard_map runs with check_vma=False: the shared numerics helpers scan from +0 carries that
# JAX's varying-axis typing would reject. What the outputs' specs claim holds by construction:
# every value returned as replicated comes out of an all_gather or psum over the axes its inputs
# vary on (the unit tests compare every chip's copy with the one-chip reference).
def _ordered_sum(terms: jax.Array, axis: int) -> jax.Array:
    """+0 + terms[0] + terms[1] + ... along ``axis``, in index order (FP32)."""
    moved = jnp.moveaxis(terms, axis, 0)
    total, _ = lax.scan(lambda acc, t: (acc + t, None), jnp.zeros(moved.shape[1:], jnp.float32), moved)
    return total


def _bf16_block_terms(x: jax.Array, w: jax.Array) -> jax.Array:
    """The matrix unit's K-block terms of x [M, K] @ w [K, N] (BF16 values): F32 [K/32, M, N],
    each block summed in increasing k from +0 exactly as ``inorder_block_matmul`` does."""
    m, k = x.shape
    xb = x.reshape(m, k // _BLOCK, _BLOCK).transpose(1, 0, 2)
    wb = w.reshape(k // _BLOCK, _BLOCK, w.shape[1])
    return jax.vmap(inorder_block_matmul)(xb, wb)


def _row_parallel(x: jax.Array, w: jax.Array, b: jax.Array | None, reduce: str) -> jax.Array:
    """BF16 output of x [M, K/tp] @ w [K/tp, N] (+ b) with K split over tp in rank order."""
    if reduce == "exact":
        terms = lax.all_gather(_bf16_block_terms(x, w), TP, axis=0, tiled=True)
        y = _ordered_sum(terms, 0)
    else:
        y = lax.psum(inorder_block_matmul(x, w), TP)
    if b is not None:
        y = y + b[None, :]
    return _bf16(y)


def _gather_mx(q: mx.MXArray) -> mx.MXArray:
    """The [T, I] MX activation from the tp chips' [T, I/tp] column slices (whole blocks each)."""
    return mx.MXArray(codes=lax.all_gather(q.codes, TP, axis=1, tiled=True),
                      scales=lax.all_gather(q.scales, TP, axis=1, tiled=True), fmt=q.fmt, axis=q.axis,
                      block_size=q.block_size)


def _local_expert_outputs(cfg: ModelConfig, stacked: dict, xq: mx.MXArray, weights: jax.Array) -> jax.Array:
    """This chip's experts (stacked [E_l, ...]) on all T tokens with routing weights [T, E_l]:
    F32 [E_l, T, H/tp] (one compiled scan body, as the reference's expert scan)."""
    def body(_, item):
        ex, w = item
        # the reference's expert, its down projection fed the all-gathered tp column slices
        return None, _expert(cfg, ex, xq, w[:, None], gather=_gather_mx)

    return lax.scan(body, None, (stacked, weights.T))[1]


def _chosen_in_order(dense: jax.Array, k: int) -> jax.Array:
    """int [T, k]: each token's experts with a non-zero routing weight, in increasing index (the
    order the reference's expert scan adds them), then zero-weight experts (they add exactly 0)."""
    return jnp.argsort(dense == 0, axis=1, stable=True)[:, :k]


def _routed_exact(cfg: ModelConfig, stacked: dict, xq: mx.MXArray, dense: jax.Array) -> jax.Array:
    """This chip's output columns of sum over a token's chosen experts (index order) of
    weight * expert(x): F32 [T, H/tp], bit-identical with ``reference._experts_sum``. Expert
    group r computes its experts; a (token, slot) output reaches every group through a psum in
    which only its owner's value is non-zero (adding +0 is exact), then the slots are added in
    expert order. The combine carries top_k values per token and column, as an EP combine does."""
    e_local = jax.tree.leaves(stacked)[0].shape[0]
    base = lax.axis_index(EP) * e_local
    outs = _local_expert_outputs(cfg, stacked, xq, lax.dynamic_slice_in_dim(dense, base, e_local, 1))
    slot_expert = _chosen_in_order(dense, cfg.top_k) - base  # [T, k]: local index where owned here
    owned = (slot_expert >= 0) & (slot_expert < e_local)
    pick = jnp.clip(slot_expert, 0, e_local - 1)
    tok = jnp.arange(dense.shape[0])[:, None]
    slots = jnp.where(owned[:, :, None], outs.transpose(1, 0, 2)[tok, pick], 0.0)  # [T, k, H/tp]
    return _ordered_sum(lax.psum(slots, EP), 1)


def _shared_exact(cfg: ModelConfig, stacked: dict, xq: mx.MXArray) -> jax.Array:
    """This chip's output columns of the shared experts' sum (in order, weights 1): [T, H/tp]."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    return _ordered_sum(_local_expert_outputs(cfg, stacked, xq, jnp.ones((xq.shape[0], n), jnp.float32)), 0)


def _n_experts(stacked: dict) -> int:
    leaves = jax.tree.leaves(stacked)
    return leaves[0].shape[0] if leaves else 0


def _ffn_psum(cfg: ModelConfig, moe: bool, p: dict, xq: mx.MXArray, y: jax.Array) -> jax.Array:
    """The FFN with one all-reduce over the whole mesh: every chip sums its (experts, columns)
    share in the reference's way, the down biases counted once (tp rank 0, shared experts on
    expert group 0)."""
    first_tp = lax.axis_index(TP) == 0

    def bias_once(stacked: dict) -> dict:
        if stacked.get("down_bias") is None:
            return stacked
        return {**stacked, "down_bias": jnp.where(first_tp, stacked["down_bias"], 0.0)}

    partial = jnp.zeros(y.shape, jnp.float32)
    if moe:
        e_local = _n_experts(p["experts"])
        dense = lax.dynamic_slice_in_dim(route(cfg, p, y), lax.axis_index(EP) * e_local, e_local, 1)
        partial = _experts_sum(cfg, bias_once(p["experts"]), xq, dense)
    n_shared = _n_experts(p["shared"])
    if n_shared:
        shared = _experts_sum(cfg, bias_once(p["shared"]), xq, jnp.ones((y.shape[0], n_shared), jnp.float32))
        partial = partial + jnp.where(lax.axis_index(EP) == 0, shared, 0.0)
    return lax.psum(partial, (EP, TP))


def _ffn(cfg: ModelConfig, moe: bool, reduce: str, p: dict, y: jax.Array) -> jax.Array:
    """``reference._ffn`` partitioned: routed experts over ep, every expert's columns over tp."""
    xq = mx.quantize(y, "e4m3", axis=1)
    if reduce == "psum":
        return _bf16(_ffn_psum(cfg, moe, p, xq, y))
    out = jnp.zeros((y.shape[0], y.shape[1] // lax.axis_size(TP)), jnp.float32)
    if moe:
        out = _routed_exact(cfg, p["experts"], xq, route(cfg, p, y))
    if _n_experts(p["shared"]):
        out = out + _shared_exact(cfg, p["shared"], xq)
    return _bf16(lax.all_gather(out, TP, axis=1, tiled=True))


def _layer_body(cfg: ModelConfig, window: int, moe: bool, batch: int, tp: int, reduce: str, p: dict,
                cache: tuple, x: jax.Array, residual: jax.Array, pos: jax.Array, cos: jax.Array,
                sin: jax.Array) -> tuple[jax.Array, jax.Array, tuple]:
    """One decoder layer on one chip (``reference._layer``'s structure): x, residual [B*S, H]
    replicated; returns (ffn output, new residual, this chip's cache)."""
    h = _bf16(x + residual)
    y = _rmsnorm(h, p["attn_norm"], cfg.rms_eps)
    if cfg.attention == "gqa":
        o, cache = gqa_heads(cfg, window, p, cache, y, pos, cos, sin, batch, tp=tp)
    else:
        o, cache = mla_heads(cfg, p, cache, y, pos, cos, sin, batch, tp=tp)
    h2 = _bf16(_row_parallel(o, p["wo"], p["bo"], reduce) + h)
    return _ffn(cfg, moe, reduce, p, _rmsnorm(h2, p["ffn_norm"], cfg.rms_eps)), h2, cache


def _head_body(eps: float, batch: int, x: jax.Array, residual: jax.Array, norm: jax.Array,
               unembed: jax.Array) -> jax.Array:
    """Final norm and the vocabulary-parallel LM head: logits [B, V] on every chip."""
    last = _bf16(x + residual).reshape(batch, -1, x.shape[-1])[:, -1]
    return lax.all_gather(_linear(_rmsnorm(last, norm, eps), unembed), TP, axis=1, tiled=True)


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, P)


@functools.lru_cache(maxsize=64)
def _compiled_layer(cfg: ModelConfig, window: int, moe: bool, batch: int, tp: int, reduce: str, mesh: Mesh,
                    spec_leaves: tuple, spec_treedef: Any) -> Callable:
    """jit(shard_map(one layer)) for a layer kind; cached so that models of the same shape (other
    seeds, other weights) reuse the compiled code, as ``reference._layer``'s jit cache does."""
    param_spec, cache_spec = jax.tree.unflatten(spec_treedef, spec_leaves)
    body = functools.partial(_layer_body, cfg, window, moe, batch, tp, reduce)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(param_spec, cache_spec, P(), P(), P(), P(), P()),
                                 out_specs=(P(), P(), cache_spec), check_vma=False))


@functools.lru_cache(maxsize=16)
def _compiled_head(eps: float, batch: int, mesh: Mesh) -> Callable:
    """jit(shard_map(final norm + vocabulary-parallel head))."""
    return jax.jit(jax.shard_map(functools.partial(_head_body, eps, batch), mesh=mesh,
                                 in_specs=(P(), P(), P(), P(None, TP)), out_specs=P(), check_vma=False))


# --- the model ------------------------------------------------------------------------------
class ShardedModel:
    """``ReferenceModel`` partitioned over ``ep * tp`` emulated chips (see the module docstring).

    Args:
        cfg: the model (a tiny one: weights are materialised on the host first).
        weights: from ``init_weights``.
        tp: chips that split attention heads and FFN columns.
        ep: chip groups that split the routed experts.
        batch: sequences (they advance together). max_positions: KV-cache capacity in tokens.
        devices: ``ep * tp`` devices (default: the first of ``jax.devices()``).
        reduce: ``"exact"`` (bit-identical with ``ReferenceModel(jit=True)``) or ``"psum"``
            (plain all-reduces).

    Raises:
        InvalidArgumentError: a partition the model's sizes do not allow, or too few devices.
    """

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, *, tp: int, ep: int, batch: int,
                 max_positions: int, devices: Sequence[Any] | None = None, reduce: str = "exact") -> None:
        _check_args(cfg, tp, ep, batch, max_positions, reduce)
        self.cfg, self.tp, self.ep, self.reduce = cfg, tp, ep, reduce
        self.batch, self.cap = batch, max_positions
        self.mesh = make_mesh(tp, ep, devices)
        self.length = 0
        self.params, self.specs = [], []
        for lw in weights.layers:
            params, specs = _layer_params(cfg, _params(lw), tp, reduce)
            self.params.append(jax.tree.map(functools.partial(_global, self.mesh), params, specs))
            self.specs.append(specs)
        self.cache, self.cache_spec = self._empty_caches()
        tables = rope_tables if cfg.attention == "gqa" else deepseek_rope_tables
        self.cos, self.sin = (_global(self.mesh, t, P()) for t in tables(cfg, max_positions))
        self.embed = np.asarray(weights.embed).astype(np.float32)
        self.final_norm = _global(self.mesh, _f32(weights.final_norm), P())
        self.unembed = _global(self.mesh, _f32(weights.unembed), P(None, TP))
        self._head_fn = _compiled_head(cfg.rms_eps, batch, self.mesh)

    @property
    def chips(self) -> int:
        """Emulated chips (mesh devices)."""
        return self.tp * self.ep

    def _empty_caches(self) -> tuple[list[tuple], tuple]:
        cfg = self.cfg
        if cfg.attention == "gqa":
            shape = (self.batch, cfg.kv_heads, self.cap, cfg.head_dim)
            spec: tuple = (P(None, TP, None, None),) * 2
        else:
            shape = (self.batch, self.cap, cfg.kv_lora_rank + cfg.qk_rope_dim)
            spec = (P(),)
        zeros = np.zeros(shape, np.float32)
        return [tuple(_global(self.mesh, zeros, s) for s in spec) for _ in range(cfg.layers)], spec

    def _layer_fn(self, layer: int) -> Callable:
        """The jitted shard_map of layer ``layer``'s kind (shared by layers and models alike)."""
        cfg = self.cfg
        leaves, treedef = jax.tree.flatten((self.specs[layer], self.cache_spec), is_leaf=_is_spec)
        return _compiled_layer(cfg, cfg.window(layer), cfg.is_moe(layer), self.batch, self.tp, self.reduce,
                               self.mesh, tuple(leaves), treedef)

    def forward(self, ids: np.ndarray) -> np.ndarray:
        """Run ``ids`` int [batch, S] as the next S positions on every chip; logits F32
        [batch, vocab] of the last position (BF16 values), as ``ReferenceModel.forward``.

        Raises:
            InvalidArgumentError: wrong batch, or more positions than the cache holds.
        """
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.shape[0] != self.batch or ids.shape[1] < 1:
            raise InvalidArgumentError(f"ids of shape {ids.shape} must be [batch={self.batch}, S >= 1]")
        b, s = ids.shape
        if self.length + s > self.cap:
            raise InvalidArgumentError(f"{self.length + s} positions exceed max_positions={self.cap}")
        x = _global(self.mesh, self.embed[ids.reshape(-1)], P())
        residual = _global(self.mesh, np.zeros((b * s, self.cfg.hidden), np.float32), P())
        pos = _global(self.mesh, np.arange(self.length, self.length + s, dtype=np.int32), P())
        for i in range(self.cfg.layers):
            x, residual, self.cache[i] = self._layer_fn(i)(self.params[i], self.cache[i], x, residual, pos,
                                                           self.cos, self.sin)
        self.length += s
        return _local_value(self._head_fn(x, residual, self.final_norm, self.unembed))


# --- greedy decoding, one chip against N ------------------------------------------------------
def greedy_decode(model: Any, prompt: np.ndarray, tokens: int,
                  chunk: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
    """Prefill ``prompt`` int [batch, L] in chunks of ``chunk`` tokens (0: one step), then
    decode greedily until ``tokens`` tokens exist (the prefill's last step gives the first).

    Returns (tokens int [batch, tokens], logits F32 [tokens, batch, vocab] of each step that made
    a token, wall_s). ``model`` is anything with ``forward(ids) -> logits`` (ReferenceModel,
    ShardedModel). ``chunk=1`` runs every step with one shape: one compilation per layer kind.
    """
    start = time.perf_counter()
    step = chunk or prompt.shape[1]
    for p in range(0, prompt.shape[1], step):
        last = model.forward(prompt[:, p:p + step])
    logits = [last]
    out = [logits[-1].argmax(-1)]
    while len(out) < tokens:
        logits.append(model.forward(out[-1][:, None]))
        out.append(logits[-1].argmax(-1))
    return np.stack(out, axis=1), np.stack(logits), time.perf_counter() - start


def compare_greedy(model: str | ModelConfig, *, tp: int, ep: int, tokens: int = 8, prompt_len: int = 4,
                   batch: int = 1, seed: int = 0, reduce: str = "exact", chunk: int = 0,
                   reference_jit: bool = True) -> dict[str, Any]:
    """Greedy decoding of a seeded prompt (fed in chunks of ``chunk``, 0: at once) on one chip
    (``ReferenceModel(jit=reference_jit)``) and on ``ep * tp`` chips (``ShardedModel``) with the
    same weights.

    Returns a dict: model, tp, ep, chips, reduce, reference_jit, prompt, tokens_one_chip, tokens_multi_chip,
    tokens_identical, logits_bit_identical, max_abs_logit_diff, max_abs_logit_diff_of_peak
    (the largest |difference| over every step, absolute and as a fraction of the largest |logit|),
    wall_s_one_chip, wall_s_multi_chip (prefill + decode, compilation included).

    Raises:
        InvalidArgumentError: bad lengths or a partition the model does not allow.
    """
    cfg = load_model_config(model) if isinstance(model, str) else model
    if tokens < 1 or prompt_len < 1 or batch < 1 or chunk < 0:
        raise InvalidArgumentError(f"tokens={tokens}, prompt_len={prompt_len}, batch={batch} must be >= 1 "
                                   f"and chunk={chunk} >= 0")
    weights = init_weights(cfg, seed)
    prompt = np.random.default_rng(seed + 1).integers(0, cfg.vocab, (batch, prompt_len))
    cap = prompt_len + tokens
    sharded = ShardedModel(cfg, weights, tp=tp, ep=ep, batch=batch, max_positions=cap, reduce=reduce)
    one = ReferenceModel(cfg, weights, batch=batch, max_positions=cap, jit=reference_jit)
    tok_1, logits_1, wall_1 = greedy_decode(one, prompt, tokens, chunk)
    tok_n, logits_n, wall_n = greedy_decode(sharded, prompt, tokens, chunk)
    diff = np.abs(logits_n.astype(np.float64) - logits_1)
    return {"model": cfg.name, "tp": tp, "ep": ep, "chips": sharded.chips, "reduce": reduce,
            "reference_jit": reference_jit,
            "prompt": prompt.tolist(), "tokens_one_chip": tok_1.tolist(), "tokens_multi_chip": tok_n.tolist(),
            "tokens_identical": bool(np.array_equal(tok_1, tok_n)),
            "logits_bit_identical": bool(np.array_equal(logits_1.view(np.uint32), logits_n.view(np.uint32))),
            "max_abs_logit_diff": float(diff.max()),
            "max_abs_logit_diff_of_peak": float(diff.max() / np.abs(logits_1).max()),
            "wall_s_one_chip": wall_1, "wall_s_multi_chip": wall_n}


def _set_device_count(n: int) -> None:
    """Give the host platform ``n`` CPU devices (``jax_num_cpu_devices``, the config twin of
    ``XLA_FLAGS=--xla_force_host_platform_device_count``), unless XLA_FLAGS already names a count
    or JAX has started its backends (importing jax starts nothing; the first device query does)."""
    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    if xla_bridge.backends_are_initialized() or "xla_force_host_platform_device_count" in flags:
        return
    jax.config.update("jax_num_cpu_devices", n)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jalapeno_emu.rack.multichip",
                                 description="Greedy decoding of a tiny model on one chip and on tp x ep "
                                             "emulated chips; prints whether the tokens match.")
    ap.add_argument("--model", default="tiny-gpt-oss")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=0, help="prefill chunk in tokens (0: the whole prompt)")
    ap.add_argument("--reduce", choices=REDUCTIONS, default="exact")
    ap.add_argument("--op-by-op-reference", action="store_true",
                    help="compare with ReferenceModel(jit=False) (unfused roundings, slow), not jit=True")
    ap.add_argument("--json", action="store_true", help="print the comparison as JSON")
    ap.add_argument("--coordinator", help="host:port of process 0 (jax.distributed, several machines)")
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--local-devices", type=int, default=0,
                    help="CPU devices this process emulates (default: tp*ep / num-processes)")
    ap.add_argument("--heartbeat-timeout-s", type=int, default=600,
                    help="jax.distributed heartbeat timeout (compiling on a busy host can starve heartbeats)")
    return ap.parse_args(argv)


def _main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    procs = max(args.num_processes, 1)
    _set_device_count(args.local_devices or max(args.tp * args.ep // procs, 1))
    if args.coordinator:
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=procs,
                                   process_id=args.process_id,
                                   heartbeat_timeout_seconds=args.heartbeat_timeout_s)
    try:
        res = compare_greedy(args.model, tp=args.tp, ep=args.ep, tokens=args.tokens,
                             prompt_len=args.prompt_len, batch=args.batch, seed=args.seed, reduce=args.reduce,
                             chunk=args.chunk, reference_jit=not args.op_by_op_reference)
    except InvalidArgumentError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        if args.json:
            print(json.dumps(res))
        else:
            print(f"{res['model']}: 1 chip vs {res['chips']} chips (tp={res['tp']}, ep={res['ep']}, "
                  f"reduce={res['reduce']}, one-chip reference jit={res['reference_jit']}, "
                  f"{jax.process_count()} process(es))")
            print(f"  tokens, 1 chip : {res['tokens_one_chip']}")
            print(f"  tokens, {res['chips']} chips: {res['tokens_multi_chip']}")
            print(f"  tokens identical: {res['tokens_identical']}; logits bit-identical: "
                  f"{res['logits_bit_identical']}; max |logit diff| {res['max_abs_logit_diff']:.3g} "
                  f"({res['max_abs_logit_diff_of_peak']:.2%} of the peak)")
            print(f"  wall: 1 chip {res['wall_s_one_chip']:.1f} s, {res['chips']} chips "
                  f"{res['wall_s_multi_chip']:.1f} s (compilation included)")
    return 0 if res["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(_main())
