"""How one model is spread over the chips of a scale-up domain, and whether it fits their HBM.

Stage: rack, between the model (one die) and the serving sweep. A :class:`Mapping` names four
degrees of parallelism; ``chips = tp * dp * pp``. What each one splits, and what is replicated:

- **pp** (pipeline): the layers are cut into ``pp`` contiguous stages of ``tp * dp`` chips each
  (the first ``layers % pp`` stages take one layer more); the embedding lives on the first stage,
  the final norm and the logits on the last.
- **tp** (tensor parallel, attention and dense layers): inside a DP group of ``tp`` chips the
  attention heads are split (``q_heads / tp`` query heads per chip; GQA KV heads split too while
  ``tp <= kv_heads``, and each KV head is *replicated* on ``tp / kv_heads`` chips when
  ``tp > kv_heads``; MLA's single latent KV cache and its ``q_a``/``kv_a`` down-projections are
  replicated on every chip of the group, as vLLM does). The QKV/``q_b`` GEMMs split their output
  columns, ``o_proj`` its input rows (its partial sums are all-reduced over the group), a dense FFN
  splits its intermediate columns (all-reduced too), the logits split the vocabulary. The
  embedding table is replicated.
- **dp** (data parallel attention): the sequences are split over ``dp`` groups; each group keeps
  its sequences' KV cache, so KV capacity adds up over groups.
- **ep** (expert parallel, MoE layers): the routed experts of a stage are split over ``ep``
  expert groups (``ep`` divides ``tp * dp`` and the number of experts); each expert group has
  ``tp * dp / ep`` chips that split every one of its experts' intermediate columns (expert tensor
  parallelism), so routed-expert weights are never replicated. Every token's hidden state goes to
  the chips holding its experts and the partial outputs come back (:mod:`jalapeno_emu.rack.slices`
  builds the byte matrices). Shared experts and the router are replicated on every chip.

Memory: :func:`chip_memory` adds the weights of the busiest chip (the largest stage) and the KV
bytes one cached token costs it; :func:`fits` checks weights plus a number of cached tokens against
HBM and raises :class:`FitError` with the numbers. Activations and workspace are not reserved
(one step's activations are well under 1 % of HBM at 8192 tokens per step).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.model.config import ModelConfig
from jalapeno_emu.model.footprint import fmt_bytes_per_element

__all__ = [
    "KV_DTYPE_BYTES",
    "ChipMemory",
    "FitError",
    "Mapping",
    "check_mapping",
    "chip_memory",
    "fits",
    "kv_capacity_tokens",
    "pad32",
    "parse_mapping",
    "stage_layers",
]

KV_DTYPE_BYTES = 2
"""The KV cache is BF16 (what the decode and prefill kernels read and write by default)."""

_KEYS = ("tp", "ep", "dp", "pp")
_ITEM = re.compile(r"^\s*([a-z]+)\s*=\s*([^,=\s]*)\s*$")


def pad32(n: float) -> int:
    """``n`` rounded up to a multiple of 32 (the matrix unit's K block and the kernels' granule)."""
    return int(-(-math.ceil(n) // 32) * 32)


class FitError(InvalidArgumentError):
    """A model and its KV cache do not fit the HBM of the chips a mapping gives it."""


@dataclass(frozen=True)
class Mapping:
    """Degrees of parallelism of one deployment (see the module docstring for what each splits).

    Attributes:
        tp: chips per DP group splitting attention heads and dense GEMMs.
        ep: expert groups the routed experts of a stage are split over (divides ``tp * dp``).
        dp: DP groups (independent sequences and KV caches).
        pp: pipeline stages.
    """

    tp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for key in _KEYS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"mapping {key}={value!r} must be an integer >= 1")
        if self.stage_chips % self.ep:
            raise InvalidArgumentError(
                f"mapping ep={self.ep} must divide the chips of a pipeline stage, tp*dp = "
                f"{self.tp}*{self.dp} = {self.stage_chips}"
            )

    @property
    def chips(self) -> int:
        """Chips of the deployment: tp * dp * pp."""
        return self.tp * self.dp * self.pp

    @property
    def stage_chips(self) -> int:
        """Chips of one pipeline stage: tp * dp."""
        return self.tp * self.dp

    @property
    def expert_tp(self) -> int:
        """Chips splitting each routed expert's intermediate columns: tp * dp / ep."""
        return self.stage_chips // self.ep

    @property
    def name(self) -> str:
        """The canonical text form, ``tp=8,ep=8,dp=1,pp=1`` (what :func:`parse_mapping` reads)."""
        return ",".join(f"{k}={getattr(self, k)}" for k in _KEYS)

    def __str__(self) -> str:
        return self.name

    def as_dict(self) -> dict[str, int]:
        """JSON form: tp, ep, dp, pp and chips."""
        return {**{k: getattr(self, k) for k in _KEYS}, "chips": self.chips}


