"""The serving step-time model of one mapping: per-chip kernel times from the timing pass, plus
collectives, for the busiest chip; interpolated on a small grid timed once.

Stage: rack, implementing :class:`jalapeno_emu.serving.StepTimeModel` for the serving simulator.

**A step.** The simulator hands a :class:`~jalapeno_emu.serving.StepWork`: ``n`` decoding
sequences (their contexts) and prefill chunks ``(new, cached)``. The deployment runs it as:

- decode sequences spread evenly over the ``dp`` groups (the busiest holds ``ceil(n / dp)``);
  prefill chunks go whole to the least-loaded group, largest first; the step's time is the
  busiest group's (every MoE layer's all-to-all synchronises the groups);
- with ``pp`` stages the group's work is cut into ``f`` micro-batches, ``f = pp`` when the step
  prefills (a chunk splits along its tokens) and ``f = min(pp, sequences)`` when it only decodes
  (a sequence cannot be split); each carries ``1/f`` of the decode sequences (rounded up),
  prefill tokens and attention work, and stage s processes one in ``t_s``. A stage is busy
  ``f * t_s`` per step and one micro-batch needs ``sum_s t_s`` plus ``pp - 1`` stage-to-stage
  transfers to get through, so a step (every sequence advancing one token) takes
  ``max(sum_s t_s + (pp-1) * p2p, f * max_s t_s)``: with the pipeline full (f = pp) the slowest
  stage sets the throughput, with fewer micro-batches the pipeline bubbles;
- a stage's time for a micro-batch is, over its layers, the chip's kernel times plus the layer's
  collectives (nothing overlaps), plus the embedding (first stage) and final norm, logits and the
  sampling all-gather (last stage).

**A layer on the busiest chip** (launches from :mod:`jalapeno_emu.rack.slices`), for ``b`` decode
sequences with mean context ``c`` and prefill chunks, ``t = b + prefill tokens`` on the chip:

- *token part* ``T(t)``: norms, projections, dense FFN, shared experts, and the tp collectives,
  run ONCE over the ``t`` tokens of the mixed batch -- the weights of a mixed step are read once
  (that is how decode and prefill share weight reads);
- *routed experts* ``M(x)``: the MoE kernel on the ``x`` tokens the busiest expert group receives
  out of the stage's tokens, with its expected distinct experts; plus the dispatch and combine
  all-to-alls ``A(stage tokens)``;
- *decode attention* ``D(b, c)``: KV append plus decode attention of b sequences of context c
  (the batch's mean context: the kernels' cost is linear in the tokens read);
- *prefill attention* ``P(n, p)`` summed over the chunks: one chunk of n new tokens after p cached.

**Speculative decoding** (``StepWork.decode_query_tokens`` = K + 1): every decoding sequence
brings K + 1 tokens to the token part and the experts (``t = b (K + 1) + prefill tokens``), its
decode attention runs with K + 1 times the query heads per KV head (``D`` of its own grid: the
cache is read once), the logits cover every query token, and the last stage adds K drafts, each
one more layer of the last layer's kind for ``b`` tokens plus the final norm and logits.

**The grid, timed once, interpolated.** Each part is timed with the emulator's timing pass
(:class:`~jalapeno_emu.rack.launch_timer.LaunchTimer`, shared by every mapping of a process) at
grid points, each the first time a step needs it, and never again:

- ``T``, ``A``, embedding, tail: tokens in powers of two, piecewise linear in tokens;
- ``M``: received tokens in powers of two. Where the kernel serves
  expert *slots* (up to 128 tokens, each slot computing its expected share of the routed rows:
  one matrix-unit row tile) the time is piecewise linear in the expected distinct experts, which
  its weight reads follow;
  where it runs its token-gathering program, piecewise linear in tokens; between a slot point and
  a gathering point it is priced at the gathering one (that program's fixed cost is a step up); a
  batch the kernel refuses (a GPU
  preset's small scratchpad) runs as equal pieces, each hitting its own distinct experts;
- ``D``: batch in powers of two up to ``b_unit`` (the batch that gives every core two KV heads of
  a sequence: ``2 * cores / kv heads per chip``; MLA ``2 * cores``), times contexts 32, 64, ...
  2048, then multiples of 2048 to 16384, then powers of two; bilinear. Beyond ``b_unit`` linear in the batch
  with the last segment's slope, floored by what one more sequence costs in HBM bytes at the
  achievable bandwidth and in FLOPs at the BF16 peak (both from the timing pass's figures), so a
  last segment still below the die's knee does not make more sequences look free;
- ``P``: chunk length in powers of two from 32 up to ``n_unit`` (every core has a 128-query tile
  of a head: ``128 * cores / heads per chip``), times priors 0, 512, 1024, 2048, ...; bilinear. A
  longer chunk runs as ``k = ceil(n / n_unit)`` equal sub-chunks, sub-chunk j after ``p + j n/k``
  cached tokens (exactly causal chunked prefill). Chunks shorter than 32 tokens are priced as 32
  (the kernels' granule).

Kernel times include the spec's kernel launch cost; the interpolation error against direct
timing-pass runs at off-grid points is measured in ``tests/rack/test_step_model.py``.

**Capacity.** ``kv_capacity_tokens`` is what HBM left after the weights holds, per DP group, times
dp (:func:`jalapeno_emu.rack.mapping.chip_memory`); ``max_batch_tokens`` is the per-group step
budget (default 8192) times dp.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec, load_preset
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.model.config import ModelConfig, load_model_config
from jalapeno_emu.model.plan import Step
from jalapeno_emu.rack.grid import LazyGrid1D, LazyGrid2D, bracket1
from jalapeno_emu.rack.launch_timer import LaunchTimer, shared_timer
from jalapeno_emu.rack.mapping import (
    ChipMemory,
    FitError,
    Mapping,
    check_mapping,
    fits,
    parse_mapping,
    stage_layers,
)
from jalapeno_emu.rack.routing import UNIFORM, ExpertLoad, Routing, parse_routing
from jalapeno_emu.rack.slices import (
    ACT_BYTES,
    DENSE_PART_CONTEXT,
    chip_config,
    chip_head_launches,
    chip_tail_launches,
    decode_attention_launches,
    layer_kind,
    moe_all_to_alls,
    prefill_attention_launches,
    routed_moe_launch,
    tail_collectives,
    token_launches,
    tp_collectives,
)
from jalapeno_emu.serving.limits import MAX_BATCH_TOKENS
from jalapeno_emu.serving.metrics import power_w_from_spec
from jalapeno_emu.serving.stack import load_stack
from jalapeno_emu.serving.step_model import StepWork

__all__ = ["CONTEXT_GRID", "DEFAULT_BATCH_TOKENS", "PRIOR_GRID", "RackStepModel"]

DEFAULT_BATCH_TOKENS = 8192
"""Token budget of one DP group's step (decode tokens + prefill tokens)."""

