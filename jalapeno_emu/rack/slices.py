"""One chip's share of a layer under a mapping: the plan's kernel launches with sliced shapes,
and the collectives that join the chips' shares.

Stage: rack. :func:`chip_config` slices the model's configuration the way a mapping splits it
(``q_heads / tp`` and the chip's KV heads, ``dense_intermediate / tp``, ``experts / ep`` routed
experts of ``moe_intermediate / (tp*dp/ep)`` columns, ``vocab / tp`` logits); the launches then come
from :func:`jalapeno_emu.model.plan.layer_launches` on that configuration, so a chip runs the same
kernels, in the same order, as one die runs the whole layer:

=============  ===================================  =====================================
launch         one die (model.plan)                 one chip of the mapping
=============  ===================================  =====================================
attn_norm      rmsnorm tokens=t                     the same (replicated over tp)
qkv_proj       gemm n=(q + 2 kv) * hd               n=(q/tp + 2 kv_chip) * hd
q_b_proj       gemm n=q * (nope + rope)             n=q/tp * (nope + rope)
qkv_a_proj     gemm (MLA down-projections)          the same (replicated, as vLLM)
attention      q_heads, kv_heads                    q_heads/tp, kv_chip (MLA: q_heads/tp)
o_proj         gemm k=q * hd                        k=q/tp * hd (partial sums, all-reduced)
ffn (dense)    moe experts=0 intermediate=I         intermediate=I/tp (padded to 32)
moe (routed)   moe tokens=t experts=E               tokens received, experts=E/ep,
                                                    intermediate=I/(tp*dp/ep) (padded to 32),
                                                    distinct_experts = expected hits
shared_ffn     (inside the moe launch)              moe experts=0 on the chip's own t/tp
                                                    tokens, full width (replicated weights)
logits         gemm n=vocab                         n=vocab/tp
=============  ===================================  =====================================

``kv_chip`` is ``kv_heads / tp``, or 1 when tp > kv_heads (each KV head replicated on
``tp / kv_heads`` chips). Sliced widths that are not multiples of 32 are padded up to the next
multiple (the kernels' granule): that padding and the replicated pieces above are the only work a
mapping adds over one die. A MoE launch's routed experts use the chip's local router (top_k of its
E/ep experts, no expert groups); the global router's top-k runs on the source chip and is left
out (an [t, H] x [H, E] GEMV, small next to the experts).

Token flow of a MoE layer (stage of S = tp*dp chips, chip c in DP group c // tp and expert group
c // (S/ep)): after attention every chip of a DP group holds the group's t tokens; each chip is
the *home* of t/tp of them. **Dispatch**: a home sends each token to every chip of every expert
group holding one of its experts, except chips of its own DP group (they have it). **Compute**:
a chip runs its experts' column slice for every token of the stage that picked one of its
experts. **Combine**: each computing chip sends the token's partial output (BF16, H wide) to the
token's home (summed there). **All-gather** over tp: each home shares its tokens' outputs with its
DP group. With dp = 1 and ep = 1 this is exactly a reduce-scatter plus an all-gather (an
all-reduce); with tp = 1 and ep = dp = S it is DeepSeek-style expert parallelism. Dense layers and
attention all-reduce their outputs over tp. No communication overlaps compute (conservative).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.model.config import ModelConfig
from jalapeno_emu.model.plan import Launch, Step, head_launches, launch, layer_launches, tail_launches
from jalapeno_emu.rack.collectives import CollectiveTime, best_all_gather, best_all_reduce, best_all_to_all
from jalapeno_emu.rack.mapping import Mapping, check_mapping, pad32
from jalapeno_emu.rack.routing import ExpertLoad

__all__ = [
    "ACT_BYTES",
    "ATTENTION_LABELS",
    "DENSE_PART_CONTEXT",
    "SLOT_TOKENS",
    "chip_config",
    "chip_head_launches",
    "chip_layer_launches",
    "chip_tail_launches",
    "decode_attention_launches",
    "layer_collectives",
    "layer_kind",
    "moe_all_to_alls",
    "moe_byte_matrices",
    "prefill_attention_launches",
    "routed_moe_launch",
    "tail_collectives",
    "token_launches",
    "tp_collectives",
]

ATTENTION_LABELS = frozenset({"kv_append", "attention", "mla_append"})
"""Launches whose shape depends on the cached context (the rest depend on the step's tokens only)."""
ACT_BYTES = 2
"""Hidden states travel between chips as BF16."""
SLOT_TOKENS = 128
"""Tokens up to which the moe kernel may serve expert slots (``kernels.moe_slots_plan.MAX_TOKENS``: each
slot's token list fits one matrix-unit row tile); without a chip spec, the routed launch assumes
the slot program up to this many tokens."""
DENSE_PART_CONTEXT = 32
"""Context of the decode step token_launches plans with: any the attention kernels accept (they
are dropped from the token part)."""


def chip_config(cfg: ModelConfig, mapping: Mapping) -> ModelConfig:
    """The configuration one chip of ``mapping`` runs (see the module docstring's table)."""
    check_mapping(cfg, mapping)
    q = cfg.q_heads // mapping.tp
    kv = q if cfg.attention == "mla" else max(1, cfg.kv_heads // mapping.tp)
    changes: dict[str, Any] = dict(
        q_heads=q,
        kv_heads=kv,
        vocab=math.ceil(cfg.vocab / mapping.tp),
        dense_intermediate=pad32(cfg.dense_intermediate / mapping.tp),
    )
    if cfg.experts:
        local = cfg.experts // mapping.ep
        changes.update(
            experts=local,
            top_k=min(cfg.top_k, local),
            n_group=1,
            topk_group=1,
            moe_intermediate=pad32(cfg.moe_intermediate / mapping.expert_tp),
        )
    return dataclasses.replace(cfg, name=f"{cfg.name}[{mapping.name}]", **changes)


def layer_kind(cfg: ModelConfig, layer: int) -> tuple[int, bool]:
    """What makes a layer's per-chip launches differ: (attention window, routed experts?)."""
    return cfg.window(layer), cfg.is_moe(layer)


def routed_moe_launch(
    cfg: ModelConfig,
    mapping: Mapping,
    tokens: float,
    distinct: float,
    top_k: float,
    spec: ChipSpec | None = None,
    grouping: Callable[[Launch], str] | None = None,
) -> Launch:
    """The routed-expert launch of one chip: ``tokens`` received, each picking ``top_k`` of the
    chip's experts, ``distinct`` expert slots; all rounded to integers and clamped to what the
    kernel takes (top_k in 1..E/ep, distinct in top_k..min(E/ep, tokens * top_k)).

    The kernel's ``grouping=auto`` chooses between serving expert slots (up to 128 tokens: the
    first of its programs that fits ``spec``; with ``routing=uniform`` each slot computes the
    expected count of the chip's tokens, so the FLOPs are the routed work) and gathering each
    expert's tokens; in the latter every local expert is an item and the slot count does not
    apply (``distinct_experts=0``). Without ``spec`` the slot program is assumed up to 128 tokens.
    ``grouping`` answers the kernel's choice for the slot launch in place of asking the kernel
    (:meth:`~jalapeno_emu.rack.launch_timer.LaunchTimer.moe_grouping`, which remembers it on disk).

    Raises:
        InvalidArgumentError: a model without routed experts (from the kernel's shape checks).
    """
    chip = chip_config(cfg, mapping)
    t = max(1, round(tokens))
    k = min(chip.experts, max(1, round(top_k)))
    d = min(chip.experts, t * k, max(k, round(distinct)))
    keys: dict[str, Any] = dict(
        tokens=t,
        hidden=chip.hidden,
        intermediate=chip.moe_intermediate,
        experts=chip.experts,
        top_k=k,
        shared_experts=0,
        activation=chip.activation,
        router=chip.router,
        expert_bias=chip.expert_bias,
        routing="uniform",
    )
    if chip.router == "sigmoid_topk":
        keys.update(
            routed_scaling_factor=chip.routed_scaling_factor,
            n_group=1,
            topk_group=1,
            score_bias=chip.score_bias,
        )
    slots = launch("moe", "moe", **keys, distinct_experts=d)
    if grouping is not None:
        return slots if grouping(slots) == "dense" else launch("moe", "moe", **keys)
    if spec is not None:
        from jalapeno_emu.kernels.moe import grouping_of  # the kernel's own rule (loaded on use)

        return slots if grouping_of(slots.shape_dict, spec) == "dense" else launch("moe", "moe", **keys)
    return slots if t <= SLOT_TOKENS else launch("moe", "moe", **keys)


def _shared_launch(cfg: ModelConfig, tokens: int) -> Launch:
    return launch(
        "shared_ffn",
        "moe",
        tokens=tokens,
        hidden=cfg.hidden,
        intermediate=cfg.moe_intermediate,
        experts=0,
        top_k=1,
        shared_experts=cfg.shared_experts,
        activation=cfg.activation,
    )


def _home_tokens(tokens: int, tp: int) -> int:
    return max(1, math.ceil(tokens / tp))


def chip_layer_launches(
    cfg: ModelConfig,
    mapping: Mapping,
    layer: int,
    step: Step,
    load: ExpertLoad | None = None,
    spec: ChipSpec | None = None,
) -> tuple[Launch, ...]:
    """The busiest chip's launches of ``layer`` for ``step``, in the plan's order.

    Args:
        step: what the chip's DP group computes (``batch`` = the group's sequences).
        load: the expert load (needed for MoE layers): the routed launch gets the tokens the
            busiest expert group receives out of the stage's ``dp * step.tokens``, the experts
            each picks there and its expected distinct experts (see :func:`routed_moe_launch`).
        spec: the chip, for the MoE kernel's choice of program (see :func:`routed_moe_launch`).
    """
    chip = chip_config(cfg, mapping)
    out: list[Launch] = []
    for la in layer_launches(chip, layer, step):
        if la.label != "moe":
            out.append(la)
            continue
        if load is None:
            raise ValueError("chip_layer_launches: a MoE layer needs the expert load")
        stage_tokens = step.tokens * mapping.dp
        out.append(
            routed_moe_launch(
                cfg,
                mapping,
                float(load.received(stage_tokens)),
                float(load.distinct(stage_tokens)),
                load.picks_per_token(),
                spec,
            )
        )
        if cfg.shared_experts:
            out.append(_shared_launch(cfg, _home_tokens(step.tokens, mapping.tp)))
    return tuple(out)


def token_launches(cfg: ModelConfig, mapping: Mapping, layer: int, tokens: int) -> tuple[Launch, ...]:
    """The launches of ``layer`` whose shapes depend only on the chip's ``tokens`` this step: norms,
    projections, a dense FFN and the shared experts (not attention, not the routed experts)."""
    chip = chip_config(cfg, mapping)
    step = Step("decode", batch=tokens, context=DENSE_PART_CONTEXT)
    out = [
        la
        for la in layer_launches(chip, layer, step)
        if la.label not in ATTENTION_LABELS and la.label != "moe"
    ]
    if cfg.is_moe(layer) and cfg.shared_experts:
        out.append(_shared_launch(cfg, _home_tokens(tokens, mapping.tp)))
    return tuple(out)


def decode_attention_launches(
    cfg: ModelConfig, mapping: Mapping, layer: int, batch: int, context: int, query_tokens: int = 1
) -> tuple[Launch, ...]:
    """The cache append and decode attention of ``batch`` sequences of ``context`` tokens on one chip.

    ``query_tokens`` > 1 (speculative decoding's verification: K + 1 tokens per sequence) runs
    the decode kernels with ``query_tokens`` times the query heads per KV head: every query row
    of a sequence reads its KV cache once, as the GPU stacks' kernels batch a sequence's query
    tokens with its heads (FlashMLA folds seqlen_q into the heads, FlashInfer's GQA decode the
    query tokens into the head group). What it leaves out is small beside the cache read: the
    causal mask among the K + 1 tokens and the append of K more cache rows.
    """
    if isinstance(query_tokens, bool) or not isinstance(query_tokens, int) or query_tokens < 1:
        raise InvalidArgumentError(f"query_tokens={query_tokens!r} must be an integer >= 1")
    step = Step("decode", batch=batch, context=context)
    chip = chip_config(cfg, mapping)
    if query_tokens > 1:
        kv = chip.q_heads * query_tokens if chip.attention == "mla" else chip.kv_heads
        chip = dataclasses.replace(chip, name=f"{chip.name}[q{query_tokens}]",
                                   q_heads=chip.q_heads * query_tokens, kv_heads=kv)
    return tuple(la for la in layer_launches(chip, layer, step) if la.label in ATTENTION_LABELS)


def prefill_attention_launches(
    cfg: ModelConfig, mapping: Mapping, layer: int, seq: int, prior: int
) -> tuple[Launch, ...]:
    """The prefill attention (and MLA's latent append) of one chunk of ``seq`` tokens after ``prior``."""
    step = Step("prefill", batch=1, seq=seq, prior=prior)
    return tuple(
        la for la in layer_launches(chip_config(cfg, mapping), layer, step) if la.label in ATTENTION_LABELS
    )


def chip_head_launches(cfg: ModelConfig, tokens: int) -> tuple[Launch, ...]:
    """The embedding lookup of the chip's ``tokens`` (the table is replicated)."""
    return head_launches(cfg, Step("decode", batch=tokens, context=1))


def chip_tail_launches(cfg: ModelConfig, mapping: Mapping, rows: int) -> tuple[Launch, ...]:
    """Final norm and the chip's vocab/tp logit columns for ``rows`` sequences."""
    return tail_launches(chip_config(cfg, mapping), Step("decode", batch=rows, context=1))


# --- communication ----------------------------------------------------------------------------


def _chip_groups(mapping: Mapping) -> tuple[np.ndarray, np.ndarray]:
    chips = np.arange(mapping.stage_chips)
    return chips // mapping.tp, chips // mapping.expert_tp  # DP group, expert group


def moe_byte_matrices(
    cfg: ModelConfig, mapping: Mapping, load: ExpertLoad, stage_tokens: float
) -> tuple[np.ndarray, np.ndarray]:
    """int64[S, S] [src, dst] bytes of the MoE dispatch and combine all-to-alls of one stage.

    Every chip is home to ``stage_tokens / S`` tokens (the stage's tokens spread evenly); a token
    needs expert group g with probability ``load.hit[g]``. Dispatch skips chips of the home's DP
    group (they hold the token); combine returns each computing chip's partial to the home.
    """
    s = mapping.stage_chips
    dp_of, eg_of = _chip_groups(mapping)
    per_home = stage_tokens / s
    need = per_home * load.hit[eg_of] * cfg.hidden * ACT_BYTES  # bytes a home sends each chip
    dispatch = np.where(dp_of[:, None] != dp_of[None, :], need[None, :], 0.0)
    combine = np.broadcast_to(need[:, None], (s, s)).copy()
    np.fill_diagonal(dispatch, 0.0)
    np.fill_diagonal(combine, 0.0)
    return np.rint(dispatch).astype(np.int64), np.rint(combine).astype(np.int64)


def tp_collectives(
    cfg: ModelConfig, spec: ChipSpec, mapping: Mapping, layer: int, group_tokens: float
) -> dict[str, CollectiveTime]:
    """The collectives of one layer inside a DP group of tp chips, for ``group_tokens`` tokens:
    ``attn_all_reduce``, then ``ffn_all_reduce`` (dense FFN) or ``moe_all_gather`` (MoE); none
    when tp = 1. Each priced by its fastest algorithm."""
    out: dict[str, CollectiveTime] = {}
    if mapping.tp == 1:
        return out
    row_bytes = cfg.hidden * ACT_BYTES
    out["attn_all_reduce"] = best_all_reduce(mapping.tp, round(group_tokens * row_bytes), spec)
    if cfg.is_moe(layer):
        home = math.ceil(group_tokens / mapping.tp)
        out["moe_all_gather"] = best_all_gather(mapping.tp, home * row_bytes, spec)
    else:
        out["ffn_all_reduce"] = best_all_reduce(mapping.tp, round(group_tokens * row_bytes), spec)
    return out


def moe_all_to_alls(
    cfg: ModelConfig, spec: ChipSpec, mapping: Mapping, load: ExpertLoad, stage_tokens: float
) -> dict[str, CollectiveTime]:
    """A MoE layer's ``moe_dispatch`` (dp > 1) and ``moe_combine`` (S > 1) all-to-alls over the
    stage's S chips for ``stage_tokens`` tokens (:func:`moe_byte_matrices`), fastest algorithm each."""
    out: dict[str, CollectiveTime] = {}
    if mapping.stage_chips == 1:
        return out
    dispatch, combine = moe_byte_matrices(cfg, mapping, load, stage_tokens)
    if mapping.dp > 1 and dispatch.any():
        out["moe_dispatch"] = best_all_to_all(mapping.stage_chips, dispatch, spec)
    if combine.any():
        out["moe_combine"] = best_all_to_all(mapping.stage_chips, combine, spec)
    return out


def layer_collectives(
    cfg: ModelConfig,
    spec: ChipSpec,
    mapping: Mapping,
    layer: int,
    group_tokens: float,
    stage_tokens: float,
    load: ExpertLoad | None = None,
) -> dict[str, CollectiveTime]:
    """Every collective of one layer, by name: :func:`tp_collectives` for the busiest DP group's
    ``group_tokens`` plus, for a MoE layer, :func:`moe_all_to_alls` for the stage's ``stage_tokens``."""
    out = tp_collectives(cfg, spec, mapping, layer, group_tokens)
    if cfg.is_moe(layer):
        if load is None:
            raise ValueError("layer_collectives: a MoE layer needs the expert load")
        out.update(moe_all_to_alls(cfg, spec, mapping, load, stage_tokens))
    return out


def tail_collectives(spec: ChipSpec, mapping: Mapping, rows: int) -> dict[str, CollectiveTime]:
    """Sampling over vocab-parallel logits: each chip shares its best (value, index) per row (8 B)."""
    if mapping.tp == 1:
        return {}
    return {"logits_all_gather": best_all_gather(mapping.tp, rows * 8, spec)}
