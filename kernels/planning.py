"""The planning layer every kernel shares: what a kernel may use, what its work costs, and how a
kernel chooses among its programs.

Stage: kernels (below every kernel family, above the chip spec). A kernel's planner turns a shape
and a :class:`Budget` into a plan (tile sizes, buffer counts, work split); the numbers it plans
with come from here, so that every kernel reads the same rule:

- :class:`Budget`: the scratchpad and accumulator bytes per core and the cores a kernel may use.
  A stand-alone launch gets ``Budget.of(spec)``: ``SRAM_SHARE`` of every core's scratchpad (a
  little is left for the constants each kernel loads beside its plan) and all accumulators. A
  fused program gives each operator the same budget, so an operator's plan (and hence its
  arithmetic) is the same fused or not (``kernels/compose.py``).
- :func:`core_hbm_bytes_per_s`: a core's share of HBM when ``cores`` stream at once (the
  achievable HBM rate split evenly, capped by the core's DMA port).
- :func:`mxu_cycles_per_step`, :func:`mxu_macs_per_cycle`: the matrix unit's rate for an
  operand pair, from the chip spec's per-format MACs (fp4 x fp4 at the MXFP4 rate, anything with
  a BF16 side at the BF16 rate, the rest at the MXFP8 rate: the same rule as the timing pass).
- :class:`DoesNotFit` and :func:`first_fitting`: one error for "this shape does not fit", and
  the choice between a kernel's programs as an ordered list of planners, each run once; when
  none fits, the error gives every planner's reason.
- :func:`memoised_planner`: a planner is a pure function of (shape, spec, budget, ...), and a
  model step asks for the same plan many times (its tensors, its emission, each fused window,
  each mapping of a sweep), so planners whose search is costly remember their recent answers,
  "does not fit" included.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError

__all__ = ["SRAM_SHARE", "Budget", "DoesNotFit", "core_hbm_bytes_per_s", "first_fitting",
           "memoised_planner", "mxu_cycles_per_step", "mxu_macs_per_cycle", "mxu_rate_name"]

SRAM_SHARE = 0.95
"""Fraction of a core's scratchpad a kernel plans with (the rest holds its small constants)."""

T = TypeVar("T")


@dataclass(frozen=True)
class Budget:
    """What one kernel (or one operator of a fused program) may use on each core.

    Attributes:
        sram_bytes: scratchpad bytes per core for the plan's buffers.
        acc_bytes: accumulator bytes per core.
        cores: cores it may use (0 .. cores-1).
    """

    sram_bytes: int
    acc_bytes: int
    cores: int

    @staticmethod
    def of(spec: ChipSpec, share: float = SRAM_SHARE) -> Budget:
        """The stand-alone budget: ``share`` of each scratchpad, every accumulator, every core."""
        return Budget(int(spec.sram.scratchpad_bytes * share), spec.sram.accumulator_bytes, spec.core.count)


class DoesNotFit(InvalidArgumentError):
    """A shape does not fit a kernel's plan on this chip: the message says what needs how much.

    Args:
        message: what does not fit, with the bytes needed and available.
        reasons: for a choice between programs, each planner's (name, reason).
    """

    def __init__(self, message: str, *, reasons: tuple[tuple[str, str], ...] = (),
                 hint: str | None = None) -> None:
        self.reasons = reasons
        super().__init__(message, hint=hint)


def first_fitting(planners: Sequence[tuple[str, Callable[[], T]]], what: str) -> tuple[str, T]:
    """Run each (name, planner) once, in order; return (name, plan) of the first that fits.

    A planner signals "does not fit" by raising :class:`DoesNotFit` (any other
    ``InvalidArgumentError`` is a bad shape and propagates at once).

    Raises:
        DoesNotFit: no planner fits; the message lists each one's reason.
    """
    reasons: list[tuple[str, str]] = []
    for name, planner in planners:
        try:
            return name, planner()
        except DoesNotFit as exc:
            reasons.append((name, exc.message))
    if len(reasons) == 1:
        raise DoesNotFit(f"{what}: {reasons[0][1]}", reasons=tuple(reasons))
    listed = "; ".join(f"{name}: {why}" for name, why in reasons)
    raise DoesNotFit(f"{what}: no program fits ({listed})", reasons=tuple(reasons))


_MEMO_ENTRIES = 256  # per planner; a sweep touches a few dozen distinct shapes


def memoised_planner(planner: Callable[..., T]) -> Callable[..., T]:
    """``planner(shape, spec, budget, *args)`` remembering its recent results by value.

    The plan (a frozen dataclass) is shared between callers; a :class:`DoesNotFit` is remembered
    too and raised again (the same exception, its traceback reset). A shape with an unhashable
    value is planned without the memo. ``wrapper.cache_clear()`` forgets everything.
    """
    memo: OrderedDict[Any, tuple[bool, Any]] = OrderedDict()

    @functools.wraps(planner)
    def wrapper(shape: dict[str, Any], spec: ChipSpec, budget: Budget, *args: Any) -> T:
        try:
            key = (tuple(sorted(shape.items())), spec, budget, args)
            hash(key)
        except TypeError:
            return planner(shape, spec, budget, *args)
        hit = memo.get(key)
        if hit is None:
            try:
                hit = (True, planner(shape, spec, budget, *args))
            except DoesNotFit as exc:
                hit = (False, exc)
            memo[key] = hit
            if len(memo) > _MEMO_ENTRIES:
                memo.popitem(last=False)
        else:
            memo.move_to_end(key)
        ok, value = hit
        if ok:
            return value
        raise value.with_traceback(None)

    wrapper.cache_clear = memo.clear  # type: ignore[attr-defined]
    return wrapper


def core_hbm_bytes_per_s(spec: ChipSpec, cores: int) -> float:
    """B/s one core gets when ``cores`` cores stream from HBM at once: the achievable HBM rate
    (peak x efficiency) split evenly, capped by the core's DMA port."""
    if cores < 1:
        raise InvalidArgumentError(f"cores={cores} must be >= 1")
    achievable = spec.derived()["hbm_achievable_bytes_per_s"]
    return min(spec.dma.bytes_per_s_per_core, achievable / min(cores, spec.core.count))


def mxu_rate_name(a_dtype: str, b_dtype: str) -> str:
    """"mxfp4", "mxfp8" or "bf16": the matrix-unit rate an operand pair runs at (fp4 x fp4 at
    the MXFP4 rate; a BF16 operand at the BF16 rate; anything else at the MXFP8 rate)."""
    if a_dtype == "fp4" and b_dtype == "fp4":
        return "mxfp4"
    if "bf16" in (a_dtype, b_dtype):
        return "bf16"
    return "mxfp8"


def mxu_macs_per_cycle(spec: ChipSpec, a_dtype: str, b_dtype: str) -> int:
    """MACs per cycle of one core's matrix unit for the operand pair (chip spec)."""
    m = spec.matrix
    return {"mxfp4": m.mxfp4_macs_per_cycle, "mxfp8": m.mxfp8_macs_per_cycle,
            "bf16": m.bf16_macs_per_cycle}[mxu_rate_name(a_dtype, b_dtype)]


def mxu_cycles_per_step(spec: ChipSpec, a_dtype: str, b_dtype: str) -> float:
    """Cycles of one tile step (tile_m x tile_n x tile_k MACs) for the operand pair."""
    m = spec.matrix
    return m.tile_m * m.tile_n * m.tile_k / mxu_macs_per_cycle(spec, a_dtype, b_dtype)
