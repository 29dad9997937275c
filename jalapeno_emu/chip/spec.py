"""The chip spec: one frozen, keyword-only dataclass per block of the die, nested in :class:`ChipSpec`.

Stage: chip spec. A preset (``presets/*.toml``, read by ``load.py``) becomes a ``ChipSpec``; the
engines, the memory map, the timing pass and the rack model read their hardware parameters from
it and from nowhere else. Units are in the field names (``clock_hz``, ``latency_s``,
``bytes_per_s_per_core``). Each field also declares its unit, a one-line description and the
check it must pass, so validation, parsing of ``"36GiB"``-style values and the CLI tables all read
one declaration. Every numeric field also has a :class:`Limit` (``limits.FIELD_LIMITS``: the
largest value, and for rates the smallest, each with its reason), so no value passes validation
that a cost model cannot price, a host cannot emulate or JSON cannot print. Every leaf carries a
:class:`Provenance`: public (with its source), assumed (with a reason) or derived (computed from
public figures).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from jalapeno_emu.chip._units import format_quantity, short_repr
from jalapeno_emu.chip.limits import FIELD_LIMITS as _LIMITS
from jalapeno_emu.chip.limits import Limit
from jalapeno_emu.errors import ConfigError

__all__ = [
    "BLOCKS",
    "DERIVED_QUANTITIES",
    "FIELDS",
    "MX_BLOCK",
    "OVERRIDE",
    "PROVENANCE_KINDS",
    "STACK_NAMES",
    "ChipSpec",
    "CoreSpec",
    "DerivedQuantity",
    "DmaSpec",
    "FieldInfo",
    "HbmSpec",
    "Limit",
    "LinkSpec",
    "MatrixUnitSpec",
    "PowerSpec",
    "Provenance",
    "SoftwareSpec",
    "SramSpec",
    "SyncSpec",
    "VectorUnitSpec",
    "unknown_field_message",
]

MX_BLOCK = 32
"""Elements sharing one scale in OCP MX; the matrix unit's K-tile must be a multiple of it."""

STACK_NAMES: tuple[str, ...] = ("vllm", "sglang", "trtllm", "dynamo", "jalapeno")
"""The serving stacks a preset may name (``jalapeno_emu.serving.stack`` holds their costs)."""

ProvenanceKind = Literal["public", "assumed", "derived"]
PROVENANCE_KINDS: tuple[str, ...] = ("public", "assumed", "derived")


@dataclass(frozen=True, kw_only=True)
class Provenance:
    """Where one number comes from.

    Args:
        kind: ``"public"`` (disclosed; `note` is the source), ``"assumed"`` (a knob; `note` is a
            one-line reason) or ``"derived"`` (computed from public figures; `note` says how).
        note: the source, reason or derivation; never empty.
    """

    kind: ProvenanceKind
    note: str

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in PROVENANCE_KINDS:  # (`in` would == an array)
            raise ConfigError(f"provenance kind must be one of {', '.join(PROVENANCE_KINDS)}, "
                              f"found {short_repr(self.kind)}")
        if not isinstance(self.note, str) or not self.note.strip():
            raise ConfigError(f"a {self.kind} provenance needs a non-empty note "
                              f"(the source, reason or derivation), found {short_repr(self.note)}")


OVERRIDE = Provenance(kind="assumed", note="override")
"""The provenance :meth:`ChipSpec.replace` gives every field it changes."""

# check name -> (predicate, what it expects, for the message)
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "positive": (lambda v: v > 0, "> 0"),
    "nonnegative": (lambda v: v >= 0, ">= 0"),
    "fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "power_of_two": (lambda v: v > 0 and v & (v - 1) == 0, "a positive power of two"),
    "fusion_level": (lambda v: v in ("none", "layer", "step"), "one of none, layer, step"),
    "stack_name": (lambda v: v in STACK_NAMES, f"one of {', '.join(STACK_NAMES)}"),
}


