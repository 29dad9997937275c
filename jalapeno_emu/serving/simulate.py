"""Closed-loop, continuously batched serving of one deployment: the InferenceX semantics.

Stage: serving. :func:`simulate` drives a :class:`~jalapeno_emu.serving.step_model.StepTimeModel`
one engine step at a time and returns :class:`~jalapeno_emu.serving.metrics.ServingMetrics`.

The semantics, in order of a request's life:

- **Workload.** Closed loop at fixed ``concurrency``: ``concurrency`` requests arrive at t = 0 and a
  request that completes is replaced at once (same instant) by a new one (requests completing in
  the same step are replaced in their arrival order). Input and output lengths
  are integers drawn uniformly from [ceil(ratio L), L] (ratio 0.8), independently per request, from
  ``numpy.random.default_rng(seed)``; output always runs to its full length (no EOS).
- **Admission (KV reservation).** A request is admitted, oldest first and never out of order, when it
  is first given prefill tokens and only if its whole isl + osl fits in the KV capacity left
  (``kv_capacity_tokens`` minus what admitted requests reserved); otherwise it and every request
  behind it wait, the time counting in TTFT and E2E. Reservations are released at completion.
  Nothing ever overflows; a workload whose longest request (isl + osl) exceeds the capacity raises.
- **A step.** Every sequence whose prompt is done decodes one token; the rest of the step's token
  budget (``max_batch_tokens``) goes to chunked prefill of pending prompts, oldest first, each chunk
  the budget left bounded by the prompt left. Prefill and decode share the step (no
  disaggregation). The step that finishes a prompt produces its first output token: TTFT = that
  step's end minus the arrival. A decode step's context for a sequence is its prompt plus the
  tokens generated before the step (the KV cache after the step, the new token included).
- **Warm-up and measurement.** The first wave arrives synchronised at t = 0. Warm-up ends at the end
  of the step in which ``warmup_requests`` (default: ``concurrency``) requests have completed; the
  measured requests are the next ``requests`` to arrive (default max(64, 2 x concurrency), capped at
  2048), all arriving at or after that instant. New requests keep arriving until the last measured
  one completes, so the batch stays at full concurrency through the window.
  Latencies are over the measured requests. Throughput counts every token processed by the steps
  of the window (warm-up end to last measured completion), input tokens when prefilled and output
  tokens when generated, each once: counting only the measured requests' tokens would leave out
  the requests in flight at both ends of the window and understate a steady state by up to
  concurrency / (requests + concurrency).
- **Speed.** Per-sequence state lives in numpy arrays. When no prefill can be scheduled (no prompt
  pending, or the oldest one blocked by KV capacity), the steps until the next completion are
  decode-only and known exactly; they are taken as one stretch, priced by the model's optional
  ``decode_stretch_times_s`` or step by step, with the clock summed in the same order as single
  steps (identical results either way).
- **Speculative decoding (MTP).** With a :class:`~jalapeno_emu.serving.speculative.Speculation`
  of K draft tokens, every decoding sequence runs K + 1 query tokens through each step (the step
  model prices the drafting and the verification, ``StepWork.decode_query_tokens``) and takes
  ``decode_query_tokens`` of the step's token budget; its accepted drafts ``a`` (0..K) are drawn
  per sequence and step from ``numpy.random.default_rng([seed, 1])`` (a stream of its own, so the
  lengths drawn do not change with MTP), and it emits 1 + a tokens, never beyond its output length.
  Its context in the step is its KV cache after the verification (prompt, earlier tokens and the
  K + 1 verified). A stretch of decode-only steps is then taken step by step (how far each
  sequence gets is drawn). The K rejected-draft entries a step writes past a sequence's tokens are
  not reserved (at most K per sequence).
- **The serving stack** (``stack``, :mod:`jalapeno_emu.serving.stack`): a request can be scheduled
  ``request_in_s(isl)`` after it arrives (HTTP, tokenizing); a step's time is the stack's
  ``step_s`` of the model's device time (host work per step, hidden behind the device as far as
  the stack overlaps them); a token reaches the client ``response_s`` after its step, which TTFT
  and E2E include and after which a closed-loop client sends its next request. When nothing can
  run until the oldest request is ready, the clock moves to that instant. Without a stack,
  everything host-side is free (the device's steps alone).
- **Not modelled.** Preemption, EOS, prefix caching.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.serving.limits import MAX_CONCURRENCY, MAX_REQUESTS, MAX_SEQUENCE_TOKENS
from jalapeno_emu.serving.metrics import RequestTimes, ServingMetrics, WindowCounters, check_power, summarise
from jalapeno_emu.serving.speculative import Speculation
from jalapeno_emu.serving.stack import StackProfile
from jalapeno_emu.serving.step_model import StepTimeModel, StepWork, SupportsDecodeStretch

__all__ = ["DEFAULT_RANGE_RATIO", "MAX_DEFAULT_REQUESTS", "default_requests", "length_bounds", "simulate"]

DEFAULT_RANGE_RATIO = 0.8
"""InferenceX draws lengths uniformly from [0.8 L, L]."""
MAX_DEFAULT_REQUESTS = 2048
"""Cap of the default number of measured requests (keeps a 1..1024 sweep fast; p99 of 2048 is stable)."""
_LENGTH_BLOCK = 1024


def default_requests(concurrency: int) -> int:
    """Measured requests by default: max(64, 2 x concurrency), at most :data:`MAX_DEFAULT_REQUESTS`."""
    return min(max(64, 2 * concurrency), MAX_DEFAULT_REQUESTS)


def length_bounds(length: int, ratio: float) -> tuple[int, int]:
    """Inclusive integer bounds [ceil(ratio x length), length] of a drawn length (at least 1)."""
    return max(1, math.ceil(round(ratio * length, 9))), length


class _Lengths:
    """Input and output lengths per request, drawn in fixed blocks so a seed fixes the sequence."""

    def __init__(self, isl: int, osl: int, ratio: float, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._isl = length_bounds(isl, ratio)
        self._osl = length_bounds(osl, ratio)
        self._block: tuple[list[int], list[int]] = ([], [])
        self._next = 0

    def draw(self) -> tuple[int, int]:
        if self._next == len(self._block[0]):
            lo, hi = self._isl
            isl = self._rng.integers(lo, hi + 1, size=_LENGTH_BLOCK).tolist()
            lo, hi = self._osl
            osl = self._rng.integers(lo, hi + 1, size=_LENGTH_BLOCK).tolist()
            self._block, self._next = (isl, osl), 0
        i = self._next
        self._next += 1
        return self._block[0][i], self._block[1][i]


@dataclass
class _Counters:
    """Cumulative step counters; the window's are the difference of two snapshots."""

    t_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    decode_sequence_steps: int = 0
    kv_bound_steps: int = 0
    decode_tokens: int = 0  # output tokens the decode sequence-steps emitted

    def snapshot(self) -> _Counters:
        return _Counters(self.t_s, self.steps, self.tokens, self.decode_sequence_steps, self.kv_bound_steps,
                         self.decode_tokens)


