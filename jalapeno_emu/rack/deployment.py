"""Serving predictions of a model on a rack: one point, a sweep, and the demo's quick estimate.

Stage: rack, the entry points the CLI (``serve``, ``sweep``, ``compare``) and other tools (the
InferenceX calibration) call. A point is the serving simulator (:func:`jalapeno_emu.serving.simulate`)
driven by a :class:`~jalapeno_emu.rack.step_model.RackStepModel`; without a mapping, the best one
for the objective is searched (:func:`jalapeno_emu.rack.search.best_mapping`). Sweeps and
comparisons run their independent tasks on any ``concurrent.futures.Executor``
(:mod:`jalapeno_emu.parallel`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from jalapeno_emu.chip import ChipSpec, load_preset
from jalapeno_emu.chip._units import short_repr
from jalapeno_emu.errors import EmuError, InvalidArgumentError
from jalapeno_emu.model.config import ModelConfig, load_model_config
from jalapeno_emu.parallel import ordered_map
from jalapeno_emu.rack.mapping import FitError, Mapping, check_mapping, fits, parse_mapping
from jalapeno_emu.rack.routing import UNIFORM, Routing, parse_routing
from jalapeno_emu.rack.search import (
    OBJECTIVES,
    best_mapping,
    candidate_mappings,
    screen,
    shortlist,
    step_model,
)
from jalapeno_emu.rack.step_model import DEFAULT_BATCH_TOKENS, RackStepModel
from jalapeno_emu.serving.limits import (
    MAX_BATCH_TOKENS,
    MAX_REQUESTS,
    MAX_SEQUENCE_TOKENS,
    distinct_concurrencies,
)
from jalapeno_emu.serving.metrics import ServingMetrics
from jalapeno_emu.serving.simulate import simulate
from jalapeno_emu.serving.speculative import Speculation
from jalapeno_emu.serving.sweep import SweepPoint

__all__ = [
    "Prediction",
    "check_workload",
    "compare_frontiers",
    "compare_presets",
    "predict",
    "rack_estimate",
    "sweep_mappings",
]


@dataclass(frozen=True)
class Prediction:
    """One predicted serving point.

    Attributes:
        model, preset: what was served, on what.
        isl, osl, concurrency: the workload.
        objective: what the mapping was chosen for (None when it was given).
        routing: the MoE routing distribution.
        mapping: the mapping served with.
        metrics: the simulated InferenceX metrics.
        step_model: the step model (its grid holds the timed points).
        finalists: (mapping, metrics) of every simulated candidate when searched, best first.
        screened: candidates ranked by the analytic screen (0 when the mapping was given).
    """

    model: str
    preset: str
    isl: int
    osl: int
    concurrency: int
    objective: str | None
    routing: Routing
    mapping: Mapping
    metrics: ServingMetrics
    step_model: RackStepModel
    finalists: tuple[tuple[Mapping, ServingMetrics], ...] = ()
    screened: int = 0
    speculation: Speculation | None = None

    def as_dict(self) -> dict[str, Any]:
        """Flat JSON fields: the serving metrics (``interactivity_tok_s_user``, ``ttft_s``,
        ``tpot_s``, ``e2e_s`` medians, ``throughput_tok_s_per_chip``, ``tok_s_per_kw`` {package,
        sustained, all_in}, ``mapping``, ``chips``, ...) plus model, preset, objective, routing,
        ``mapping_detail`` (tp, ep, dp, pp), ``kv_capacity_tokens``, ``fusion`` (how the chips'
        launches join into programs), ``stack`` (the serving stack whose host costs the simulator
        charged), ``kernel_limits`` (where a kernel's refusal bounds the estimate, one line
        each), ``mtp`` (speculative decoding: draft tokens, acceptance,
        expected tokens per step; None without) and the finalists."""
        out = self.metrics.as_dict()
        out.update(
            model=self.model,
            preset=self.preset,
            objective=self.objective,
            routing=self.routing.name,
            mapping=self.mapping.name,
            mapping_detail=self.mapping.as_dict(),
            chips=self.mapping.chips,
            kv_capacity_tokens=self.step_model.kv_capacity_tokens,
            max_batch_tokens=self.step_model.max_batch_tokens,
            fusion=self.step_model.fusion,
            stack=self.step_model.stack.name,
            kernel_limits=self.step_model.kernel_limits(),
            mtp=None if self.speculation is None else self.speculation.as_dict(),
            screened=self.screened,
            finalists=[
                {
                    "mapping": m.name,
                    "chips": m.chips,
                    "interactivity_tok_s_user": x.as_dict()["interactivity_tok_s_user"],
                    "throughput_tok_s_per_chip": x.as_dict()["throughput_tok_s_per_chip"],
                }
                for m, x in self.finalists
            ],
        )
        return out


def _objects(
    cfg: ModelConfig | str, preset: ChipSpec | str, routing: Routing | str
) -> tuple[ModelConfig, ChipSpec, Routing]:
    return (
        load_model_config(cfg) if isinstance(cfg, str) else cfg,
        load_preset(preset) if isinstance(preset, str) else preset,
        parse_routing(routing) if isinstance(routing, str) else routing,
    )


def check_workload(cfg: ModelConfig, isl: int, osl: int, concurrencies: Sequence[int], *,
                    requests: int | None = None,
                    max_batch_tokens: int = DEFAULT_BATCH_TOKENS) -> tuple[int, ...]:
    """Check the serving arguments at entry, before any mapping is searched or kernel built, each
    against its limit (:mod:`jalapeno_emu.serving.limits`) and ISL + OSL against the model's
    ``max_position_embeddings``; returns the distinct concurrencies in the order given. Every
    entry point here calls it; a caller may call it first to refuse before saying anything.

    Raises:
        InvalidArgumentError: naming the argument, the limit and why.
    """
    for key, v in (("isl", isl), ("osl", osl), *(("concurrency", c) for c in concurrencies)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidArgumentError(f"{key}={short_repr(v)} must be an integer >= 1")
    if isl + osl > cfg.max_position_embeddings:
        # A longer request has no position to run at, and its attention kernels would be built
        # at contexts the model never reaches.
        raise InvalidArgumentError(
            f"isl {isl:,} + osl {osl:,} = {isl + osl:,} tokens is above {cfg.name}'s "
            f"max_position_embeddings of {cfg.max_position_embeddings:,} (the longest sequence the "
            "model has positions for)")
    if isl + osl > MAX_SEQUENCE_TOKENS.maximum:
        raise InvalidArgumentError(
            f"isl {isl:,} + osl {osl:,} = {isl + osl:,} tokens is above the limit of "
            f"{MAX_SEQUENCE_TOKENS.maximum:,} ({MAX_SEQUENCE_TOKENS.why})")
    distinct = distinct_concurrencies(concurrencies, "concurrencies")
    if requests is not None:
        MAX_REQUESTS.check("requests", requests)
    MAX_BATCH_TOKENS.check("max_batch_tokens", max_batch_tokens)
    return distinct


def predict(
    cfg: ModelConfig | str,
    preset: ChipSpec | str,
    isl: int,
    osl: int,
    concurrency: int,
    mapping: Mapping | str | None = None,
    objective: str = "interactivity",
    *,
    routing: Routing | str = UNIFORM,
    chips: int | None = None,
    finalists: int = 2,
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
    requests: int | None = None,
    seed: int = 0,
    disk_cache: bool = False,
    speculation: Speculation | None = None,
) -> Prediction:
    """Serve ``cfg`` on chips of ``preset`` at one ISL/OSL/concurrency point.

    Args:
        cfg: a ModelConfig or a model name.
        preset: a ChipSpec or a preset name.
        isl, osl: nominal input and output lengths (drawn from [0.8 L, L] as InferenceX does);
            isl + osl at most the model's ``max_position_embeddings``.
        concurrency: requests in flight.
        mapping: the mapping to serve with (a Mapping or ``"tp=8,ep=8"``); None searches the best
            one for ``objective`` (analytic screen, then ``finalists`` simulated).
        objective: ``interactivity`` or ``throughput`` (per chip).
        routing: MoE routing distribution (``uniform``, ``zipf:1.2``).
        chips: search only deployments of this many chips.
        max_batch_tokens: per DP group token budget of one step.
        requests, seed: the simulator's measured requests and length seed.
        disk_cache: keep kernel timings on disk across processes.
        speculation: speculative decoding (MTP, :func:`jalapeno_emu.serving.speculative.speculation`);
            None: single-token prediction.

    Raises:
        InvalidArgumentError: bad arguments, one beyond its limit (:mod:`jalapeno_emu.serving.limits`:
            requests, concurrency, max_batch_tokens, isl + osl; each refusal names the argument
            and the limit) or a mapping the model/domain cannot take;
        FitError: the model does not fit (with the numbers).
    """
    cfg, spec, routing = _objects(cfg, preset, routing)
    check_workload(cfg, isl, osl, [concurrency], requests=requests, max_batch_tokens=max_batch_tokens)
    if objective not in OBJECTIVES:
        raise InvalidArgumentError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    if mapping is None:
        choice = best_mapping(
            cfg,
            spec,
            isl=isl,
            osl=osl,
            concurrency=concurrency,
            objective=objective,
            routing=routing,
            chips=chips,
            finalists=finalists,
            max_batch_tokens=max_batch_tokens,
            disk_cache=disk_cache,
            requests=requests,
            seed=seed,
            speculation=speculation,
        )
        return Prediction(
            cfg.name,
            spec.name,
            isl,
            osl,
            concurrency,
            objective,
            routing,
            choice.mapping,
            choice.metrics,
            choice.model,
            choice.finalists,
            choice.screened,
            speculation,
        )
    mapping = parse_mapping(mapping) if isinstance(mapping, str) else mapping
    if chips is not None and chips != mapping.chips:
        raise InvalidArgumentError(
            f"--chips {chips} disagrees with mapping {mapping.name} ({mapping.chips} chips)"
        )
    model = step_model(
        cfg,
        spec,
        mapping,
        routing=routing,
        max_batch_tokens=max_batch_tokens,
        sequence_tokens=isl + osl,
        disk_cache=disk_cache,
    )
    metrics = simulate(model, isl=isl, osl=osl, concurrency=concurrency, requests=requests, seed=seed,
                       power_w=model.power_w, speculation=speculation, stack=model.stack)
    return Prediction(cfg.name, spec.name, isl, osl, concurrency, None, routing, mapping, metrics, model,
                      speculation=speculation)


def sweep_mappings(
    cfg: ModelConfig | str,
    preset: ChipSpec | str,
    isl: int,
    osl: int,
    concurrencies: Sequence[int],
    *,
    routing: Routing | str = UNIFORM,
    finalists: int = 2,
    chips: int | None = None,
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
    disk_cache: bool = False,
    on_plan: Callable[[int], None] | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
    executor: Executor | None = None,
    mapping: Mapping | str | None = None,
    speculation: Speculation | None = None,
) -> tuple[list[SweepPoint], int]:
    """Every concurrency, with the mappings worth simulating there (or one mapping held).

    All candidate mappings are screened at every concurrency; for each concurrency the
    ``finalists`` best by interactivity and the ``finalists`` best by throughput per chip are
    simulated (the union). Points are grouped by mapping so each step model's grid is filled once:
    one task per mapping (building its step model's kernel timings dominates), its concurrencies
    simulated within the task.

    Args:
        concurrencies: one given twice is simulated once (at most
            :data:`~jalapeno_emu.serving.limits.MAX_CONCURRENCIES` distinct values).
        mapping: serve every concurrency with this mapping (a Mapping or ``"tp=8,ep=8"``): nothing
            is screened or searched, and the points are that one deployment's curve (what a
            fixed production configuration does as load grows).
        speculation: speculative decoding (MTP) at every point; None: single-token prediction.
        on_plan: called once with the number of points to simulate (for a progress bar).
        on_point: called after each simulated point (serial), or for each point of a mapping as
            its task completes (with an executor); always in the calling thread.
        executor: where the mappings' tasks run (:mod:`jalapeno_emu.parallel`); None: one after
            the other in this process. The points are the same either way.

    Returns:
        (points, candidates screened: 0 with ``mapping``); each point's ``series`` is the preset.

    Raises:
        InvalidArgumentError: bad arguments (as :func:`predict`), a ``mapping`` that disagrees with
            ``chips`` or that the model or the chip's domain cannot take.
        FitError: a given ``mapping`` does not fit the model (with the numbers).
    """
    cfg, spec, routing = _objects(cfg, preset, routing)
    concurrencies = check_workload(cfg, isl, osl, concurrencies, max_batch_tokens=max_batch_tokens)
    tasks: dict[Mapping, list[int]] = {}
    if mapping is not None:
        held = _held_mapping(cfg, spec, mapping, chips, isl + osl)
        tasks[held] = list(concurrencies)
        cands: list[Mapping] = []
    else:
        cands = candidate_mappings(cfg, spec, chips=chips, kv_tokens=isl + osl, sequence_tokens=isl + osl)
        scored = screen(cfg, spec, cands, isl=isl, osl=osl, concurrencies=list(concurrencies),
                        routing=routing)
        for c in concurrencies:
            here = [p for p in scored if p.concurrency == c]
            for objective in OBJECTIVES:
                for p in shortlist(here, objective, finalists):
                    if c not in tasks.setdefault(p.mapping, []):
                        tasks[p.mapping].append(c)
    if on_plan is not None:
        on_plan(sum(len(v) for v in tasks.values()))
    # In this process the task reports each point as it is simulated; a task elsewhere cannot
    # call back, so its points are reported here as it completes.
    live = on_point if executor is None else None
    args = [(cfg, spec, mapping, tuple(sorted(concs)), isl, osl, routing, max_batch_tokens, disk_cache, live,
             speculation) for mapping, concs in tasks.items()]

    def done(_i: int, pts: list[SweepPoint]) -> None:
        if on_point is not None and live is None:
            for point in pts:
                on_point(point)

    points = [p for pts in ordered_map(_mapping_points, args, executor=executor, on_result=done) for p in pts]
    points.sort(key=lambda p: (p.concurrency, p.mapping))
    return points, len(cands)


def _held_mapping(cfg: ModelConfig, spec: ChipSpec, mapping: Mapping | str, chips: int | None,
                  sequence_tokens: int) -> Mapping:
    """``mapping`` parsed and checked before any task starts (a task elsewhere would report it
    late): its chip count against ``chips``, then what the step model checks (the model's shape
    and the chip's domain; the weights fit with room for KV cache)."""
    held = parse_mapping(mapping) if isinstance(mapping, str) else mapping
    if chips is not None and chips != held.chips:
        raise InvalidArgumentError(f"--chips {chips} disagrees with mapping {held.name} ({held.chips} chips)")
    check_mapping(cfg, held, spec)
    if fits(cfg, spec, held, 0, sequence_tokens=sequence_tokens).kv_capacity_tokens < 1:
        raise FitError(f"{cfg.name} on {spec.name} with {held.name}: the weights leave no HBM for the KV "
                       "cache", hint="use more chips")
    return held


def _mapping_points(
    cfg: ModelConfig,
    spec: ChipSpec,
    mapping: Mapping,
    concurrencies: tuple[int, ...],
    isl: int,
    osl: int,
    routing: Routing,
    max_batch_tokens: int,
    disk_cache: bool,
    on_point: Callable[[SweepPoint], None] | None,
    speculation: Speculation | None = None,
) -> list[SweepPoint]:
    """One task of :func:`sweep_mappings`: the mapping's step model, simulated at each concurrency."""
    model = step_model(
        cfg,
        spec,
        mapping,
        routing=routing,
        max_batch_tokens=max_batch_tokens,
        sequence_tokens=isl + osl,
        disk_cache=disk_cache,
    )
    points = []
    for c in concurrencies:
        metrics = simulate(model, isl=isl, osl=osl, concurrency=c, power_w=model.power_w,
                           speculation=speculation, stack=model.stack)
        points.append(SweepPoint(mapping.name, spec.name, c, metrics, tuple(model.kernel_limits())))
        if on_point is not None:
            on_point(points[-1])
    return points


def _overridden(preset: ChipSpec | str, spec_overrides: dict[str, Any] | None) -> ChipSpec:
    """``preset`` loaded (a ChipSpec as it is) with ``spec_overrides`` set on it."""
    spec = load_preset(preset) if isinstance(preset, str) else preset
    return spec.replace(**spec_overrides) if spec_overrides else spec


def compare_presets(
    cfg: ModelConfig | str,
    presets: Sequence[ChipSpec | str],
    isl: int,
    osl: int,
    concurrencies: Sequence[int],
    *,
    objective: str = "interactivity",
    routing: Routing | str = UNIFORM,
    finalists: int = 2,
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
    disk_cache: bool = False,
    spec_overrides: dict[str, Any] | None = None,
    executor: Executor | None = None,
    on_preset: Callable[[str, str | None], None] | None = None,
    speculation: Speculation | None = None,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """``cfg`` on each preset at each concurrency (:func:`predict`, the mapping searched for
    ``objective``): the ``compare`` command's predictions, one task per preset.

    A preset that cannot be modelled (any ``EmuError``: a kernel refusing its scratchpad, a model
    that does not fit, a preset that does not load) is reported with its one-line message, not
    raised, and its other concurrencies are not predicted.

    Args:
        cfg: a ModelConfig or a model name.
        presets: ChipSpecs or preset names (or TOML paths); loaded here, so a cluster's workers
            need not see the files.
        spec_overrides: dotted field -> value set on every preset (:meth:`ChipSpec.replace`), e.g.
            ``{"software.fusion": "layer"}``.
        executor: where the presets' tasks run (:mod:`jalapeno_emu.parallel`); None: one after the
            other in this process. The results are the same either way.
        on_preset: called in the calling thread with (preset, error or None) as each preset's
            predictions complete.
        objective, routing, finalists, max_batch_tokens, disk_cache, isl, osl, speculation: as
            :func:`predict`.

    Returns:
        (results, errors): preset -> one :meth:`Prediction.as_dict` per distinct concurrency
        (duplicates dropped, first-seen order), for the presets that could be modelled; preset ->
        message for the others; both in the order of ``presets``, keyed by the name given (a
        ChipSpec by its ``name``).
    """
    # Duplicates dropped here, before any preset is loaded: a concurrency given twice is one point.
    concurrencies = distinct_concurrencies(concurrencies, "concurrencies")
    keys = [p if isinstance(p, str) else p.name for p in presets]
    outcome: dict[int, tuple[list[dict[str, Any]], str | None]] = {}
    slots: list[int] = []  # the preset of each task
    args = []
    model: ModelConfig | None = None
    for i, preset in enumerate(presets):
        # The order of the checks is predict's: the preset, then the model (then, in the task,
        # the routing and the workload), so each preset reports the error a serial predict would.
        try:
            spec = _overridden(preset, spec_overrides)
            model = model or (load_model_config(cfg) if isinstance(cfg, str) else cfg)
        except EmuError as exc:
            outcome[i] = ([], str(exc))
            if on_preset is not None:
                on_preset(keys[i], str(exc))
            continue
        kwargs = dict(objective=objective, routing=routing, finalists=finalists,
                      max_batch_tokens=max_batch_tokens, disk_cache=disk_cache, speculation=speculation)
        slots.append(i)
        args.append((model, spec, isl, osl, tuple(concurrencies), kwargs))

    def done(j: int, result: tuple[list[dict[str, Any]], str | None]) -> None:
        if on_preset is not None:
            on_preset(keys[slots[j]], result[1])

    ran = ordered_map(_preset_predictions, args, executor=executor, on_result=done)
    outcome.update(zip(slots, ran, strict=True))
    results: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    for i, key in enumerate(keys):
        points, error = outcome[i]
        if error is None:
            results[key] = points
        else:
            results.pop(key, None)
            errors[key] = error
    return results, errors


def compare_frontiers(
    cfg: ModelConfig | str,
    presets: Sequence[ChipSpec | str],
    isl: int,
    osl: int,
    concurrencies: Sequence[int],
    *,
    routing: Routing | str = UNIFORM,
    finalists: int = 2,
    chips: int | None = None,
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
    disk_cache: bool = False,
    spec_overrides: dict[str, Any] | None = None,
    executor: Executor | None = None,
    on_plan: Callable[[str, int], None] | None = None,
    on_point: Callable[[str, SweepPoint], None] | None = None,
    on_preset: Callable[[str, str | None], None] | None = None,
    speculation: Speculation | None = None,
) -> tuple[dict[str, list[SweepPoint]], dict[str, str]]:
    """Each preset's sweep (:func:`sweep_mappings`: every concurrency with the mappings worth
    simulating there): the points its frontier, its best throughput at a given interactivity and
    its peak are read from (:mod:`jalapeno_emu.serving.quotes`). Presets run one after the other,
    each sweep's mapping tasks on ``executor``.

    A preset that cannot be modelled (any ``EmuError``) is reported with its one-line message, as
    in :func:`compare_presets`.

    Args:
        on_plan, on_point: :func:`sweep_mappings`' callbacks, with the preset's name first.
        on_preset: called with (preset, error or None) as each preset's sweep completes.
        The rest: as :func:`sweep_mappings` and :func:`compare_presets`.

    Returns:
        (results, errors): preset -> its points, and preset -> message, both in the order of
        ``presets`` and keyed by the name given (a ChipSpec by its ``name``).
    """
    concurrencies = distinct_concurrencies(concurrencies, "concurrencies")
    results: dict[str, list[SweepPoint]] = {}
    errors: dict[str, str] = {}
    model: ModelConfig | None = None
    for preset in presets:
        key = preset if isinstance(preset, str) else preset.name
        try:
            spec = _overridden(preset, spec_overrides)
            model = model or (load_model_config(cfg) if isinstance(cfg, str) else cfg)
            points, _ = sweep_mappings(
                model, spec, isl, osl, concurrencies, routing=routing, finalists=finalists, chips=chips,
                max_batch_tokens=max_batch_tokens, disk_cache=disk_cache, executor=executor,
                speculation=speculation,
                on_plan=None if on_plan is None else (lambda n, key=key: on_plan(key, n)),
                on_point=None if on_point is None else (lambda pt, key=key: on_point(key, pt)))
        except EmuError as exc:
            results.pop(key, None)
            errors[key] = str(exc)
        else:
            errors.pop(key, None)
            results[key] = points
        if on_preset is not None:
            on_preset(key, errors.get(key))
    return results, errors


def _preset_predictions(
    cfg: ModelConfig,
    spec: ChipSpec,
    isl: int,
    osl: int,
    concurrencies: tuple[int, ...],
    kwargs: dict[str, Any],
) -> tuple[list[dict[str, Any]], str | None]:
    """One task of :func:`compare_presets`: (one prediction per concurrency, None), or ([], the
    message) at the first concurrency that raises an ``EmuError``."""
    try:
        return [predict(cfg, spec, isl, osl, c, **kwargs).as_dict() for c in concurrencies], None
    except EmuError as exc:
        return [], str(exc)


def rack_estimate(
    model: ModelConfig | str,
    preset: ChipSpec | str,
    isl: int,
    osl: int,
    concurrencies: Sequence[int],
    *,
    objective: str = "interactivity",
    routing: Routing | str = UNIFORM,
    disk_cache: bool = True,
) -> list[dict[str, Any]]:
    """The serve metrics of ``model`` on ``preset`` at each concurrency, quickly: the mapping is
    the analytic screen's best for ``objective`` (one finalist, simulated), and kernel timings are
    kept on disk across runs by default. Each entry is :meth:`Prediction.as_dict` (the ``serve
    --json`` fields), one per distinct concurrency in the order given.
    """
    cfg = load_model_config(model) if isinstance(model, str) else model
    concurrencies = check_workload(cfg, isl, osl, list(concurrencies))
    return [
        predict(
            cfg,
            preset,
            isl,
            osl,
            c,
            objective=objective,
            routing=routing,
            finalists=1,
            disk_cache=disk_cache,
        ).as_dict()
        for c in concurrencies
    ]