def _param(unit: str, doc: str, check: str = "positive") -> Any:
    """Declare a leaf field: its unit (for parsing and display), description and invariant."""
    assert check in _CHECKS, check
    return field(metadata={"unit": unit, "doc": doc, "check": check})


@functools.cache
def _field_types(cls: type) -> dict[str, type]:
    return {k: v for k, v in typing.get_type_hints(cls).items() if k != "PATH"}


def _check_type(path: str, value: Any, expected: type) -> Any:
    """`value` as `expected` (an int is accepted, and converted, for a float); ConfigError otherwise."""
    ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value, ok = float(value), True
        except OverflowError:
            raise ConfigError(f"{path} must be a finite number, found {short_repr(value)}") from None
    if not ok:
        raise ConfigError(f"{path} must be {expected.__name__}, found {type(value).__name__} "
                          f"{short_repr(value)}")
    if expected is float and not math.isfinite(value):
        raise ConfigError(f"{path} must be a finite number, found {value!r}")
    return value


class _Block:
    """What every block shares: type coercion and invariant checks on every construction."""

    PATH: ClassVar[str]

    def __post_init__(self) -> None:
        types = _field_types(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = _check_type(f"{self.PATH}.{f.name}", getattr(self, f.name), types[f.name])
            object.__setattr__(self, f.name, value)
        self.check_invariants()

    def check_invariants(self) -> None:
        """Raise ConfigError naming the dotted field path if a value breaks its declared check or
        leaves its :data:`_LIMITS` range."""
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            ok, expected = _CHECKS[f.metadata["check"]]
            value = getattr(self, f.name)
            path = f"{self.PATH}.{f.name}"
            if not ok(value):
                raise ConfigError(f"{path} must be {expected}, found {short_repr(value)}")
            if path in _LIMITS:
                _LIMITS[path].check(path, value, f.metadata["unit"])
        self._check_relations()

    def _check_relations(self) -> None:
        """Invariants between fields of one block; blocks that have some override this."""

    def _fail(self, name: str, expected: str, found: Any) -> None:
        raise ConfigError(f"{self.PATH}.{name} must be {expected}, found {found!r}")


@dataclass(frozen=True, kw_only=True)
class CoreSpec(_Block):
    """The compute cores: how many, and the clock every ``*_cycles`` field counts."""

    PATH: ClassVar[str] = "core"
    count: int = _param("", "compute cores on the die")
    clock_hz: float = _param("Hz", "core clock; every *_cycles field counts cycles of it")


@dataclass(frozen=True, kw_only=True)
class MatrixUnitSpec(_Block):
    """One core's matrix unit: the tile one instruction step covers, and MACs per cycle per format.

    A tile step multiplies an [tile_m, tile_k] by a [tile_k, tile_n] tile into FP32 accumulators;
    at format F it takes ``tile_m * tile_n * tile_k / F_macs_per_cycle`` cycles.
    """

    PATH: ClassVar[str] = "matrix"
    tile_m: int = _param("", "rows of the output tile one instruction step produces")
    tile_n: int = _param("", "columns of the output tile one instruction step produces")
    tile_k: int = _param("", "contraction depth of one step; a multiple of the 32-element MX block")
    mxfp4_macs_per_cycle: int = _param("MAC/cycle", "MXFP4 (e2m1) multiply-accumulates per cycle per core")
    mxfp8_macs_per_cycle: int = _param("MAC/cycle", "MXFP8 (e4m3/e5m2) multiply-accumulates per cycle")
    bf16_macs_per_cycle: int = _param("MAC/cycle", "BF16 multiply-accumulates per cycle per core")
    pipeline_depth_cycles: int = _param("cycles", "fill latency before the first result", "nonnegative")
    issue_overhead_cycles: int = _param("cycles", "fixed cost of issuing one instruction", "nonnegative")

    def _check_relations(self) -> None:
        if self.tile_k % MX_BLOCK:
            self._fail("tile_k", f"a multiple of the MX block ({MX_BLOCK})", self.tile_k)
        if self.mxfp8_macs_per_cycle > self.mxfp4_macs_per_cycle:
            self._fail("mxfp8_macs_per_cycle",
                       f"<= matrix.mxfp4_macs_per_cycle ({self.mxfp4_macs_per_cycle})",
                       self.mxfp8_macs_per_cycle)
        if self.bf16_macs_per_cycle > self.mxfp8_macs_per_cycle:
            self._fail("bf16_macs_per_cycle",
                       f"<= matrix.mxfp8_macs_per_cycle ({self.mxfp8_macs_per_cycle})",
                       self.bf16_macs_per_cycle)


@dataclass(frozen=True, kw_only=True)
class VectorUnitSpec(_Block):
    """One core's vector unit: FP32 elementwise work (softmax, norms, activations, epilogues)."""

    PATH: ClassVar[str] = "vector"
    lanes: int = _param("elements/cycle", "FP32 elements per cycle for add/mul/max-class operations")
    transcendental_elements_per_cycle: int = _param("elements/cycle", "FP32 exp/rsqrt/... per cycle")
    issue_overhead_cycles: int = _param("cycles", "fixed cost of issuing one instruction", "nonnegative")

    def _check_relations(self) -> None:
        if self.transcendental_elements_per_cycle > self.lanes:
            self._fail("transcendental_elements_per_cycle", f"<= vector.lanes ({self.lanes})",
                       self.transcendental_elements_per_cycle)


@dataclass(frozen=True, kw_only=True)
class SramSpec(_Block):
    """One core's on-die memories: the scratchpad and the FP32 accumulator memory."""

    PATH: ClassVar[str] = "sram"
    scratchpad_bytes: int = _param("B", "scratchpad SRAM per core (operands, KV tiles, activations)")
    accumulator_bytes: int = _param("B", "FP32 accumulator memory per core (matrix-unit outputs)")
    bytes_per_cycle: int = _param("B/cycle", "SRAM port width per core, for SRAM-to-SRAM copies")


@dataclass(frozen=True, kw_only=True)
class DmaSpec(_Block):
    """One core's DMA engines, which move data between HBM and SRAM."""

    PATH: ClassVar[str] = "dma"
    queues_per_core: int = _param("", "independent DMA queues per core")
    bytes_per_s_per_core: float = _param("B/s", "one core's DMA bandwidth cap, all its queues together")
    setup_latency_s: float = _param("s", "fixed cost per descriptor, before the first byte moves "
                                         "(excludes hbm.latency_s)", "nonnegative")
    max_outstanding_per_queue: int = _param("", "descriptors one queue may have in flight")


@dataclass(frozen=True, kw_only=True)
class HbmSpec(_Block):
    """The HBM4 stacks: geometry, address interleave, bandwidth, latency and capacity."""

    PATH: ClassVar[str] = "hbm"
    stacks: int = _param("", "HBM stacks on the package")
    channels_per_stack: int = _param("", "independent channels per stack")
    pseudo_channels_per_channel: int = _param("", "pseudo-channels per channel")
    interleave_bytes: int = _param("B", "address granule that rotates across pseudo-channels",
                                   "power_of_two")
    bytes_per_s_per_pseudo_channel: float = _param("B/s", "peak bandwidth of one pseudo-channel")
    efficiency: float = _param("", "achievable fraction of peak when streaming (refresh, turnarounds)",
                               "fraction")
    latency_s: float = _param("s", "load-to-use latency of one access", "nonnegative")
    capacity_bytes_per_stack: int = _param("B", "capacity of one stack")

    @property
    def pseudo_channels(self) -> int:
        """Pseudo-channels on the package (stacks x channels x pseudo-channels per channel)."""
        return self.stacks * self.channels_per_stack * self.pseudo_channels_per_channel

    @property
    def capacity_bytes(self) -> int:
        """Total HBM capacity in bytes, all stacks."""
        return self.stacks * self.capacity_bytes_per_stack

    @property
    def bytes_per_s(self) -> float:
        """Peak HBM bandwidth in B/s, all pseudo-channels."""
        return self.pseudo_channels * self.bytes_per_s_per_pseudo_channel

    def _check_relations(self) -> None:
        granule_row = self.interleave_bytes * self.channels_per_stack * self.pseudo_channels_per_channel
        if self.capacity_bytes_per_stack % granule_row:
            self._fail("capacity_bytes_per_stack",
                       f"a multiple of hbm.interleave_bytes x pseudo-channels per stack ({granule_row} B) "
                       f"so the interleave spreads evenly", self.capacity_bytes_per_stack)


@dataclass(frozen=True, kw_only=True)
class LinkSpec(_Block):
    """The scale-up links: a chip's ports into a switched fabric, and the domain that fabric reaches.

    Topology: switched. Each port goes to its own switch plane and every plane reaches every chip
    of the domain, so a message to any peer crosses ``switch_hops`` switches and
    ``switch_hops + 1`` links and is striped over ``stripe_ports`` ports. One message of ``n``
    bytes costs (:meth:`message_s`, the formula the timing pass and the rack's collectives share)::

        alpha = message_setup_s + (switch_hops + 1) * latency_s + switch_hops * switch_latency_s
        beta  = 1 / (stripe_ports * bytes_per_s_per_direction * efficiency)      [s/B]
        time  = alpha + n * beta
    """

    PATH: ClassVar[str] = "link"
    ports: int = _param("", "scale-up ports per chip")
    bytes_per_s_per_direction: float = _param("B/s", "bandwidth of one port, each direction")
    latency_s: float = _param("s", "per-hop latency (SerDes, FEC, cable)", "nonnegative")
    switch_latency_s: float = _param("s", "latency through one switch", "nonnegative")
    domain_chips: int = _param("chips", "chips one scale-up domain connects through its switches")
    switch_hops: int = _param("", "switches a message crosses between two chips of the domain",
                              "nonnegative")
    stripe_ports: int = _param("", "ports one message is striped over (switch planes reaching the peer)")
    message_setup_s: float = _param("s", "per-message set-up: descriptor, doorbell, completion signal",
                                    "nonnegative")
    efficiency: float = _param("", "achievable fraction of a port's bandwidth (headers, FEC, flow control)",
                               "fraction")

    @property
    def path_latency_s(self) -> float:
        """Latency of the path between two chips: every link hop and every switch, in s."""
        return (self.switch_hops + 1) * self.latency_s + self.switch_hops * self.switch_latency_s

    @property
    def alpha_s(self) -> float:
        """The fixed cost of one message: set-up plus path latency, in s."""
        return self.message_setup_s + self.path_latency_s

    @property
    def stripe_bytes_per_s(self) -> float:
        """Achievable bandwidth of one message, each direction: striped ports x port rate x efficiency."""
        return self.stripe_ports * self.bytes_per_s_per_direction * self.efficiency

    def message_s(self, nbytes: float) -> float:
        """Seconds to deliver one message of ``nbytes`` bytes: ``alpha_s + nbytes / stripe_bytes_per_s``."""
        return self.alpha_s + nbytes / self.stripe_bytes_per_s

    def _check_relations(self) -> None:
        if self.stripe_ports > self.ports:
            self._fail("stripe_ports", f"<= link.ports ({self.ports})", self.stripe_ports)
        if self.domain_chips > 1 and self.switch_hops < 1:
            self._fail("switch_hops", "at least 1: the scale-up topology is switched", self.switch_hops)


@dataclass(frozen=True, kw_only=True)
class SyncSpec(_Block):
    """Synchronisation costs: semaphores between engine queues, barriers, kernel launch."""

    PATH: ClassVar[str] = "sync"
    semaphore_latency_cycles: int = _param("cycles", "signal-to-wake latency of a semaphore", "nonnegative")
    barrier_latency_cycles: int = _param("cycles", "all-core barrier latency", "nonnegative")
    kernel_launch_s: float = _param("s", "fixed cost of launching one kernel", "nonnegative")


@dataclass(frozen=True, kw_only=True)
class PowerSpec(_Block):
    """Power per chip, for tokens per kW (say which one a result uses)."""

    PATH: ClassVar[str] = "power"
    tdp_w: float = _param("W", "package thermal design power")
    sustained_w: float = _param("W", "sustained package draw on inference workloads")
    facility_w_per_chip: float = _param("W", "all-in facility power per chip (host, network, cooling)")

    def _check_relations(self) -> None:
        if self.sustained_w > self.tdp_w:
            self._fail("sustained_w", f"<= power.tdp_w ({self.tdp_w})", self.sustained_w)
        if self.tdp_w > self.facility_w_per_chip:
            self._fail("facility_w_per_chip", f">= power.tdp_w ({self.tdp_w})", self.facility_w_per_chip)


@dataclass(frozen=True, kw_only=True)
class SoftwareSpec(_Block):
    """The software the chip runs with: how kernel launches are joined into programs (``none``: one
    program per kernel launch, each paying ``sync.kernel_launch_s``; ``layer``: one per decoder
    layer; ``step``: one persistent program per forward step; see ``jalapeno_emu.model.fused``),
    and the serving stack around them (``jalapeno_emu.serving.stack``: the host's costs per step
    and per request)."""

    PATH: ClassVar[str] = "software"
    fusion: str = _param("", "default fusion of kernel launches into programs: none, layer or step",
                         "fusion_level")
    stack: str = _param("", f"default serving stack: {', '.join(STACK_NAMES)}", "stack_name")


@dataclass(frozen=True)
class FieldInfo:
    """The declaration of one leaf field, e.g. ``FIELDS["hbm.latency_s"]``.

    Attributes:
        path: dotted path, ``"hbm.latency_s"``.
        type: ``int``, ``float``, ``bool`` or ``str``.
        unit: ``"B"``, ``"B/s"``, ``"Hz"``, ``"s"``, ``"W"``, a word such as ``"cycles"``, or ``""``.
        doc: one-line description.
        check: the invariant's name (``"positive"``, ``"fraction"``, ...).
        limit: the range beyond the check, with its reason (None for a str field).
    """

    path: str
    type: type
    unit: str
    doc: str
    check: str
    limit: Limit | None = None


@dataclass(frozen=True)
class DerivedQuantity:
    """A total computed from the spec: its key in :meth:`ChipSpec.derived`, unit and formula."""

    name: str
    unit: str
    formula: str
    compute: Callable[[ChipSpec], float | int] = field(repr=False, compare=False)


@dataclass(frozen=True, kw_only=True, repr=False)
class ChipSpec:
    """A whole chip: its name, one spec per block, and the provenance of every leaf field.

    Construction checks every invariant (:meth:`check_invariants`); :meth:`replace` returns a
    new, re-validated spec. Equal specs hash equally (provenance aside), so a spec can key a cache.

    Args:
        name: preset name, e.g. ``"jalapeno-v1"``.
        description: one line for humans.
        core, matrix, vector, sram, dma, hbm, link, sync, power, software: the blocks.
        provenance: dotted leaf path (``"hbm.efficiency"``) -> :class:`Provenance`, for every leaf.
    """

    name: str
    description: str
    core: CoreSpec
    matrix: MatrixUnitSpec
    vector: VectorUnitSpec
    sram: SramSpec
    dma: DmaSpec
    hbm: HbmSpec
    link: LinkSpec
    sync: SyncSpec
    power: PowerSpec
    software: SoftwareSpec
    provenance: Mapping[str, Provenance] = field(hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.provenance, Mapping):
            raise ConfigError(f"chip spec {short_repr(self.name)}: provenance must be a mapping of dotted "
                              f"field paths to Provenance, found {type(self.provenance).__name__}")
        object.__setattr__(self, "provenance", MappingProxyType(dict(sorted(self.provenance.items()))))
        self.check_invariants()

    def check_invariants(self) -> None:
        """Check types, every block's invariants and provenance coverage; ConfigError names the path."""
        # short_repr: name and description are not yet known to be str, and Python refuses to print
        # an int of more than 4,300 digits (a ValueError in place of this ConfigError).
        where = f"chip spec {short_repr(self.name)}"
        for key in ("name", "description"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"{where}: {key} must be str, found {short_repr(getattr(self, key))}")
        if not self.name:
            raise ConfigError("chip spec: name must be a non-empty string")
        for block, cls in BLOCKS.items():
            value = getattr(self, block)
            if not isinstance(value, cls):
                raise ConfigError(f"{where}: {block} must be a {cls.__name__}, "
                                  f"found {type(value).__name__}")
            try:
                value.check_invariants()
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc.message}") from None
        unknown = sorted(set(self.provenance) - set(FIELDS))
        if unknown:
            raise ConfigError(f"{where}: provenance names unknown field(s) {', '.join(unknown)}")
        missing = [path for path in FIELDS if path not in self.provenance]
        if missing:
            raise ConfigError(f"{where}: provenance missing for {', '.join(missing)} "
                              f"(every field needs public, assumed or derived)")
        for path, prov in self.provenance.items():
            if not isinstance(prov, Provenance):
                raise ConfigError(f"{where}: provenance of {path} must be a Provenance, "
                                  f"found {type(prov).__name__}")

    def get(self, path: str) -> Any:
        """The value of one leaf by dotted path, e.g. ``spec.get("hbm.efficiency")``."""
        if path not in FIELDS:
            raise ConfigError(unknown_field_message(path))
        block, name = path.split(".")
        return getattr(getattr(self, block), name)

    def leaves(self) -> Iterator[tuple[str, Any]]:
        """(dotted path, value) for every leaf field, in declaration order."""
        for path in FIELDS:
            yield path, self.get(path)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain values: ``{"name": ..., "description": ..., "core": {"count": 64, ...}, ...}``."""
        out: dict[str, Any] = {"name": self.name, "description": self.description}
        for block in BLOCKS:
            out[block] = dataclasses.asdict(getattr(self, block))
        return out

    def derived(self) -> dict[str, float | int]:
        """Chip totals (see :data:`DERIVED_QUANTITIES` for units and formulas; a FLOP is 2 per MAC).

        Returns:
            ``peak_mxfp4_flops_per_s``, ``peak_mxfp8_flops_per_s``, ``peak_bf16_flops_per_s``,
            ``hbm_bytes_per_s`` (peak), ``hbm_achievable_bytes_per_s``, ``hbm_capacity_bytes``,
            ``hbm_pseudo_channels``, ``sram_total_bytes``, ``link_bytes_per_s_per_direction``
            (all ports) and a few more, by name.
        """
        # Planners ask for these millions of times in a sweep (a core's HBM share per candidate
        # item); the spec is frozen, so compute them once and hand out copies.
        cached = self.__dict__.get("_derived")
        if cached is None:
            cached = {name: q.compute(self) for name, q in DERIVED_QUANTITIES.items()}
            object.__setattr__(self, "_derived", cached)
        return dict(cached)

    def replace(self, **overrides: Any) -> ChipSpec:
        """A new, re-validated spec with some fields changed; their provenance becomes ``OVERRIDE``.

        Args:
            **overrides: dotted path -> value of the field's type, e.g.
                ``spec.replace(**{"hbm.efficiency": 0.85, "core.count": 32})``; ``name`` and
                ``description`` may be changed too. To parse strings (``"1.6GHz"``) use
                :func:`jalapeno_emu.chip.apply_overrides`.

        Raises:
            ConfigError: an unknown path (with close matches), a value of the wrong type, or a
                result that breaks an invariant; the message names the path.
        """
        top: dict[str, Any] = {}
        per_block: dict[str, dict[str, Any]] = {}
        for key, value in overrides.items():
            if key in ("name", "description"):
                top[key] = value
            elif key in FIELDS:
                block, name = key.split(".")
                per_block.setdefault(block, {})[name] = value
            else:
                raise ConfigError(unknown_field_message(key))
        blocks: dict[str, Any] = {}
        for block, changes in per_block.items():
            try:
                blocks[block] = dataclasses.replace(getattr(self, block), **changes)
            except ConfigError as exc:
                raise ConfigError(f"chip spec {self.name!r}: {exc.message}") from None
        provenance = dict(self.provenance)
        provenance.update({key: OVERRIDE for key in overrides if key in FIELDS})
        return dataclasses.replace(self, **top, **blocks, provenance=provenance)

    def __reduce__(self) -> tuple[Any, ...]:
        # The read-only MappingProxyType of provenance cannot be pickled, and specs must cross
        # process boundaries (sweeps and validation in process pools or on a Dask cluster): rebuild
        # through the constructor from a plain dict, which also re-checks the invariants.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["provenance"] = dict(self.provenance)
        return (functools.partial(ChipSpec, **fields), ())

    def __repr__(self) -> str:
        q = format_quantity
        return (f"ChipSpec({self.name!r}: {self.core.count} cores @ {q(self.core.clock_hz, 'Hz')}, "
                f"{q(_flops(self, self.matrix.mxfp4_macs_per_cycle), 'FLOP/s')} MXFP4, "
                f"{q(self.hbm.capacity_bytes, 'B')} HBM @ {q(self.hbm.bytes_per_s, 'B/s')})")


BLOCKS: Mapping[str, type[_Block]] = MappingProxyType({
    f.name: _field_types(ChipSpec)[f.name]
    for f in dataclasses.fields(ChipSpec)
    if isinstance(_field_types(ChipSpec)[f.name], type) and issubclass(_field_types(ChipSpec)[f.name], _Block)
})
"""Block name (``"hbm"``) -> its spec class (:class:`HbmSpec`), in ChipSpec order."""

FIELDS: Mapping[str, FieldInfo] = MappingProxyType({
    f"{block}.{f.name}": FieldInfo(path=f"{block}.{f.name}", type=_field_types(cls)[f.name],
                                   unit=f.metadata["unit"], doc=f.metadata["doc"], check=f.metadata["check"],
                                   limit=_LIMITS.get(f"{block}.{f.name}"))
    for block, cls in BLOCKS.items()
    for f in dataclasses.fields(cls)  # type: ignore[arg-type]
})
"""Every leaf field by dotted path, in declaration order: the one list the loader, CLI and tests read."""

# A new numeric field needs a limit: without one, a huge value passes and then overflows a cost
# model or runs without end.
assert {p for p, i in FIELDS.items() if i.type in (int, float)} == set(_LIMITS), (
    sorted({p for p, i in FIELDS.items() if i.type in (int, float)} ^ set(_LIMITS)))


def _dq(name: str, unit: str, formula: str, compute: Callable[[ChipSpec], float | int]) -> tuple:
    return name, DerivedQuantity(name=name, unit=unit, formula=formula, compute=compute)


def _flops(s: ChipSpec, macs_per_cycle: int) -> float:
    return 2.0 * s.core.count * s.core.clock_hz * macs_per_cycle


DERIVED_QUANTITIES: Mapping[str, DerivedQuantity] = MappingProxyType(dict([
    _dq("peak_mxfp4_flops_per_s", "FLOP/s", "2 x core.count x core.clock_hz x matrix.mxfp4_macs_per_cycle",
        lambda s: _flops(s, s.matrix.mxfp4_macs_per_cycle)),
    _dq("peak_mxfp8_flops_per_s", "FLOP/s", "2 x core.count x core.clock_hz x matrix.mxfp8_macs_per_cycle",
        lambda s: _flops(s, s.matrix.mxfp8_macs_per_cycle)),
    _dq("peak_bf16_flops_per_s", "FLOP/s", "2 x core.count x core.clock_hz x matrix.bf16_macs_per_cycle",
        lambda s: _flops(s, s.matrix.bf16_macs_per_cycle)),
    _dq("vector_elements_per_s", "elements/s", "core.count x core.clock_hz x vector.lanes",
        lambda s: s.core.count * s.core.clock_hz * s.vector.lanes),
    _dq("hbm_pseudo_channels", "", "hbm.stacks x channels_per_stack x pseudo_channels_per_channel",
        lambda s: s.hbm.pseudo_channels),
    _dq("hbm_bytes_per_s", "B/s", "hbm_pseudo_channels x hbm.bytes_per_s_per_pseudo_channel",
        lambda s: s.hbm.bytes_per_s),
    _dq("hbm_achievable_bytes_per_s", "B/s", "hbm_bytes_per_s x hbm.efficiency",
        lambda s: s.hbm.bytes_per_s * s.hbm.efficiency),
    _dq("hbm_capacity_bytes", "B", "hbm.stacks x hbm.capacity_bytes_per_stack",
        lambda s: s.hbm.capacity_bytes),
    _dq("dma_bytes_per_s_all_cores", "B/s", "core.count x dma.bytes_per_s_per_core",
        lambda s: s.core.count * s.dma.bytes_per_s_per_core),
    _dq("sram_total_bytes", "B", "core.count x (sram.scratchpad_bytes + sram.accumulator_bytes)",
        lambda s: s.core.count * (s.sram.scratchpad_bytes + s.sram.accumulator_bytes)),
    _dq("link_bytes_per_s_per_direction", "B/s", "link.ports x link.bytes_per_s_per_direction",
        lambda s: s.link.ports * s.link.bytes_per_s_per_direction),
    _dq("link_alpha_s", "s", "link.message_setup_s + (switch_hops + 1) x latency_s + switch_hops x "
        "switch_latency_s (fixed cost of one message)", lambda s: s.link.alpha_s),
    _dq("link_stripe_bytes_per_s", "B/s", "link.stripe_ports x bytes_per_s_per_direction x efficiency "
        "(one message's achievable bandwidth)", lambda s: s.link.stripe_bytes_per_s),
    _dq("domain_peak_mxfp4_flops_per_s", "FLOP/s", "link.domain_chips x peak_mxfp4_flops_per_s",
        lambda s: s.link.domain_chips * _flops(s, s.matrix.mxfp4_macs_per_cycle)),
    _dq("domain_hbm_capacity_bytes", "B", "link.domain_chips x hbm_capacity_bytes",
        lambda s: s.link.domain_chips * s.hbm.capacity_bytes),
    _dq("mxfp4_flops_per_hbm_byte", "FLOP/B", "peak_mxfp4_flops_per_s / hbm_bytes_per_s (ridge point)",
        lambda s: _flops(s, s.matrix.mxfp4_macs_per_cycle) / s.hbm.bytes_per_s),
]))
"""Every derived total by name: unit, formula and how to compute it; :meth:`ChipSpec.derived` reads it."""


def unknown_field_message(key: str) -> str:
    """One sentence for an unknown dotted field path, with close matches or the valid names."""
    close = difflib.get_close_matches(key, list(FIELDS), n=3, cutoff=0.6)
    if close:
        return f"unknown chip field {key!r}; did you mean {' or '.join(close)}?"
    block = key.split(".", 1)[0]
    if block in BLOCKS:
        names = ", ".join(p for p in FIELDS if p.startswith(block + "."))
        return f"unknown chip field {key!r}; {block} has {names}"
    return f"unknown chip field {key!r}; fields are <block>.<name> with block one of {', '.join(BLOCKS)}"