@dataclass
class _Completed:
    """Completed requests, appended a step's batch at a time."""

    ids: list[np.ndarray] = field(default_factory=list)
    arrival_s: list[np.ndarray] = field(default_factory=list)
    first_token_s: list[np.ndarray] = field(default_factory=list)
    end_s: list[np.ndarray] = field(default_factory=list)
    isl: list[np.ndarray] = field(default_factory=list)
    osl: list[np.ndarray] = field(default_factory=list)

    def select(self, first_id: int, count: int) -> RequestTimes:
        ids = np.concatenate(self.ids)
        keep = (ids >= first_id) & (ids < first_id + count)
        order = np.argsort(ids[keep], kind="stable")

        def pick(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts)[keep][order]

        return RequestTimes(pick(self.arrival_s), pick(self.first_token_s), pick(self.end_s),
                            pick(self.isl), pick(self.osl))


class _Engine:
    """The batching state machine: one slot per concurrent request, state in int64/float64 arrays."""

    def __init__(self, model: StepTimeModel, concurrency: int, lengths: _Lengths,
                 speculation: Speculation | None = None, seed: int = 0,
                 stack: StackProfile | None = None) -> None:
        self.model = model
        self.lengths = lengths
        self.budget_tokens = int(model.max_batch_tokens)
        self.capacity_tokens = int(model.kv_capacity_tokens)
        self.stretch = isinstance(model, SupportsDecodeStretch)
        self.speculation = speculation
        self.query_tokens = 1 if speculation is None else speculation.query_tokens
        self.accept_rng = np.random.default_rng([seed, 1]) if speculation is not None else None
        self.stack = stack
        self.response_s = 0.0 if stack is None else stack.response_s
        self.ready_s = np.zeros(concurrency, np.float64)  # when a request can first be scheduled
        n = concurrency
        self.req_id = np.zeros(n, np.int64)
        self.arrival_s = np.zeros(n, np.float64)
        self.first_token_s = np.zeros(n, np.float64)
        self.isl = np.zeros(n, np.int64)
        self.osl = np.zeros(n, np.int64)
        self.prefilled = np.zeros(n, np.int64)
        self.generated = np.zeros(n, np.int64)
        self.admitted = np.zeros(n, bool)
        self.reserved_tokens = 0
        self.pending: deque[int] = deque()  # slots with prompt left, in arrival order
        self.next_id = 0
        self.counters = _Counters()
        self.completed = _Completed()
        self.completed_count = 0
        for slot in range(n):
            self._issue(slot, 0.0)

    def _issue(self, slot: int, t_s: float) -> None:
        isl, osl = self.lengths.draw()
        self.req_id[slot] = self.next_id
        self.next_id += 1
        self.arrival_s[slot] = t_s
        self.ready_s[slot] = t_s if self.stack is None else t_s + self.stack.request_in_s(isl)
        self.isl[slot] = isl
        self.osl[slot] = osl
        self.prefilled[slot] = 0
        self.generated[slot] = 0
        self.admitted[slot] = False
        self.pending.append(slot)

    def _head_blocked(self) -> bool:
        """Whether the oldest pending prompt waits for admission and its reservation does not fit."""
        if not self.pending:
            return False
        head = self.pending[0]
        need = int(self.isl[head] + self.osl[head])
        return not self.admitted[head] and self.reserved_tokens + need > self.capacity_tokens

    def step(self) -> int:
        """Advance one step, or one exact stretch of decode-only steps; returns the first request id
        issued at its end (the next id when none completed)."""
        decoding = np.flatnonzero(self.prefilled == self.isl)
        if not decoding.size and self.pending and self.ready_s[self.pending[0]] > self.counters.t_s:
            # nothing to run until the oldest request has been received and tokenized
            self.counters.t_s = float(self.ready_s[self.pending[0]])
        blocked = self._head_blocked()
        if (not self.pending or blocked) and decoding.size and self.speculation is None:
            self._decode_stretch(decoding, blocked)
        else:
            self._mixed_step(decoding)
        return self._complete()

    def _mixed_step(self, decoding: np.ndarray) -> None:
        q = self.query_tokens
        chunks, kv_bound = self._plan_prefill(self.budget_tokens - decoding.size * q)
        contexts = self.isl[decoding] + self.generated[decoding] + (q - 1)
        work = StepWork(tuple(contexts.tolist()), tuple((new, done) for _, new, done in chunks), q)
        if work.batch_tokens == 0:
            raise RuntimeError("serving simulator: a step with no work (internal error)")
        dt = _checked_time(self.model, self.model.step_time_s(work), work)
        if self.stack is not None:
            dt = self.stack.step_s(dt, decoding.size + len(chunks))
        c = self.counters
        c.t_s += dt
        if self.speculation is None:
            emitted = decoding.size
            self.generated[decoding] += 1
        else:
            assert self.accept_rng is not None
            accepted = self.speculation.draw(self.accept_rng, decoding.size)
            gained = np.minimum(1 + accepted, self.osl[decoding] - self.generated[decoding])
            emitted = int(gained.sum())
            self.generated[decoding] += gained
        firsts = self._advance_prefill(chunks, c.t_s)
        c.steps += 1
        c.tokens += work.prefill_tokens + emitted + firsts
        c.decode_sequence_steps += decoding.size
        c.decode_tokens += emitted
        c.kv_bound_steps += kv_bound

    def _plan_prefill(self, budget_tokens: int) -> tuple[list[tuple[int, int, int]], bool]:
        """(slot, new tokens, cached tokens) chunks, oldest prompt first, admitting as it goes;
        and whether admission stopped on KV capacity."""
        chunks: list[tuple[int, int, int]] = []
        now = self.counters.t_s
        for slot in self.pending:
            if budget_tokens == 0 or self.ready_s[slot] > now:  # oldest first: a later one waits too
                break
            if not self.admitted[slot]:
                need = int(self.isl[slot] + self.osl[slot])
                if self.reserved_tokens + need > self.capacity_tokens:
                    return chunks, True
                self.admitted[slot] = True
                self.reserved_tokens += need
            done = int(self.prefilled[slot])
            new = min(budget_tokens, int(self.isl[slot]) - done)
            chunks.append((slot, new, done))
            budget_tokens -= new
        return chunks, False

    def _advance_prefill(self, chunks: list[tuple[int, int, int]], t_s: float) -> int:
        """Apply the chunks; prompts finished this step emit their first token. Returns how many."""
        firsts = 0
        for slot, new, done in chunks:
            self.prefilled[slot] = done + new
            if done + new == self.isl[slot]:
                self.generated[slot] = 1
                self.first_token_s[slot] = t_s + self.response_s  # when the client has it
                firsts += 1
                # chunks go oldest first, so a finished prompt is always the head of the queue
                self.pending.popleft()
        return firsts

    def _decode_stretch(self, decoding: np.ndarray, kv_bound: bool) -> None:
        """Every step until the next completion decodes the same sequences, contexts + 1 per step."""
        steps = int(np.min(self.osl[decoding] - self.generated[decoding]))
        contexts = self.isl[decoding] + self.generated[decoding]
        times = self._stretch_times(contexts, steps)
        c = self.counters
        # a sequential cumulative sum: the same clock as taking the steps one by one
        c.t_s = float(np.cumsum(np.concatenate(([c.t_s], times)))[-1])
        self.generated[decoding] += steps
        c.steps += steps
        c.tokens += steps * decoding.size
        c.decode_sequence_steps += steps * decoding.size
        c.decode_tokens += steps * decoding.size
        c.kv_bound_steps += steps * kv_bound

    def _stretch_times(self, contexts: np.ndarray, steps: int) -> np.ndarray:
        if self.stretch:
            times = np.asarray(self.model.decode_stretch_times_s(contexts, steps), np.float64)
            if times.shape != (steps,) or not np.all(times > 0) or not np.all(np.isfinite(times)):
                raise InvalidArgumentError(
                    f"step model {self.model.name!r}: decode_stretch_times_s(contexts of "
                    f"{contexts.size} sequences, steps={steps}) must return {steps} finite times > 0")
            return times if self.stack is None else self.stack.step_s(times, contexts.size)
        times = np.empty(steps, np.float64)
        for j in range(steps):
            work = StepWork(tuple((contexts + j).tolist()))
            times[j] = _checked_time(self.model, self.model.step_time_s(work), work)
        return times if self.stack is None else self.stack.step_s(times, contexts.size)

    def _complete(self) -> int:
        """Record sequences that produced their last token and replace them at once."""
        first_new_id = self.next_id
        done = np.flatnonzero(self.generated == self.osl)
        if done.size == 0:
            return first_new_id
        done = done[np.argsort(self.req_id[done], kind="stable")]  # replaced oldest first
        t_s = self.counters.t_s + self.response_s  # the client has its last token, and sends the next
        rec = self.completed
        rec.ids.append(self.req_id[done].copy())
        rec.arrival_s.append(self.arrival_s[done].copy())
        rec.first_token_s.append(self.first_token_s[done].copy())
        rec.end_s.append(np.full(done.size, t_s))
        rec.isl.append(self.isl[done].copy())
        rec.osl.append(self.osl[done].copy())
        self.reserved_tokens -= int(np.sum(self.isl[done] + self.osl[done]))
        self.completed_count += done.size
        for slot in done.tolist():
            self._issue(slot, t_s)
        return first_new_id