def parse_mapping(text: str) -> Mapping:
    """A :class:`Mapping` from ``"tp=8,ep=16,dp=2"`` (keys tp, ep, dp, pp in any order; missing ones 1).

    Raises:
        InvalidArgumentError: an empty string, an item that is not ``key=integer``, an unknown or
            repeated key, a value < 1, or ep not dividing tp*dp.
    """
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgumentError(f"mapping {text!r} is empty; write e.g. 'tp=8,ep=8,dp=1'")
    values: dict[str, int] = {}
    for item in text.split(","):
        m = _ITEM.match(item)
        if not m:
            raise InvalidArgumentError(
                f"mapping {text!r}: {item.strip()!r} is not key=integer (keys: {', '.join(_KEYS)})"
            )
        key, raw = m.groups()
        if key not in _KEYS:
            raise InvalidArgumentError(f"mapping {text!r}: unknown key {key!r} (keys: {', '.join(_KEYS)})")
        if key in values:
            raise InvalidArgumentError(f"mapping {text!r}: {key} is given twice")
        if not raw.isdigit():
            raise InvalidArgumentError(f"mapping {text!r}: {key}={raw!r} is not a positive integer")
        values[key] = int(raw)
    return Mapping(**values)


def check_mapping(cfg: ModelConfig, mapping: Mapping, spec: ChipSpec | None = None) -> None:
    """Refuse a mapping the model's shape (or the spec's domain) cannot take.

    Rules: tp divides q_heads; for GQA, tp divides kv_heads or is a multiple of it (KV heads
    replicated); ep divides the routed experts (ep = 1 for a model without them); pp <= layers;
    chips <= ``spec.link.domain_chips`` (one switched scale-up domain).

    Raises:
        InvalidArgumentError: naming the mapping, the key and the model's number it breaks.
    """
    where = f"mapping {mapping.name} for {cfg.name}"
    if cfg.q_heads % mapping.tp:
        raise InvalidArgumentError(f"{where}: tp={mapping.tp} must divide the {cfg.q_heads} attention heads")
    if cfg.attention == "gqa" and cfg.kv_heads % mapping.tp and mapping.tp % cfg.kv_heads:
        raise InvalidArgumentError(
            f"{where}: tp={mapping.tp} must divide the {cfg.kv_heads} KV heads or be a "
            "multiple of them (then each KV head is replicated)"
        )
    if cfg.experts == 0 and mapping.ep != 1:
        raise InvalidArgumentError(f"{where}: ep={mapping.ep} but the model has no routed experts")
    if cfg.experts and cfg.experts % mapping.ep:
        raise InvalidArgumentError(f"{where}: ep={mapping.ep} must divide the {cfg.experts} routed experts")
    if mapping.pp > cfg.layers:
        raise InvalidArgumentError(f"{where}: pp={mapping.pp} stages for {cfg.layers} layers")
    if spec is not None and mapping.chips > spec.link.domain_chips:
        raise InvalidArgumentError(
            f"{where}: {mapping.chips} chips exceed {spec.name}'s scale-up domain of "
            f"{spec.link.domain_chips} chips",
            hint="the rack model prices collectives inside one switched domain",
        )


