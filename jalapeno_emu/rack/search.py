"""Which mapping to serve a model with: candidates, an analytic screen, and the timed finalists.

Stage: rack, between the step model and the CLI.

**Candidates** (:func:`candidate_mappings`): every (tp, ep, dp, pp) with ``tp * dp * pp`` chips a
power of two up to the preset's scale-up domain (or the domain size itself), tp a power of two
dividing the attention heads (and the KV heads, or a multiple of them), ep a power of two dividing
both the stage's chips and the routed experts, pp in 1, 2, 4, 8 -- and whose weights plus one
request's KV cache fit every chip's HBM.

**Screen** (:func:`screen`): an analytic estimate of each candidate at each concurrency, cheap
enough for hundreds of candidates and no kernel builds: per chip, a decode step reads its weights
(the dense ones, the busiest expert group's expected distinct experts) and its KV cache at the
achievable HBM rate, or computes its FLOPs at the matrix unit's peak (BF16 for attention and
dense weights, MXFP8 for experts), whichever is longer, plus a fixed cost per kernel launch
(launch + DMA set-up + HBM latency) and the collectives of :mod:`~jalapeno_emu.rack.slices`
priced by :mod:`~jalapeno_emu.rack.collectives`. A prompt's prefill is the same roofline for isl
tokens (every expert hit). A DP group serving ``b`` of the concurrency's requests (at most what its
KV cache holds) runs ``osl`` decode steps and ``b`` prefills per request lifetime; TPOT is that
cycle over osl. The screen only ranks.

**Finalists** (:func:`best_mapping`): the top few candidates of the screen for the objective are
simulated with the timing-pass :class:`~jalapeno_emu.rack.step_model.RackStepModel` and the
serving simulator; the best simulated one wins. Objectives: ``interactivity`` (tok/s/user) or
``throughput`` (tok/s per chip).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.model.config import ModelConfig
from jalapeno_emu.model.footprint import fmt_bytes_per_element
from jalapeno_emu.rack.mapping import (
    FitError,
    Mapping,
    attention_weight_bytes,
    check_mapping,
    chip_memory,
    expert_bytes,
    pad32,
    stage_layers,
)
from jalapeno_emu.rack.routing import UNIFORM, ExpertLoad, Routing
from jalapeno_emu.rack.slices import ACT_BYTES
from jalapeno_emu.rack.step_model import DEFAULT_BATCH_TOKENS, RackStepModel
from jalapeno_emu.serving.metrics import ServingMetrics
from jalapeno_emu.serving.simulate import simulate
from jalapeno_emu.serving.speculative import Speculation

__all__ = [
    "OBJECTIVES",
    "MappingChoice",
    "ScreenPoint",
    "best_mapping",
    "candidate_mappings",
    "describe_screen",
    "metric_value",
    "screen",
    "shortlist",
    "step_model",
]

OBJECTIVES = {"interactivity": "interactivity_tok_s_user", "throughput": "throughput_tok_s_per_chip"}
"""Objective name -> the serving metric it maximises."""

_PP = (1, 2, 4, 8)


def _pow2_upto(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if (1 << i) <= n]


def _chip_counts(spec: ChipSpec, chips: int | None) -> list[int]:
    domain = spec.link.domain_chips
    if chips is not None:
        if isinstance(chips, bool) or not isinstance(chips, int) or not 1 <= chips <= domain:
            raise InvalidArgumentError(
                f"chips={chips!r} must be an integer in 1..{domain} ({spec.name}'s scale-up domain)"
            )
        return [chips]
    counts = _pow2_upto(domain)
    return counts if domain in counts else [*counts, domain]


def _divisors(n: int, of: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and of % d == 0]


def candidate_mappings(
    cfg: ModelConfig,
    spec: ChipSpec,
    *,
    chips: int | None = None,
    kv_tokens: int = 0,
    sequence_tokens: int | None = None,
) -> list[Mapping]:
    """Every mapping of the module docstring's rules whose weights plus ``kv_tokens`` cached tokens
    fit (``chips``: only deployments of exactly that many chips).

    Raises:
        InvalidArgumentError: ``chips`` out of range; FitError: no candidate fits (with the
            closest one's numbers).
    """
    out: list[Mapping] = []
    last_fit: FitError | None = None
    for total in _chip_counts(spec, chips):
        for pp in (p for p in _PP if total % p == 0 and p <= cfg.layers):
            stage = total // pp
            for tp in (t for t in _pow2_upto(stage) if stage % t == 0):
                dp = stage // tp
                eps = [e for e in _divisors(stage, cfg.experts) if e & (e - 1) == 0] if cfg.experts else [1]
                for ep in eps:
                    m = Mapping(tp=tp, ep=ep, dp=dp, pp=pp)
                    try:
                        check_mapping(cfg, m, spec)
                    except FitError:
                        raise
                    except InvalidArgumentError:
                        continue
                    mem = chip_memory(cfg, spec, m, sequence_tokens=sequence_tokens)
                    need = math.ceil(kv_tokens / dp) * mem.kv_bytes_per_token
                    if mem.weight_bytes + need > mem.capacity_bytes or mem.kv_tokens_per_group < 1:
                        last_fit = FitError(
                            f"{cfg.name} on {spec.name}: {mem.weight_bytes / 1e9:,.1f} GB of weights + "
                            f"{need / 1e9:,.1f} GB of KV cache per chip exceed "
                            f"{mem.capacity_bytes / 1e9:,.1f} GB with {m.name}"
                        )
                        continue
                    out.append(m)
    if not out:
        where = (
            f"{chips} chips" if chips is not None else f"{spec.name}'s {spec.link.domain_chips}-chip domain"
        )
        msg = f"no mapping of {cfg.name} fits {where}"
        raise FitError(msg + (f": e.g. {last_fit.message}" if last_fit else ""))
    return out


@dataclass(frozen=True)
class ScreenPoint:
    """The analytic estimate of one mapping at one concurrency.

    Attributes:
        mapping: the candidate.
        concurrency: requests in flight.
        decode_step_s: one decode step of a DP group's share (s).
        prefill_s: one prompt's prefill on a DP group (s).
        tpot_s: estimated time per output token (s).
        interactivity_tok_s_user: 1 / tpot_s.
        throughput_tok_s_per_chip: (isl + osl) tokens per request, over the chips.
    """

    mapping: Mapping
    concurrency: int
    decode_step_s: float
    prefill_s: float
    tpot_s: float
    interactivity_tok_s_user: float
    throughput_tok_s_per_chip: float

    def value(self, objective: str) -> float:
        """The metric ``objective`` maximises."""
        return getattr(self, OBJECTIVES[objective])


def _all_reduce_s(p: int, nbytes: float, link: Any) -> float:
    """The fastest all-reduce of the closed forms in :mod:`~jalapeno_emu.rack.collectives` (p a
    power of two, chunk rounding ignored): ring, recursive doubling, one-shot, two-shot."""
    if p == 1:
        return 0.0
    a, o, lat, b = link.alpha_s, link.message_setup_s, link.path_latency_s, 1.0 / link.stripe_bytes_per_s
    n = nbytes * b
    return min(
        2 * (p - 1) * a + 2 * (p - 1) / p * n,
        math.log2(p) * (a + n),
        (p - 1) * o + lat + (p - 1) * n,
        2 * ((p - 1) * o + lat + (p - 1) / p * n),
    )


def _all_to_all_s(p: int, nbytes: float, link: Any) -> float:
    """A uniform all-to-all of ``nbytes`` per pair: pairwise or direct, the faster."""
    if p == 1:
        return 0.0
    a, o, lat, b = link.alpha_s, link.message_setup_s, link.path_latency_s, 1.0 / link.stripe_bytes_per_s
    return min((p - 1) * (a + nbytes * b), (p - 1) * o + lat + (p - 1) * nbytes * b)


class _Roofline:
    """Per-chip bytes, FLOPs and fixed costs of one mapping (the screen's model)."""

    def __init__(self, cfg: ModelConfig, spec: ChipSpec, mapping: Mapping, routing: Routing) -> None:
        self.cfg, self.spec, self.m = cfg, spec, mapping
        d = spec.derived()
        self.bw = d["hbm_achievable_bytes_per_s"]
        self.bf16 = d["peak_bf16_flops_per_s"]
        self.mx8 = d["peak_mxfp8_flops_per_s"]
        self.fixed_s = spec.sync.kernel_launch_s + spec.dma.setup_latency_s + spec.hbm.latency_s
        self.load = ExpertLoad(cfg.experts, cfg.top_k, mapping.ep, routing) if cfg.experts else None
        busiest = max(stage_layers(cfg, mapping.pp), key=len)
        self.kinds = Counter((cfg.window(i), cfg.is_moe(i)) for i in busiest)
        w = fmt_bytes_per_element(cfg.weight_fmt)
        self.e_bytes = fmt_bytes_per_element(cfg.expert_weight_fmt)
        self.attn_bytes = attention_weight_bytes(cfg, mapping.tp)
        self.attn_params = self.attn_bytes / w
        width = pad32(cfg.moe_intermediate / mapping.expert_tp)
        self.expert_chip_bytes = expert_bytes(cfg, width) if cfg.experts else 0.0
        self.expert_chip_params = 3 * cfg.hidden * width
        self.dense_params = 3 * cfg.hidden * pad32(cfg.dense_intermediate / mapping.tp)
        self.shared_params = 3 * cfg.hidden * cfg.moe_intermediate * cfg.shared_experts
        self.logit_bytes = math.ceil(cfg.vocab / mapping.tp) * cfg.hidden * w
        heads = cfg.q_heads // mapping.tp
        self.attn_flops_per_pair = (
            4 * heads * (cfg.head_dim if cfg.attention == "gqa" else cfg.kv_lora_rank + cfg.qk_rope_dim)
        )
        kv_heads = 1 if cfg.attention == "mla" else max(1, cfg.kv_heads // mapping.tp)
        self.kv_row = (
            (cfg.kv_lora_rank + cfg.qk_rope_dim) * 2
            if cfg.attention == "mla"
            else 2 * kv_heads * cfg.head_dim * 2
        )
        self.launches_per_layer = 10 if cfg.attention == "mla" else 7

    def _comm_s(self, group_tokens: float, stage_tokens: float, moe: bool) -> float:
        m, row, link = self.m, self.cfg.hidden * ACT_BYTES, self.spec.link
        t = 2 * _all_reduce_s(m.tp, group_tokens * row, link)
        if moe and m.stage_chips > 1 and self.load is not None:
            per_pair = stage_tokens / m.stage_chips * row * float(self.load.hit.max())
            t += _all_to_all_s(m.stage_chips, per_pair, link) * (2 if m.dp > 1 else 1)
        return t

    def _layer_s(self, kind: tuple[int, bool], decode: float, prefill_tokens: float, context: float) -> float:
        window, moe = kind
        t = decode + prefill_tokens
        stage_tokens = t * self.m.dp
        w_bytes = self.attn_bytes
        flops_bf16 = 2 * t * self.attn_params
        if moe:
            assert self.load is not None
            recv = float(self.load.received(stage_tokens))
            hit = float(self.load.distinct(stage_tokens))
            w_bytes += hit * self.expert_chip_bytes + self.shared_params * self.e_bytes
            flops_mx = 2 * (
                recv * self.load.picks_per_token() * self.expert_chip_params
                + t / self.m.tp * self.shared_params
            )
        else:
            w_bytes += self.dense_params * self.e_bytes
            flops_mx = 2 * t * self.dense_params
        seen = min(context, window) if window else context
        kv_bytes = (decode * seen + prefill_tokens) * self.kv_row
        flops_bf16 += self.attn_flops_per_pair * (decode * seen + prefill_tokens * prefill_tokens / 2)
        work = max((w_bytes + kv_bytes) / self.bw, flops_bf16 / self.bf16 + flops_mx / self.mx8)
        return work + self.launches_per_layer * self.fixed_s + self._comm_s(t, stage_tokens, moe)

    def step_s(self, decode: float, prefill_tokens: float, context: float) -> float:
        """One step of a DP group: ``decode`` sequences at mean ``context`` plus ``prefill_tokens``.
        With pp stages the work is cut into min(pp, sequences) micro-batches (pp when prefilling);
        a step lasts pp stage-times either way (full pipeline: the busiest stage is busy pp times;
        fewer micro-batches: a bubble, each one crossing every stage)."""
        pp = self.m.pp
        flight = pp if prefill_tokens else max(1, min(pp, math.ceil(decode)))  # micro-batches
        d, p = math.ceil(decode / flight), prefill_tokens / flight
        stage = sum(n * self._layer_s(kind, d, p, context) for kind, n in self.kinds.items())
        stage += self.logit_bytes / self.bw + 2 * self.fixed_s
        return pp * stage


def screen(
    cfg: ModelConfig,
    spec: ChipSpec,
    mappings: Sequence[Mapping],
    *,
    isl: int,
    osl: int,
    concurrencies: Sequence[int],
    routing: Routing = UNIFORM,
) -> list[ScreenPoint]:
    """The analytic estimate (module docstring) of every mapping at every concurrency.

    Returns:
        One :class:`ScreenPoint` per (mapping, concurrency), mappings outer.
    """
    out = []
    context = isl + osl / 2
    for m in mappings:
        roof = _Roofline(cfg, spec, m, routing)
        mem = chip_memory(cfg, spec, m, sequence_tokens=isl + osl)
        fit_per_group = max(1, mem.kv_tokens_per_group // (isl + osl))
        prefill = roof.step_s(0, isl, isl / 2)
        for c in concurrencies:
            b = min(math.ceil(c / m.dp), fit_per_group)
            dec = roof.step_s(b, 0, context)
            cycle = osl * dec + b * prefill
            served = min(c, b * m.dp)
            tpot = cycle / osl
            out.append(
                ScreenPoint(m, c, dec, prefill, tpot, 1.0 / tpot, served * (isl + osl) / cycle / m.chips)
            )
    return out


def shortlist(points: Sequence[ScreenPoint], objective: str, keep: int) -> list[ScreenPoint]:
    """The ``keep`` best screen points for ``objective`` (ties: fewer chips first), at most one per
    (concurrency, tp, dp, pp): mappings that differ only in ep estimate alike, and the next-best ep
    variant would crowd out a different layout."""
    if objective not in OBJECTIVES:
        raise InvalidArgumentError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    out: list[ScreenPoint] = []
    seen: set[tuple[int, int, int, int]] = set()
    for p in sorted(points, key=lambda p: (-p.value(objective), p.mapping.chips, -p.mapping.ep)):
        layout = (p.concurrency, p.mapping.tp, p.mapping.dp, p.mapping.pp)
        if layout not in seen:
            seen.add(layout)
            out.append(p)
        if len(out) == keep:
            break
    return out


def describe_screen(points: Sequence[ScreenPoint]) -> list[dict[str, Any]]:
    """JSON rows of screen points."""
    return [
        {
            "mapping": p.mapping.name,
            "chips": p.mapping.chips,
            "concurrency": p.concurrency,
            "decode_step_s": p.decode_step_s,
            "prefill_s": p.prefill_s,
            "tpot_s": p.tpot_s,
            "interactivity_tok_s_user": p.interactivity_tok_s_user,
            "throughput_tok_s_per_chip": p.throughput_tok_s_per_chip,
        }
        for p in points
    ]


_MODELS: dict[tuple[Any, ...], RackStepModel] = {}


def step_model(
    cfg: ModelConfig,
    spec: ChipSpec,
    mapping: Mapping,
    *,
    routing: Routing = UNIFORM,
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
    sequence_tokens: int | None = None,
    disk_cache: bool = False,
) -> RackStepModel:
    """A :class:`RackStepModel`, one per distinct arguments in a process (its grid is reused)."""
    key = (cfg, spec, mapping, routing, max_batch_tokens, sequence_tokens, disk_cache)
    model = _MODELS.get(key)
    if model is None:
        model = _MODELS[key] = RackStepModel(
            cfg,
            spec,
            mapping,
            routing=routing,
            max_batch_tokens=max_batch_tokens,
            sequence_tokens=sequence_tokens,
            disk_cache=disk_cache,
        )
    return model


def metric_value(metrics: ServingMetrics, objective: str) -> float:
    """The simulated metric ``objective`` maximises (-inf when undefined)."""
    if objective not in OBJECTIVES:
        raise InvalidArgumentError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    v = getattr(metrics, OBJECTIVES[objective])
    return v if isinstance(v, float) and math.isfinite(v) else -math.inf


@dataclass(frozen=True)
class MappingChoice:
    """The result of :func:`best_mapping`.

    Attributes:
        mapping: the winner. metrics: its simulated serving metrics. model: its step model.
        finalists: (mapping, metrics) of every simulated finalist, best first.
        screened: candidates the analytic screen ranked.
    """

    mapping: Mapping
    metrics: ServingMetrics
    model: RackStepModel
    finalists: tuple[tuple[Mapping, ServingMetrics], ...]
    screened: int


def best_mapping(
    cfg: ModelConfig,
    spec: ChipSpec,
    *,
    isl: int,
    osl: int,
    concurrency: int,
    objective: str = "interactivity",
    routing: Routing = UNIFORM,
    chips: int | None = None,
    finalists: int = 2,
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
    disk_cache: bool = False,
    requests: int | None = None,
    seed: int = 0,
    speculation: Speculation | None = None,
) -> MappingChoice:
    """The best mapping of ``cfg`` on ``spec`` for ``objective`` at one workload point.

    Every candidate (:func:`candidate_mappings`) is screened analytically; the ``finalists`` best
    are simulated with their timing-pass step models (with ``speculation``, MTP's drafting and
    verification: the screen does not model it); the best simulated one is returned.

    Raises:
        InvalidArgumentError: bad objective, chips or workload; FitError: nothing fits.
    """
    if objective not in OBJECTIVES:
        raise InvalidArgumentError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    if isinstance(finalists, bool) or not isinstance(finalists, int) or finalists < 1:
        raise InvalidArgumentError(f"finalists={finalists!r} must be an integer >= 1")
    cands = candidate_mappings(cfg, spec, chips=chips, kv_tokens=isl + osl, sequence_tokens=isl + osl)
    points = screen(cfg, spec, cands, isl=isl, osl=osl, concurrencies=[concurrency], routing=routing)
    results = []
    for p in shortlist(points, objective, finalists):
        model = step_model(
            cfg,
            spec,
            p.mapping,
            routing=routing,
            max_batch_tokens=max_batch_tokens,
            sequence_tokens=isl + osl,
            disk_cache=disk_cache,
        )
        metrics = simulate(
            model,
            isl=isl,
            osl=osl,
            concurrency=concurrency,
            requests=requests,
            seed=seed,
            power_w=model.power_w,
            speculation=speculation,
            stack=model.stack,
        )
        results.append((p.mapping, metrics, model))
    results.sort(key=lambda r: -metric_value(r[1], objective))
    mapping, metrics, model = results[0]
    return MappingChoice(mapping, metrics, model, tuple((m, x) for m, x, _ in results), len(cands))