def _checked_time(model: StepTimeModel, dt: float, work: StepWork) -> float:
    if not (dt > 0 and math.isfinite(dt)):
        raise InvalidArgumentError(
            f"step model {model.name!r} returned step time {dt!r} s for a step with "
            f"{work.decode_count} decodes and {work.prefill_tokens} prefill tokens; "
            "it must be finite and > 0")
    return float(dt)


def _positive_int(key: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise InvalidArgumentError(f"{key} must be an integer >= {minimum}; got {value!r}")
    return int(value)


def _check_sequence(isl: int, osl: int) -> None:
    """Refuse a request longer than :data:`~jalapeno_emu.serving.limits.MAX_SEQUENCE_TOKENS`: its
    prefill alone would be that many chunks of simulated steps."""
    if isl + osl > MAX_SEQUENCE_TOKENS.maximum:
        raise InvalidArgumentError(
            f"isl {isl:,} + osl {osl:,} = {isl + osl:,} tokens is above the limit of "
            f"{MAX_SEQUENCE_TOKENS.maximum:,} tokens per request ({MAX_SEQUENCE_TOKENS.why})")


def _check_model(model: StepTimeModel) -> None:
    if not isinstance(model, StepTimeModel):
        raise InvalidArgumentError(
            f"model {model!r} is not a StepTimeModel: it needs name, chips, kv_capacity_tokens, "
            "max_batch_tokens and step_time_s(work)")
    for key in ("chips", "kv_capacity_tokens", "max_batch_tokens"):
        _positive_int(f"model {model.name!r}: {key}", getattr(model, key))


def _check_workload(model: StepTimeModel, isl: int, osl: int, concurrency: int, ratio: float,
                    mtp_accept_tokens: float, speculation: Speculation | None) -> None:
    if not (isinstance(ratio, int | float) and 0 < ratio <= 1):
        raise InvalidArgumentError(f"range_ratio must be in (0, 1]; got {ratio!r}")
    if mtp_accept_tokens != 0:
        raise InvalidArgumentError(
            f"mtp_accept_tokens={mtp_accept_tokens!r}: give speculative decoding as speculation= "
            "(jalapeno_emu.serving.speculative.speculation(K, acceptance)); 0 means single-token prediction")
    if speculation is not None and not isinstance(speculation, Speculation):
        raise InvalidArgumentError(f"speculation {speculation!r} is not a Speculation (serving.speculative)")
    q = 1 if speculation is None else speculation.query_tokens
    if concurrency * q > model.max_batch_tokens:
        per = f" x {q} tokens per decoding sequence" if q > 1 else ""
        raise InvalidArgumentError(
            f"concurrency {concurrency}{per} exceeds model {model.name!r} max_batch_tokens "
            f"{model.max_batch_tokens}: every decoding sequence needs its tokens of the step budget")
    if isl + osl > model.kv_capacity_tokens:
        raise InvalidArgumentError(
            f"isl {isl} + osl {osl} = {isl + osl} tokens: the longest request can never fit in model "
            f"{model.name!r} KV capacity of {model.kv_capacity_tokens} tokens")


def simulate(model: StepTimeModel, *, isl: int, osl: int, concurrency: int, requests: int | None = None,
             warmup_requests: int | None = None, seed: int = 0, range_ratio: float = DEFAULT_RANGE_RATIO,
             power_w: dict[str, float] | None = None, mtp_accept_tokens: float = 0.0,
             speculation: Speculation | None = None, stack: StackProfile | None = None) -> ServingMetrics:
    """Serve ISL/OSL requests at a fixed concurrency on ``model`` and measure the steady state.

    Args:
        model: the deployment's step-time model (one mapping of one model onto ``model.chips``).
        isl: nominal input length L in tokens; lengths are drawn from [ceil(range_ratio L), L].
        osl: nominal output length in tokens, drawn the same way.
        concurrency: requests in flight (closed loop; at most
            :data:`~jalapeno_emu.serving.limits.MAX_CONCURRENCY`).
        requests: measured requests (default :func:`default_requests`; at most
            :data:`~jalapeno_emu.serving.limits.MAX_REQUESTS`).
        warmup_requests: completions before measurement starts (default ``concurrency``; 0 measures
            from t = 0, the synchronised first wave included; at most ``MAX_REQUESTS``).
        seed: seed of the length draws.
        range_ratio: the lower bound of the draws as a fraction of the nominal length.
        power_w: watts per chip under "package", "sustained" and "all_in" (e.g.
            :func:`~jalapeno_emu.serving.metrics.power_w_from_spec`); None leaves tok/s per kW empty.
        mtp_accept_tokens: kept for callers of earlier versions: only 0 (give MTP as ``speculation``).
        speculation: speculative decoding (MTP): K draft tokens per step and their acceptance
            (:func:`~jalapeno_emu.serving.speculative.speculation`); None: single-token prediction.
        stack: the serving stack's host costs per step and per request
            (:class:`~jalapeno_emu.serving.stack.StackProfile`); None: the device's steps alone.

    Returns:
        The point's :class:`ServingMetrics` (see the module docstring for the semantics).

    Raises:
        InvalidArgumentError: a bad argument or one beyond its limit (:mod:`jalapeno_emu.serving.limits`,
            each refusal naming it), a request that can never fit in the KV capacity, or a step model
            returning a non-positive or non-finite time.
    """
    _check_model(model)
    isl = _positive_int("isl", isl)
    osl = _positive_int("osl", osl)
    _check_sequence(isl, osl)
    # The counts bound the simulation's own work (serving/limits.py): checked before any step.
    concurrency = MAX_CONCURRENCY.check("concurrency", concurrency)
    requests = default_requests(concurrency) if requests is None else MAX_REQUESTS.check("requests", requests)
    warmup = concurrency if warmup_requests is None else MAX_REQUESTS.check("warmup_requests",
                                                                            warmup_requests, 0)
    seed = _positive_int("seed", seed, 0)
    power = check_power(power_w)
    _check_workload(model, isl, osl, concurrency, range_ratio, mtp_accept_tokens, speculation)

    if stack is not None and not isinstance(stack, StackProfile):
        raise InvalidArgumentError(f"stack {stack!r} is not a StackProfile (serving.stack.load_stack)")
    engine = _Engine(model, concurrency, _Lengths(isl, osl, range_ratio, seed), speculation, seed, stack)
    first_measured, start = (0, engine.counters.snapshot()) if warmup == 0 else (None, None)
    while True:
        first_new_id = engine.step()
        if first_measured is None and engine.completed_count >= warmup:
            first_measured, start = first_new_id, engine.counters.snapshot()
        if first_measured is not None and _measured_done(engine, first_measured, requests):
            break
    end = engine.counters
    window = WindowCounters(tokens=end.tokens - start.tokens, seconds=end.t_s - start.t_s,
                            steps=end.steps - start.steps,
                            decode_sequence_steps=end.decode_sequence_steps - start.decode_sequence_steps,
                            kv_bound_steps=end.kv_bound_steps - start.kv_bound_steps,
                            decode_tokens=end.decode_tokens - start.decode_tokens)
    return summarise(mapping=model.name, concurrency=concurrency, chips=int(model.chips), isl=isl, osl=osl,
                     warmup_requests=warmup, requests=engine.completed.select(first_measured, requests),
                     window=window, total_steps=end.steps, simulated_s=end.t_s, power_w=power,
                     draft_tokens=0 if speculation is None else speculation.draft_tokens)


def _measured_done(engine: _Engine, first_id: int, count: int) -> bool:
    """Whether every measured request (ids first_id .. first_id + count - 1) has completed."""
    if engine.next_id < first_id + count:
        return False
    in_flight = engine.req_id
    return not np.any((in_flight >= first_id) & (in_flight < first_id + count))