def stage_layers(cfg: ModelConfig, pp: int) -> tuple[range, ...]:
    """The layer indices of each pipeline stage: contiguous, the first ``layers % pp`` one longer."""
    base, extra = divmod(cfg.layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return tuple(out)


def _kv_heads_per_chip(cfg: ModelConfig, tp: int) -> int:
    return max(1, cfg.kv_heads // tp)


def attention_weight_bytes(cfg: ModelConfig, tp: int) -> float:
    """One layer's attention weights on one chip of a ``tp`` group, bytes."""
    w = fmt_bytes_per_element(cfg.weight_fmt)
    h, q = cfg.hidden, cfg.q_heads // tp
    if cfg.attention == "gqa":
        qkv = (q + 2 * _kv_heads_per_chip(cfg, tp)) * cfg.head_dim
        elems = h * qkv + q * cfg.head_dim * h
        bias = (qkv + h) * 2 if cfg.attention_bias else 0
        return elems * w + bias + (q * 4 if cfg.sinks else 0)
    qk = cfg.qk_nope_dim + cfg.qk_rope_dim
    down = h * cfg.q_lora_rank + h * (cfg.kv_lora_rank + cfg.qk_rope_dim)  # replicated
    up = cfg.q_lora_rank * q * qk if cfg.q_lora_rank else h * q * qk
    kv_b = cfg.kv_lora_rank * q * (cfg.qk_nope_dim + cfg.v_head_dim)
    o = q * cfg.v_head_dim * h
    return (down + up + kv_b + o) * w + (cfg.q_lora_rank + cfg.kv_lora_rank) * 2


def expert_bytes(cfg: ModelConfig, intermediate: int) -> float:
    """One expert (gate, up, down) of ``intermediate`` columns in the expert format, biases included."""
    e = fmt_bytes_per_element(cfg.expert_weight_fmt)
    bias = (2 * intermediate + cfg.hidden) * 2 if cfg.expert_bias else 0
    return 3 * cfg.hidden * intermediate * e + bias


def ffn_weight_bytes(cfg: ModelConfig, mapping: Mapping, layer: int) -> float:
    """One layer's FFN weights on one chip: a dense FFN split over tp, or E/ep routed experts of
    I/(tp*dp/ep) columns plus the replicated router and shared experts."""
    if not cfg.is_moe(layer):
        e = fmt_bytes_per_element(cfg.expert_weight_fmt)
        return 3 * cfg.hidden * pad32(cfg.dense_intermediate / mapping.tp) * e
    routed = cfg.experts // mapping.ep * expert_bytes(cfg, pad32(cfg.moe_intermediate / mapping.expert_tp))
    router = cfg.hidden * cfg.experts * 2 + (cfg.experts * 2 if cfg.router_bias else 0)
    score_bias = cfg.experts * 4 if cfg.score_bias else 0
    shared = cfg.shared_experts * expert_bytes(cfg, cfg.moe_intermediate)
    return routed + router + score_bias + shared


def _layer_kv_bytes(cfg: ModelConfig, layer: int, tp: int, sequence_tokens: int | None) -> float:
    if cfg.attention == "mla":
        per = (cfg.kv_lora_rank + cfg.qk_rope_dim) * KV_DTYPE_BYTES  # replicated over tp
    else:
        per = 2 * _kv_heads_per_chip(cfg, tp) * cfg.head_dim * KV_DTYPE_BYTES
    w = cfg.window(layer)
    if w and sequence_tokens:
        per *= min(1.0, w / sequence_tokens)  # a ring of `window` tokens per sequence
    return per


@dataclass(frozen=True)
class ChipMemory:
    """HBM of the busiest chip of a mapping.

    Attributes:
        weight_bytes: weights on the busiest chip (its stage's layers, embedding/logits if it
            holds them), B.
        kv_bytes_per_token: KV bytes one cached token of one of its DP group's sequences costs it, B.
        capacity_bytes: the chip's HBM, B.
        kv_tokens_per_group: cached tokens one DP group can hold (HBM left after the weights over
            ``kv_bytes_per_token``; 0 when the weights alone do not fit).
        kv_capacity_tokens: over the whole deployment: ``dp * kv_tokens_per_group``.
        by_part: weight bytes of the busiest chip by part (attention, ffn, norms, embedding, logits).
    """

    weight_bytes: float
    kv_bytes_per_token: float
    capacity_bytes: int
    kv_tokens_per_group: int
    kv_capacity_tokens: int
    by_part: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "capacity_bytes": self.capacity_bytes,
            "kv_tokens_per_group": self.kv_tokens_per_group,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "by_part": dict(self.by_part),
        }


def _stage_bytes(
    cfg: ModelConfig, mapping: Mapping, stage: int, layers: range, sequence_tokens: int | None
) -> tuple[dict[str, float], float]:
    parts = {"attention": 0.0, "ffn": 0.0, "norms": 0.0, "embedding": 0.0, "logits": 0.0}
    kv = 0.0
    for layer in layers:
        parts["attention"] += attention_weight_bytes(cfg, mapping.tp)
        parts["ffn"] += ffn_weight_bytes(cfg, mapping, layer)
        parts["norms"] += 2 * cfg.hidden * 2
        kv += _layer_kv_bytes(cfg, layer, mapping.tp, sequence_tokens)
    if stage == 0:
        parts["embedding"] = cfg.vocab * cfg.hidden * 2
    if stage == mapping.pp - 1:
        vocab = math.ceil(cfg.vocab / mapping.tp)
        parts["logits"] = cfg.hidden * 2 + (
            0 if cfg.tie_word_embeddings else vocab * cfg.hidden * fmt_bytes_per_element(cfg.weight_fmt)
        )
    return parts, kv


def chip_memory(
    cfg: ModelConfig, spec: ChipSpec, mapping: Mapping, *, sequence_tokens: int | None = None
) -> ChipMemory:
    """Weights and KV bytes per token of the busiest chip of ``mapping`` (no fit check).

    Args:
        sequence_tokens: a typical sequence's length (isl + osl); sliding-window layers keep a ring
            of ``window`` tokens per sequence, which costs ``window / sequence_tokens`` of a token's
            bytes per cached token. None counts them at the full rate (an upper bound).
    """
    check_mapping(cfg, mapping)
    cap = spec.hbm.capacity_bytes
    best: tuple[float, dict[str, float], float] | None = None
    tokens_per_group = None
    for s, layers in enumerate(stage_layers(cfg, mapping.pp)):
        parts, kv = _stage_bytes(cfg, mapping, s, layers, sequence_tokens)
        total = sum(parts.values())
        room = cap - total
        tokens = int(room // kv) if room > 0 and kv > 0 else 0
        tokens_per_group = tokens if tokens_per_group is None else min(tokens_per_group, tokens)
        if best is None or total > best[0]:
            best = (total, parts, kv)
    assert best is not None and tokens_per_group is not None
    total, parts, kv = best
    return ChipMemory(
        weight_bytes=total,
        kv_bytes_per_token=kv,
        capacity_bytes=cap,
        kv_tokens_per_group=tokens_per_group,
        kv_capacity_tokens=tokens_per_group * mapping.dp,
        by_part=parts,
    )


def kv_capacity_tokens(
    cfg: ModelConfig, spec: ChipSpec, mapping: Mapping, *, sequence_tokens: int | None = None
) -> int:
    """Cached tokens the whole deployment holds: dp groups x what HBM left after the weights holds
    on the tightest stage (0 when the weights alone do not fit)."""
    return chip_memory(cfg, spec, mapping, sequence_tokens=sequence_tokens).kv_capacity_tokens


def fits(
    cfg: ModelConfig, spec: ChipSpec, mapping: Mapping, kv_tokens: int, *, sequence_tokens: int | None = None
) -> ChipMemory:
    """Check that weights plus ``kv_tokens`` cached tokens (over the whole deployment, spread
    evenly over the dp groups) fit every chip's HBM.

    Returns:
        The busiest chip's :class:`ChipMemory`.

    Raises:
        FitError: with the weight, KV and capacity bytes per chip when they do not fit.
        InvalidArgumentError: a mapping the model cannot take, kv_tokens < 0.
    """
    if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int) or kv_tokens < 0:
        raise InvalidArgumentError(f"kv_tokens={kv_tokens!r} must be an integer >= 0")
    mem = chip_memory(cfg, spec, mapping, sequence_tokens=sequence_tokens)
    where = f"{cfg.name} on {spec.name} with {mapping.name}"
    cap_gb = mem.capacity_bytes / 1e9
    if mem.weight_bytes > mem.capacity_bytes:
        raise FitError(
            f"{where}: {mem.weight_bytes / 1e9:,.1f} GB of weights per chip exceed its "
            f"{cap_gb:,.1f} GB of HBM",
            hint="use more chips (tp, ep or pp)",
        )
    per_group = math.ceil(kv_tokens / mapping.dp)
    kv_bytes = per_group * mem.kv_bytes_per_token
    if mem.weight_bytes + kv_bytes > mem.capacity_bytes:
        raise FitError(
            f"{where}: {mem.weight_bytes / 1e9:,.1f} GB of weights + {kv_bytes / 1e9:,.1f} GB of KV cache "
            f"({per_group:,} tokens x {mem.kv_bytes_per_token:,.0f} B) per chip exceed its {cap_gb:,.1f} GB "
            f"of HBM; it holds {mem.kv_tokens_per_group:,} tokens per DP group",
            hint="more dp groups or chips",
        )
    return mem