_POW2 = np.array([2.0**i for i in range(24)])
CONTEXT_GRID = np.unique(
    np.concatenate([2.0 ** np.arange(5, 12), 2048.0 * np.arange(1, 9), 2.0 ** np.arange(15, 24)])
)
"""Decode contexts the attention part is timed at (as needed)."""
PRIOR_GRID = np.concatenate([[0.0], 2.0 ** np.arange(9, 24)])
"""Cached tokens before a prefill chunk that its attention is timed at (as needed)."""
MOE_GRID = _POW2
_MOE_GRID_LIST = [float(g) for g in MOE_GRID]
"""Tokens received the routed-expert kernel is timed at (as needed): powers of two (a step's budget,
8192 tokens by default, is one of them)."""


def _pow2_ceil(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(x) - 1e-12)) if x > 1 else 1


class RackStepModel:
    """Step times of ``cfg`` on ``mapping`` over chips of ``spec`` (see the module docstring).

    Args:
        cfg: the model (a ModelConfig or a name for :func:`~jalapeno_emu.model.load_model_config`).
        spec: the chip (a ChipSpec or a preset name).
        mapping: a :class:`~jalapeno_emu.rack.mapping.Mapping` or its text (``"tp=8,ep=8"``).
        routing: the MoE routing distribution (:class:`~jalapeno_emu.rack.routing.Routing` or
            ``"uniform"`` / ``"zipf:1.2"``).
        max_batch_tokens: token budget of one DP group's step (at most
            :data:`~jalapeno_emu.serving.limits.MAX_BATCH_TOKENS`).
        sequence_tokens: a typical request's isl + osl, for the KV capacity of sliding-window
            layers (see :func:`~jalapeno_emu.rack.mapping.chip_memory`); None: full rate.
        timer: the LaunchTimer to use (default: the process-wide one of ``spec``).
        disk_cache: with the default timer, keep kernel figures on disk across processes.
        name: the name shown in sweeps (default: the mapping's text).

    Attributes (the serving protocol): ``name``, ``chips``, ``kv_capacity_tokens``,
    ``max_batch_tokens``, ``series`` (the preset), ``power_w`` (package, sustained, all-in watts
    per chip), ``stack`` (the preset's serving stack, :mod:`jalapeno_emu.serving.stack`); also
    ``cfg``, ``spec``, ``mapping``, ``routing``, ``memory`` (:class:`ChipMemory`).

    Raises:
        InvalidArgumentError: a mapping the model or the domain cannot take.
        FitError: the weights (and at least one token of KV cache) do not fit a chip's HBM.
    """

    def __init__(
        self,
        cfg: ModelConfig | str,
        spec: ChipSpec | str,
        mapping: Mapping | str,
        *,
        routing: Routing | str = UNIFORM,
        max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
        sequence_tokens: int | None = None,
        timer: LaunchTimer | None = None,
        disk_cache: bool = False,
        name: str | None = None,
    ) -> None:
        self.cfg = load_model_config(cfg) if isinstance(cfg, str) else cfg
        self.spec = load_preset(spec) if isinstance(spec, str) else spec
        self.mapping = parse_mapping(mapping) if isinstance(mapping, str) else mapping
        self.routing = parse_routing(routing) if isinstance(routing, str) else routing
        if (
            isinstance(max_batch_tokens, bool)
            or not isinstance(max_batch_tokens, int)
            or max_batch_tokens < 1
        ):
            raise InvalidArgumentError(f"max_batch_tokens={max_batch_tokens!r} must be an integer >= 1")
        # Bounded (serving/limits.py): a step's tokens are the rows its kernels are built at.
        MAX_BATCH_TOKENS.check("max_batch_tokens", max_batch_tokens)
        check_mapping(self.cfg, self.mapping, self.spec)
        self.memory: ChipMemory = fits(self.cfg, self.spec, self.mapping, 0, sequence_tokens=sequence_tokens)
        if self.memory.kv_capacity_tokens < 1:
            raise FitError(
                f"{self.cfg.name} on {self.spec.name} with {self.mapping.name}: the weights leave no "
                "HBM for the KV cache",
                hint="use more chips",
            )
        self.name = name or self.mapping.name
        self.series = self.spec.name
        self.chips = self.mapping.chips
        self.kv_capacity_tokens = self.memory.kv_capacity_tokens
        self.group_batch_tokens = max_batch_tokens
        self.max_batch_tokens = max_batch_tokens * self.mapping.dp
        self.power_w = power_w_from_spec(self.spec)
        self.stack = load_stack(self.spec.software.stack)  # the host's costs, charged by the simulator
        self.timer = timer or shared_timer(self.spec, disk_cache=disk_cache)
        self.fusion = self.spec.software.fusion
        self.fusion_fallbacks = 0  # parts that could not be fused (a kernel without an emitter)
        self.load = (
            ExpertLoad(self.cfg.experts, self.cfg.top_k, self.mapping.ep, self.routing)
            if self.cfg.experts
            else None
        )
        self._chip = chip_config(self.cfg, self.mapping)
        self._stages = [
            Counter(layer_kind(self.cfg, i) for i in layers)
            for layers in stage_layers(self.cfg, self.mapping.pp)
        ]
        self._rep: dict[tuple[int, bool], int] = {}
        for i in range(self.cfg.layers):
            self._rep.setdefault(layer_kind(self.cfg, i), i)
        self._build_tables()
        self._probe()

    def _probe(self) -> None:
        """Time the smallest routed-expert and prefill-attention launches now, so a preset whose
        kernels refuse this model's shapes fails here, with the kernel's reason, not mid-sweep."""
        if self.load is not None:
            self._moe_point(1)
        for table in self._pre.values():
            table(32.0, np.zeros(1))

    # --- tables -------------------------------------------------------------------------------
    def _build_tables(self) -> None:
        cores = self.spec.core.count
        kv_units = 1 if self.cfg.attention == "mla" else self._chip.kv_heads
        self.b_unit = max(2, _pow2_ceil(2.0 * cores / kv_units))
        self.n_unit = min(8192, _pow2_ceil(max(128.0, 128.0 * cores / self._chip.q_heads)))
        n_grid = _POW2[(_POW2 >= 32) & (max(32, self.n_unit) >= _POW2)]
        d = self.spec.derived()
        rates = (d["hbm_achievable_bytes_per_s"], d["peak_bf16_flops_per_s"])
        self._tok: dict[tuple[int, bool], LazyGrid1D] = {}
        self._dec: dict[tuple[int, bool], LazyGrid2D] = {}
        self._dec_q: dict[tuple[tuple[int, bool], int], LazyGrid2D] = {}  # speculative decoding's
        self._pre: dict[tuple[int, bool], LazyGrid2D] = {}
        for kind, layer in self._rep.items():
            self._tok[kind] = LazyGrid1D(
                _POW2, lambda t, layer=layer: self._token_s(layer, t),
                prefetch=lambda ts, layer=layer: self._prefetch(
                    [token_launches(self.cfg, self.mapping, layer, t) for t in ts]))
            self._dec[kind] = self._decode_grid(layer, 1)
            self._pre[kind] = LazyGrid2D(
                n_grid,
                PRIOR_GRID,
                lambda n, p, layer=layer: self._figures(
                    prefill_attention_launches(self.cfg, self.mapping, layer, n, p),
                    layer, Step("prefill", batch=1, seq=int(n), prior=int(p)),
                ),
                *rates,
                prefetch=lambda pts, layer=layer: self._prefetch(
                    [prefill_attention_launches(self.cfg, self.mapping, layer, n, p) for n, p in pts]),
            )
        self._head = LazyGrid1D(_POW2, lambda t: self._launches_s(chip_head_launches(self.cfg, t)))
        self._tail = LazyGrid1D(
            _POW2,
            lambda r: (
                self._launches_s(chip_tail_launches(self.cfg, self.mapping, r), self._chip.layers,
                                 Step("decode", batch=int(r), context=1))
                + sum(c.time_s for c in tail_collectives(self.spec, self.mapping, r).values())
            ),
        )
        if self.load is not None:
            self._a2a = LazyGrid1D(
                _POW2,
                lambda t: sum(
                    c.time_s
                    for c in moe_all_to_alls(self.cfg, self.spec, self.mapping, self.load, t).values()
                ),
            )
            self._moe_pieces: dict[int, tuple[float, bool]] = {}
            self._moe_refused: set[int] = set()  # batches the kernel refused (not monotone in tokens)
            self._moe_answers: dict[float, float] = {}  # steps repeat their received token counts

    def _decode_grid(self, layer: int, query_tokens: int) -> LazyGrid2D:
        """``D`` of ``layer``'s kind for ``query_tokens`` query tokens per sequence (batch x
        context; more than one under speculative decoding: ``decode_attention_launches``)."""
        d = self.spec.derived()
        q = query_tokens
        return LazyGrid2D(
            _POW2[self.b_unit >= _POW2],
            CONTEXT_GRID,
            lambda b, c: self._figures(
                decode_attention_launches(self.cfg, self.mapping, layer, b, c, q),
                layer, Step("decode", batch=int(b), context=int(c)),
            ),
            d["hbm_achievable_bytes_per_s"], d["peak_bf16_flops_per_s"],
            prefetch=lambda pts: self._prefetch(
                [decode_attention_launches(self.cfg, self.mapping, layer, b, c, q) for b, c in pts]),
        )

    def _prefetch(self, points: Sequence[Sequence[Any]]) -> None:
        """Time side by side the launches of grid points about to be computed, each point's
        launches as ``_figures`` will ask for them: all of them without fusion, a lone one with
        (several are one fused part, built where it is asked for)."""
        wanted = [la for launches in points
                  if self.fusion == "none" or len(launches) == 1 for la in launches]
        self.timer.prefetch(wanted)

    def _figures(self, launches: Sequence[Any], layer: int | None = None,
                 step: Step | None = None) -> np.ndarray:
        """float64[3]: time (s), HBM bytes and FLOPs of a part of a layer: its launches back to back
        (fusion none), or one fused program of them without the launch cost (layer, step; the
        launches are counted once per layer or step in ``_step_times``). A part that cannot be
        fused (a kernel with no emitter, a shape it refuses fused) runs as launches."""
        out = np.zeros(3)
        if self.fusion != "none" and layer is not None and step is not None and launches:
            try:
                if len(launches) == 1:  # one operator: its stand-alone program is its fused one
                    t = self.timer.time(launches[0])
                    return np.array([t.time_s - self.spec.sync.kernel_launch_s, t.hbm_bytes, t.flops])
                t = self.timer.time_part(self._chip, layer, step, tuple(launches))
                return np.array([t.time_s, t.hbm_bytes, t.flops])
            except InvalidArgumentError:
                self.fusion_fallbacks += 1
        for la in launches:
            t = self.timer.time(la)
            out += (t.time_s, t.hbm_bytes, t.flops)
        return out

    def _launches_s(self, launches: Sequence[Any], layer: int | None = None,
                    step: Step | None = None) -> float:
        if self.fusion != "none" and layer is None and len(launches) == 1:
            return self.timer.time_s(launches[0]) - self.spec.sync.kernel_launch_s
        return float(self._figures(launches, layer, step)[0])

    def _token_s(self, layer: int, tokens: int) -> float:
        comm = tp_collectives(self.cfg, self.spec, self.mapping, layer, tokens)
        step = Step("decode", batch=int(tokens), context=DENSE_PART_CONTEXT)
        return self._launches_s(token_launches(self.cfg, self.mapping, layer, tokens), layer, step) + sum(
            c.time_s for c in comm.values()
        )

    @property
    def _launch_per_layer_s(self) -> float:
        """Launch cost a layer pays with ``layer`` fusion (one program per layer)."""
        return self.spec.sync.kernel_launch_s if self.fusion == "layer" else 0.0

    @property
    def _launch_per_stage_s(self) -> float:
        """Launch cost a stage pays per micro-batch with ``step`` fusion (one program per step)."""
        return self.spec.sync.kernel_launch_s if self.fusion == "step" else 0.0

    # --- routed experts -------------------------------------------------------------------------
    def _moe_launch(self, received: float) -> Any:
        assert self.load is not None
        stage_tokens = received / self.load.hit[self.load.busiest]
        return routed_moe_launch(
            self.cfg,
            self.mapping,
            received,
            float(self.load.distinct(stage_tokens)),
            self.load.picks_per_token(),
            self.spec,
            grouping=self.timer.moe_grouping,
        )

    def _moe_point(self, tokens: int) -> tuple[float, bool] | None:
        """(seconds, slot-based?) of the MoE kernel on ``tokens`` received tokens; None when the
        kernel refuses that batch (then it runs in pieces)."""
        v = self._moe_pieces.get(tokens)
        if v is not None:
            return v
        if tokens in self._moe_refused:
            return None
        try:
            # Inside the try: the launch's shape can be refused before any build (a tokens value
            # beyond the kernel's limit), and that batch then runs in pieces like any refused one.
            launch = self._moe_launch(tokens)
            t = self.timer.time(launch, split=False).time_s
            if self.fusion != "none":  # one operator of a fused program: no launch of its own
                t -= self.spec.sync.kernel_launch_s
        except InvalidArgumentError as exc:
            if tokens == 1:
                raise InvalidArgumentError(
                    f"kernel moe cannot run on {self.spec.name}: {exc.message}", hint=exc.hint
                ) from None
            self._moe_refused.add(tokens)
            return None
        v = self._moe_pieces[tokens] = (t, launch.shape_dict["distinct_experts"] > 0)
        return v

    def _distinct(self, received: np.ndarray) -> np.ndarray:
        assert self.load is not None
        return self.load.distinct(received / self.load.hit[self.load.busiest])

    def moe_compute_s(self, received: float) -> float:
        """Seconds of the routed-expert kernel(s) on the busiest chip for ``received`` tokens:
        piecewise linear between :data:`MOE_GRID` points, in expected distinct experts where the
        kernel serves expert slots (its weight reads follow them), else in tokens; a batch the
        kernel refuses runs as equal pieces, each hitting its own distinct experts."""
        if received <= 0:
            return 0.0
        v = self._moe_answers.get(received)
        if v is None:
            v = self._moe_answers[received] = self._moe_compute_s(received)
        return v

    def _moe_compute_s(self, received: float) -> float:
        pieces = 1
        while True:
            x = max(1.0, received / pieces)
            i, w = bracket1(_MOE_GRID_LIST, x)
            lo, hi = int(MOE_GRID[i]), int(MOE_GRID[i + 1])
            top = hi if w > 0 else lo
            p_top = self._moe_point(top)
            if p_top is None:
                below = MOE_GRID[top > MOE_GRID]
                pieces = math.ceil(received / below[-1])
                continue
            if top == lo:
                return pieces * p_top[0]
            p_lo = self._moe_point(lo)
            if p_lo is None:
                # The kernel takes the larger batch but refuses the smaller one (a program choice
                # that is not monotone in tokens): x tokens run as the larger batch.
                return pieces * p_top[0]
            weight = w
            if p_lo[1] and not p_top[1]:
                weight = 1.0  # slots below, the gathering program above: x runs the latter
            elif p_lo[1] and p_top[1]:
                dd = self._distinct(np.array([lo, x, hi], dtype=np.float64))
                if dd[2] > dd[0]:
                    weight = float((dd[1] - dd[0]) / (dd[2] - dd[0]))
            return pieces * (p_lo[0] + weight * (p_top[0] - p_lo[0]))

    # --- one step ---------------------------------------------------------------------------------
    def _busiest_bin(self, chunks: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The chunks of the most loaded DP group (largest chunk first onto the least loaded)."""
        dp = self.mapping.dp
        if dp == 1 or len(chunks) <= 1:
            return list(chunks)
        bins: list[list[tuple[int, int]]] = [[] for _ in range(dp)]
        load = [0] * dp
        for chunk in sorted(chunks, key=lambda c: -c[0]):
            g = load.index(min(load))
            bins[g].append(chunk)
            load[g] += chunk[0]
        return bins[load.index(max(load))]

    def _prefill_attention_s(self, kind: tuple[int, bool], chunks: Sequence[tuple[int, int]]) -> float:
        table = self._pre[kind]
        total = 0.0
        for new, cached in chunks:
            k = math.ceil(new / self.n_unit)
            total += table.run_sum(max(32.0, new / k), float(cached), new / k, k)
        return total

    def _decode_attention_s(self, kind: tuple[int, bool], batch: int,
                            contexts: np.ndarray | float, query_tokens: int = 1) -> np.ndarray | float:
        if query_tokens == 1:
            return self._dec[kind](float(batch), contexts)
        grid = self._dec_q.get((kind, query_tokens))
        if grid is None:
            grid = self._dec_q[(kind, query_tokens)] = self._decode_grid(self._rep[kind], query_tokens)
        return grid(float(batch), contexts)

    def _layer_s(self, kind: tuple[int, bool], t: float, stage_tokens: float, b: int, q: int,
                 mean_context: np.ndarray | float | None, zeros: np.ndarray | float,
                 mine: Sequence[tuple[int, int]], flight: int, exact: bool) -> np.ndarray | float:
        """One layer of ``kind`` on the busiest chip for a micro-batch: its token part on ``t``
        tokens, routed experts for ``stage_tokens``, the prefill chunks ``mine`` (1/``flight`` of
        them) and the decode attention of ``b`` sequences of ``q`` query tokens each."""
        base = self._exact_token_s(kind, t) if exact else self._tok[kind](t)
        if kind[1]:
            assert self.load is not None
            received = float(self.load.received(stage_tokens))
            base += (
                self._exact_moe_s(received, stage_tokens)
                if exact
                else self.moe_compute_s(received) + self._a2a(stage_tokens)
            )
        if mine:
            pre = self._exact_prefill_s(kind, mine) if exact else self._prefill_attention_s(kind, mine)
            base += pre / flight
        if mean_context is None:
            att = zeros
        elif exact:
            att = np.array([self._exact_decode_s(kind, b, float(c), q) for c in np.atleast_1d(mean_context)])
        else:
            att = self._decode_attention_s(kind, b, mean_context, q)
        return base + att + self._launch_per_layer_s

    def _step_times(
        self,
        decode_count: int,
        context_sums: np.ndarray | float,
        chunks: Sequence[tuple[int, int]],
        exact: bool = False,
        query_tokens: int = 1,
    ) -> np.ndarray | float:
        """float64[len(context_sums)]: step times for ``decode_count`` sequences whose contexts sum
        to each entry, plus the prefill ``chunks`` (shared by step_time_s and the stretch hook);
        ``exact`` prices every part by a direct launch instead of the grid. One context sum (a
        float) gives one time, priced in plain floats with the same arithmetic (numpy's cost per
        call is most of a single step's price). ``query_tokens`` > 1: speculative decoding, each
        decoding sequence verifying that many tokens after drafting ``query_tokens - 1`` of them
        (see the module docstring)."""
        m = self.mapping
        pp = m.pp
        q = query_tokens
        b_group = math.ceil(decode_count / m.dp)
        mine = self._busiest_bin(chunks)
        flight = pp if mine else max(1, min(pp, b_group))  # micro-batches in flight
        b = math.ceil(b_group / flight)
        p_tokens = sum(new for new, _ in mine) / flight
        t = b * q + p_tokens
        stage_tokens = (decode_count * q + sum(new for new, _ in chunks)) / flight
        mean_context = context_sums / decode_count if decode_count else None
        zeros = np.zeros_like(context_sums, dtype=np.float64) if isinstance(context_sums, np.ndarray) else 0.0
        layer_s = {kind: self._layer_s(kind, t, stage_tokens, b, q, mean_context, zeros, mine, flight, exact)
                   for kind in self._rep}
        stages = []
        rows = b + len(mine) / flight
        for s, counts in enumerate(self._stages):
            total = sum(n * layer_s[kind] for kind, n in counts.items())
            if s == 0:
                total = total + (self._exact_head_s(t) if exact else self._head(t))
            if s == pp - 1:
                logit_rows = rows + b * (q - 1)  # the verification's: every query token's
                total = total + (self._exact_tail_s(logit_rows) if exact else self._tail(logit_rows))
                if q > 1 and b:
                    draft = self._draft_s(b, decode_count / flight, mean_context, zeros, exact)
                    total = total + (q - 1) * draft
            stages.append(total + self._launch_per_stage_s)
        if pp == 1:
            return stages[0]
        p2p = self.spec.link.message_s(t * self.cfg.hidden * ACT_BYTES)
        return np.maximum(sum(stages) + (pp - 1) * p2p, flight * np.maximum.reduce(stages))

    def _draft_s(self, b: int, stage_tokens: float, mean_context: np.ndarray | float | None,
                 zeros: np.ndarray | float, exact: bool) -> np.ndarray | float:
        """One draft token of speculative decoding for ``b`` sequences: the draft module, one more
        layer of the model's last layer's kind with one query token per sequence, then the final
        norm and the logits (the module shares the model's output head)."""
        kind = layer_kind(self.cfg, self.cfg.layers - 1)
        layer = self._layer_s(kind, float(b), stage_tokens, b, 1, mean_context, zeros, (), 1, exact)
        return layer + (self._exact_tail_s(b) if exact else self._tail(float(b)))

    # --- the same parts without the grid (validation) --------------------------------------------
    def _exact_token_s(self, kind: tuple[int, bool], tokens: float) -> float:
        return self._token_s(self._rep[kind], math.ceil(tokens))

    def _exact_moe_s(self, received: float, stage_tokens: float) -> float:
        assert self.load is not None
        comm = moe_all_to_alls(self.cfg, self.spec, self.mapping, self.load, stage_tokens)
        launch = self._launches_s((self._moe_launch(received),))
        return launch + sum(c.time_s for c in comm.values())

    def _exact_prefill_s(self, kind: tuple[int, bool], chunks: Sequence[tuple[int, int]]) -> float:
        layer = self._rep[kind]  # one launch per chunk (priors on the 32-token grid the kernels take)
        total = 0.0
        for new, cached in chunks:
            n, p = -(-new // 32) * 32, cached // 32 * 32
            launches = prefill_attention_launches(self.cfg, self.mapping, layer, n, p)
            total += self._launches_s(launches, layer, Step("prefill", batch=1, seq=n, prior=p))
        return total

    def _exact_decode_s(self, kind: tuple[int, bool], batch: int, context: float,
                        query_tokens: int = 1) -> float:
        c = -(-round(context) // 32) * 32 if self.cfg.attention == "mla" else round(context)
        launches = decode_attention_launches(self.cfg, self.mapping, self._rep[kind], batch, c, query_tokens)
        return self._launches_s(launches, self._rep[kind], Step("decode", batch=batch, context=c))

    def _exact_head_s(self, tokens: float) -> float:
        return self._launches_s(chip_head_launches(self.cfg, math.ceil(tokens)))

    def _exact_tail_s(self, rows: float) -> float:
        r = max(1, math.ceil(rows))
        comm = tail_collectives(self.spec, self.mapping, r)
        step = Step("decode", batch=r, context=1)
        return self._launches_s(chip_tail_launches(self.cfg, self.mapping, r), self._chip.layers, step) + sum(
            c.time_s for c in comm.values()
        )

    def exact_step_time_s(self, work: StepWork) -> float:
        """The step of :meth:`step_time_s` priced without the grid: every part is one direct launch
        at the step's own sizes (tokens rounded up; a whole decode batch and a whole prefill chunk
        as one launch each, padded to 32 tokens where the kernel needs it). Slow; it measures the
        interpolation and sub-launch error of the grid."""
        if work.batch_tokens <= 0:
            raise InvalidArgumentError("exact_step_time_s: a step needs at least one token")
        sums = np.array([float(work.decode_context_tokens)])
        return float(self._step_times(work.decode_count, sums, work.prefill_chunks, exact=True,
                                      query_tokens=work.decode_query_tokens)[0])

    def step_time_s(self, work: StepWork) -> float:
        """Seconds the deployment takes for one engine step (see the module docstring)."""
        if work.batch_tokens <= 0:
            raise InvalidArgumentError("step_time_s: a step needs at least one token")
        sums = float(work.decode_context_tokens)
        return float(self._step_times(work.decode_count, sums, work.prefill_chunks,
                                      query_tokens=work.decode_query_tokens))

    def decode_stretch_times_s(self, contexts: np.ndarray, steps: int) -> np.ndarray:
        """float64[steps]: decode-only steps, contexts + j at step j (the same arithmetic as
        :meth:`step_time_s`, so the times are identical)."""
        n = int(contexts.size)
        sums = float(np.sum(contexts)) + float(n) * np.arange(steps, dtype=np.float64)
        return self._step_times(n, sums, ())

    # --- reports ----------------------------------------------------------------------------------
    def kernel_limits(self) -> list[str]:
        """What the kernels refused while the model was priced, one line each: where an estimate is
        bounded by our kernels rather than by the chip (so far: the routed-expert kernel refusing
        a batch, which then runs as pieces that each read their experts' weights again)."""
        if self.load is None or not self._moe_refused:
            return []
        smallest = min(self._moe_refused)
        fits = [t for t in self._moe_pieces if t < smallest]
        pieces = f"pieces of at most {max(fits):,} tokens" if fits else "smaller pieces"
        return [f"moe: the routed-expert kernel refused {smallest:,} received tokens per launch on "
                f"{self.spec.name} (its scratchpad); larger batches ran as {pieces}, each reading its "
                "experts' weights again: those steps are bounded by our kernel, not by the chip"]

    @property
    def grid_points(self) -> int:
        """Grid points timed so far (over all parts)."""
        n = sum(len(t.values) for t in self._tok.values()) + len(self._head.values) + len(self._tail.values)
        n += sum(len(t.values) for t in self._dec.values()) + sum(len(t.values) for t in self._pre.values())
        if self.load is not None:
            n += len(self._moe_pieces) + len(self._a2a.values)
        return n

    def describe(self) -> dict[str, Any]:
        """JSON form of what the model is: model, preset, mapping, routing, memory, grid units."""
        return {
            "model": self.cfg.name,
            "preset": self.spec.name,
            "mapping": self.mapping.as_dict(),
            "routing": self.routing.name,
            "chips": self.chips,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "max_batch_tokens": self.max_batch_tokens,
            "memory": self.memory.as_dict(),
            "decode_batch_unit": self.b_unit,
            "fusion": self.fusion,
            "fusion_fallbacks": self.fusion_fallbacks,
            "prefill_chunk_unit": self.n_unit,
        }
