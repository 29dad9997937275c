"""What every kernel provides: shape keys, a Program builder, inputs, a pure-JAX reference.

Stage: kernels (on top of the ISA builder and the emulator). A kernel is registered once as a
``KernelDef``; ``kernels.runner`` checks it, times it (timing-only at any size) and, with
``check=True``, runs it functionally and compares with its reference.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.chip._units import format_quantity, short_repr
from jalapeno_emu.errors import InvalidArgumentError, InvalidTypeError
from jalapeno_emu.isa.program import Program
from jalapeno_emu.isa.table import DTYPES
from jalapeno_emu.mx.formats import canonical_format, describe_formats

__all__ = ["ROLES", "SHAPE_LIMITS", "KernelBuild", "KernelDef", "KeyLimit", "ShapeKey", "TensorSpec",
           "Tolerance", "hbm_tensor_bytes"]


@dataclass(frozen=True)
class KeyLimit:
    """The largest value a numeric shape key may take, with the reason for the bound (the kernels'
    counterpart of the chip spec's ``Limit``).

    Attributes:
        maximum: the largest value allowed.
        why: one line: why nothing larger makes sense here.
    """

    maximum: int | float
    why: str

    def check(self, kernel: str, key: str, value: int | float) -> None:
        """Raise InvalidArgumentError naming the kernel (when given), the key, the bound and its reason."""
        if value > self.maximum:
            bound = f"{self.maximum:,}" if isinstance(self.maximum, int) else f"{self.maximum:g}"
            where = f"kernel {kernel}: " if kernel else ""
            raise InvalidArgumentError(
                f"{where}shape key {key}={short_repr(value)} is above its limit of {bound} ({self.why})")


# The bounds of every numeric shape key, by key name (a name means the same thing in every kernel
# that has it). Each is far above every model the project ships and every real one it was checked
# against, and is a sanity cap: whether a shape's tensors fit the chip is checked separately, from
# the preset's HBM (KernelDef.check_shape). Kept so that a typo (tokens=100000000) is refused in
# microseconds instead of building a program of hundreds of millions of instructions, and so that
# products of keys stay far inside 64-bit addresses.
_ROWS = KeyLimit(2**20, "a million rows: 8x the longest context of the models shipped (131,072) and "
                        "128x the serving step budget (8,192 tokens); every row is DMA and matrix work the "
                        "emulator builds one instruction at a time")
_SEQUENCES = KeyLimit(2**16, "65,536 sequences: 64x the largest default sweep concurrency (1,024)")
_CONTEXT = KeyLimit(2**22, "4M tokens: 16x the longest max_position_embeddings of the models shipped "
                           "(Kimi K2.5: 262,144)")
_WIDTH = KeyLimit(2**16, "9x the widest hidden size shipped (DeepSeek-R1, Kimi K2.5: 7,168), 4x Llama 3.1 "
                         "405B's 16,384")
_INTERMEDIATE = KeyLimit(2**17, "7x DeepSeek-R1's dense FFN (18,432), 2.5x Llama 3.1 405B's 53,248")
_VOCAB = KeyLimit(2**20, "5x the largest vocabulary shipped (gpt-oss: 201,088)")
_HEADS = KeyLimit(1024, "8x the most heads shipped (DeepSeek-R1: 128)")
_HEAD_DIM = KeyLimit(1024, "8x the widest head part shipped (128)")
_EXPERTS = KeyLimit(4096, "10x the most routed experts shipped (Kimi K2.5: 384); each expert is a work "
                          "item the kernel plans and emits")
_SPLITS = KeyLimit(4096, "no more splits than the most cores a chip spec may have (core.count <= 4,096)")

SHAPE_LIMITS: Mapping[str, KeyLimit] = MappingProxyType({
    # rows: tokens, GEMM rows, a prefill chunk
    "tokens": _ROWS,
    "m": _ROWS,
    "seq": _ROWS,
    # sequences of a batch
    "batch": _SEQUENCES,
    # token positions in a sequence
    "context": _CONTEXT,
    "prior": _CONTEXT,
    "capacity": _CONTEXT,
    "window": _CONTEXT,
    "page_size": _CONTEXT,
    "kv_tile": _CONTEXT,
    # feature widths
    "hidden": _WIDTH,
    "k": KeyLimit(2**17, "the longest contraction of a model is its FFN width: see intermediate (7x "
                         "DeepSeek-R1's 18,432)"),
    "intermediate": _INTERMEDIATE,
    "slice": _INTERMEDIATE,
    "n": KeyLimit(2**20, "the widest GEMM output is an unembedding: 5x the largest vocabulary shipped "
                         "(gpt-oss: 201,088)"),
    "vocab": _VOCAB,
    "q_heads": _HEADS,
    "kv_heads": _HEADS,
    "head_dim": _HEAD_DIM,
    "nope_dim": _HEAD_DIM,
    "rope_dim": _HEAD_DIM,
    "v_head_dim": _HEAD_DIM,
    "kv_lora_rank": KeyLimit(8192, "16x the latent width shipped (DeepSeek-R1, Kimi K2.5: 512)"),
    # experts
    "experts": _EXPERTS,
    "top_k": _EXPERTS,
    "shared_experts": _EXPERTS,
    "distinct_experts": _EXPERTS,
    "n_group": _EXPERTS,
    "topk_group": _EXPERTS,
    "kv_splits": _SPLITS,
    "router_split": _SPLITS,
    # float parameters (NaN and infinities are refused whatever the bound)
    "eps": KeyLimit(1.0, "added to a mean square: models use 1e-5 or 1e-6, and 1 or more would swamp "
                         "the activations' own scale"),
    "routed_scaling_factor": KeyLimit(1000.0, "a weight scale: 350x the largest shipped (Kimi K2.5: "
                                              "2.827)"),
    "capacity_factor": KeyLimit(4096.0, "experts / top_k already lets every token of a block choose "
                                        "one expert; this is that for the expert limit"),
    "softmax_scale": KeyLimit(1e4, "a score scale: 1/sqrt(head width) is below 1 and YaRN multiplies it "
                                   "by a small factor"),
})
"""Shape key name -> its :class:`KeyLimit`; a numeric ``ShapeKey`` without an explicit ``limit``
takes the one of its name, and one that has neither fails at import."""


def _clipped(text: str, width: int = 40) -> str:
    """``repr(text)`` for a message, a long one cut with its length (a 5,000-digit value is not echoed)."""
    return repr(text) if len(text) <= width else f"{text[:width]!r}... ({len(text):,} characters)"


def hbm_tensor_bytes(t: TensorSpec) -> int:
    """Bytes of HBM ``t`` takes as the builder allocates it (an MX tensor's codes plus its scales),
    without the alignment padding between allocations."""
    rows, cols = t.shape
    if t.dtype not in DTYPES:  # a tensor spec in an MX spelling ("e4m3")
        dtype = canonical_format(t.dtype, DTYPES)
        if dtype is None:
            raise InvalidArgumentError(f"tensor {t.name!r}: dtype {t.dtype!r} is not an ISA dtype")
    else:
        dtype = t.dtype
    nbytes = rows * DTYPES[dtype].row_bytes(cols)
    if t.mx_axis is not None:
        srows, scols = (rows, cols // 32) if t.mx_axis == 1 else (rows // 32, cols)
        nbytes += srows * DTYPES["e8m0"].row_bytes(scols)
    return nbytes


@dataclass(frozen=True)
class ShapeKey:
    """One shape parameter of a kernel.

    Attributes:
        name: the key users pass (``--shape m=64``).
        type: int, float, str or bool.
        default: the small default used by ``kernel NAME`` and the tests.
        doc: one line.
        choices: allowed values for str keys (empty: any). A format key's choices are the ISA
            spellings ("fp4", "fp8e4", "bf16"); the MX spellings ("e2m1", "e4m3", "bfloat16")
            are accepted for them and normalised to the choice (``jalapeno_emu.mx.formats``).
        minimum: smallest allowed int (None: no bound).
        limit: the largest allowed value of an int or float key, with its reason; None takes the
            one of :data:`SHAPE_LIMITS` for this key's name (a numeric key must have one).
    """

    name: str
    type: type
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    limit: KeyLimit | None = None

    def __post_init__(self) -> None:
        if self.type in (int, float) and self.limit is None:
            if self.name not in SHAPE_LIMITS:
                # A new numeric key without a bound would let a typo run without end: refuse it
                # when the kernel module is imported, not when a user hits it.
                raise TypeError(f"shape key {self.name!r} has no limit: give it limit=KeyLimit(...) or "
                                "add its name to kernels.base.SHAPE_LIMITS")
            object.__setattr__(self, "limit", SHAPE_LIMITS[self.name])

    def parse(self, text: str, kernel: str = "") -> Any:
        """The value of ``text`` for this key (``kernel``: named in messages); InvalidArgumentError
        naming the key otherwise."""
        try:
            if self.type is bool:
                low = text.lower()
                if low not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(text)
                value: Any = low in ("1", "true", "yes")
            elif self.type is int:
                value = int(text, 0)
            elif self.type is float:
                value = float(text)
            else:
                value = text
        except ValueError:
            raise InvalidArgumentError(
                f"shape key {self.name}={_clipped(text)} is not a valid {self.type.__name__}") from None
        return self.normalize(value, kernel)

    def _typed(self, value: Any, kernel: str) -> Any:
        """``value`` as this key's type: an int for an int key (numpy integers and integral floats
        included), a finite float for a float key, a bool for a bool key, a str for a str key.

        Raises:
            InvalidTypeError: naming the key, the type wanted and the one found.
            InvalidArgumentError: a float key that is NaN or infinite.
        """
        where = f"kernel {kernel}: shape key" if kernel else "shape key"
        found = f"found {type(value).__name__} {short_repr(value)}"
        is_bool = isinstance(value, bool | np.bool_)
        if self.type is bool:
            if is_bool or (isinstance(value, numbers.Integral) and value in (0, 1)):
                return bool(value)
        elif self.type is int:
            if isinstance(value, numbers.Integral) and not is_bool:
                return int(value)
            if isinstance(value, numbers.Real) and not is_bool and math.isfinite(value) \
                    and float(value).is_integer():
                return int(value)  # 64.0 from arithmetic on sizes: the same size
        elif self.type is float:
            if isinstance(value, numbers.Real) and not is_bool:
                try:
                    as_float = float(value)
                except OverflowError:  # an int beyond any float
                    as_float = math.inf
                if not math.isfinite(as_float):
                    raise InvalidArgumentError(f"{where} {self.name}={short_repr(value)} must be a "
                                               "finite number")
                return as_float
        elif isinstance(value, str):
            return value
        raise InvalidTypeError(f"{where} {self.name} must be {self.type.__name__}, {found}"
                               + ("; give key=value strings as texts (KernelDef.shape(texts=...))"
                                  if isinstance(value, str) else ""))

    def normalize(self, value: Any, kernel: str = "") -> Any:
        """``value`` as this key stores it (its type; a format in its canonical spelling); raises
        like ``check``."""
        value = self._typed(value, kernel)
        if self.choices:
            canonical = canonical_format(value, self.choices)
            if canonical is None:
                raise InvalidArgumentError(
                    f"shape key {self.name}={value!r} is not one of {describe_formats(self.choices)}")
            value = canonical
        if self.minimum is not None and value < self.minimum:
            raise InvalidArgumentError(f"shape key {self.name}={value} must be >= {self.minimum}")
        if self.limit is not None:
            self.limit.check(kernel, self.name, value)
        return value

    def check(self, value: Any, kernel: str = "") -> None:
        """Raise InvalidArgumentError (InvalidTypeError for a wrong type) when ``value`` is not a
        value of this key or is out of its range (either format spelling)."""
        self.normalize(value, kernel)


@dataclass(frozen=True)
class Tolerance:
    """How close the functional result must be to the reference.

    The check passes when every element satisfies |got - want| <= atol + rtol * |want|.
    ``why`` says where the difference comes from (e.g. "bit-exact: same MX numerics",
    "exp differs in the last ulp between XLA's vector and scalar paths").
    """

    atol: float
    rtol: float
    why: str


@dataclass
class KernelBuild:
    """One kernel instance: the program plus what is needed to check it.

    Attributes:
        program: the Program (timing-only callers use just this).
        make_inputs: seed -> HBM allocation name -> host value (numpy array or MXArray).
        reference: inputs -> output allocation name -> expected numpy array (pure JAX math).
        outputs: output allocation name -> (dtype name, shape) to read back.
        tolerance: per-output tolerance.
        notes: free-form facts for reports (e.g. {"distinct_experts": 7}).
    """

    program: Program
    make_inputs: Callable[[int], dict[str, Any]]
    reference: Callable[[Mapping[str, Any]], dict[str, Any]]
    outputs: dict[str, tuple[str, tuple[int, ...]]]
    tolerance: Tolerance
    notes: dict[str, Any] = field(default_factory=dict)


ROLES = ("input", "output", "inout", "weight", "scratch")
"""What an HBM tensor of a kernel is for (``TensorSpec.role``):

- ``input`` / ``output``: activations, token-major ([tokens, features]); in a fused program they
  may be other operators' outputs on chip instead of HBM tensors;
- ``inout``: updated in place (a KV cache the kernel appends to);
- ``weight``: data the runtime provides (weights, caches read, RoPE tables, block tables);
- ``scratch``: written and read by the kernel itself (HBM staging between its phases).

Constants that depend only on the shape (masks, eps, identity tiles) are not listed: the emitter
allocates them with ``EmitCtx.const`` and records their values."""


@dataclass(frozen=True)
class TensorSpec:
    """One HBM tensor of a kernel, as its stand-alone program allocates it.

    Attributes:
        name: the allocation's name (``x``, ``w``, ``k_cache``, ...).
        shape: [rows, cols]: for activations the token-major shape the emitter accepts (which
            may differ from the stand-alone allocation's by a reshape of the same bytes).
        dtype: an ISA dtype (MX: the code dtype, with ``mx_axis``).
        role: one of ``ROLES``.
        mx_axis: the blocked axis of an MX tensor (codes ``name`` and scales ``name.scales``).
    """

    name: str
    shape: tuple[int, int]
    dtype: str
    role: str
    mx_axis: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"TensorSpec role {self.role!r} is not one of {ROLES}")


@dataclass(frozen=True)
class KernelDef:
    """A registered kernel.

    Attributes:
        name: CLI name ("gemm", "attention-decode", ...).
        doc: one paragraph: what it computes, how it is tiled, what bounds it.
        shape_keys: its shape parameters, with small defaults.
        build: (shape dict, chip spec) -> KernelBuild. Must raise InvalidArgumentError for
            impossible shapes before building anything. The function given is wrapped so that
            every call runs :meth:`check_shape` first (key types and limits, and the tensors
            against the preset's HBM), whoever calls it.
        emit: (ctx, shape, tensors, outs) -> an emitter (``kernels/emit.py``): the kernel
            emitted into a fused program, ``tensors`` mapping every name of ``tensors_of`` to a
            ``TensorRef`` and ``outs`` each output name to an ``Out``. None: the kernel only
            runs stand-alone.
        tensors_of: (shape, chip spec) -> the kernel's HBM tensors (``TensorSpec``), in the
            order the stand-alone program allocates them.
        timing_defaults: shape keys whose default differs when only timing runs (``kernel
            --timing-only``): a default that a functional run needs for correctness on any data
            (moe's ``routing=any``: every token in every expert slot, 32x the routed work at
            gpt-oss shapes) where timing wants the expected case (``routing=uniform``).
    """

    name: str
    doc: str
    shape_keys: tuple[ShapeKey, ...]
    build: Callable[[dict[str, Any], ChipSpec], KernelBuild]
    emit: Callable[..., Any] | None = None
    tensors_of: Callable[[dict[str, Any], ChipSpec], tuple[TensorSpec, ...]] | None = None
    timing_defaults: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        raw = self.build
        if getattr(raw, "_checks_shape", False):  # dataclasses.replace: check with the new keys
            raw = raw.__wrapped__  # type: ignore[attr-defined]

        # Every caller (the runner, the model planner, the rack's launch timer, the examples)
        # builds through ``kdef.build``: checking here refuses an oversized shape before any of
        # them spends minutes building it, whichever path it came by.
        @functools.wraps(raw)
        def build(shape: Mapping[str, Any], spec: ChipSpec | str) -> KernelBuild:
            if isinstance(spec, str):
                from jalapeno_emu.chip import load_preset

                spec = load_preset(spec)
            shape = self._completed(shape)
            self.check_shape(shape, spec)
            return raw(shape, spec)

        build._checks_shape = True  # type: ignore[attr-defined]
        object.__setattr__(self, "build", build)

    def _completed(self, shape: Mapping[str, Any]) -> dict[str, Any]:
        """``shape`` with its missing keys at their defaults and formats in the kernel's spelling
        (a library caller's ``{"m": 1, "weight_fmt": "e2m1"}`` builds as the CLI's would).

        Raises:
            InvalidArgumentError: a key the kernel does not have, or a value its key refuses.
        """
        keys = {k.name: k for k in self.shape_keys}
        unknown = sorted(set(shape) - set(keys))
        if unknown:
            raise InvalidArgumentError(
                f"kernel {self.name} has no shape key {unknown[0]!r}; keys: {sorted(keys)}")
        out = {name: k.default for name, k in keys.items() if name not in shape}
        for name, value in shape.items():
            out[name] = keys[name].normalize(value, self.name)
        return out

    def defaults(self, *, timing_only: bool = False) -> dict[str, Any]:
        """The default (small) shape; with ``timing_only``, updated with ``timing_defaults``."""
        shape = {k.name: k.default for k in self.shape_keys}
        if timing_only:
            shape.update(self.timing_defaults)
        return shape

    def check_shape(self, shape: Mapping[str, Any], spec: ChipSpec | None = None) -> None:
        """Refuse, in microseconds, a shape this kernel must not be built at: a value of the wrong
        type or beyond its key's limit (:data:`SHAPE_LIMITS`), and with ``spec`` HBM tensors
        (``tensors_of``) that add up to more than the chip's HBM (the builder would refuse the
        same shape, but only after planning and emitting everything before the allocation).

        Keys the kernel does not have are left to the kernel's build, as are shapes its
        ``tensors_of`` refuses (the build's own message says why).

        Raises:
            InvalidTypeError: a value of the wrong type, naming the key.
            InvalidArgumentError: a value beyond its key's limit, naming the key and the limit.
            DoesNotFit: the tensors exceed HBM, naming the keys raised above their defaults, the
                bytes and the capacity.
        """
        keys = {k.name: k for k in self.shape_keys}
        for name, value in shape.items():
            if name in keys:
                keys[name].check(value, self.name)
        if spec is not None and self.tensors_of is not None and keys.keys() <= shape.keys():
            self._check_hbm(shape, spec)

    def _check_hbm(self, shape: Mapping[str, Any], spec: ChipSpec) -> None:
        from jalapeno_emu.errors import EmuError

        from .planning import DoesNotFit  # planning imports the chip layer only; loaded on use

        try:
            tensors = self.tensors_of(dict(shape), spec)  # type: ignore[misc]
        except EmuError:
            return  # an impossible shape: the build says why, in the kernel's words
        sizes = sorted(((hbm_tensor_bytes(t), t) for t in tensors), key=lambda st: -st[0])
        need = sum(n for n, _ in sizes)
        capacity = spec.hbm.capacity_bytes
        if need <= capacity:
            return
        defaults = self.defaults()
        # The keys set above their (small) defaults are the ones to reduce, the most raised first.
        raised = sorted((k.name for k in self.shape_keys
                         if k.type is int and shape[k.name] > defaults[k.name]),
                        key=lambda n: -shape[n] / max(defaults[n], 1))
        named = " ".join(f"{n}={short_repr(shape[n])}" for n in raised) or "the default shape"
        largest = ", ".join(f"{t.name} {list(t.shape)} {t.dtype} {format_quantity(n, 'B')}"
                            for n, t in sizes[:3])
        raise DoesNotFit(
            f"kernel {self.name}: {named} needs {need:,} B ({format_quantity(need, 'B')}) of HBM for its "
            f"tensors, more than the {capacity:,} B ({format_quantity(capacity, 'B')}) of {spec.name} "
            f"(largest: {largest})",
            hint=f"reduce {', '.join(raised)}, or use a preset with more HBM" if raised
            else "use a preset with more HBM")

    def shape(self, overrides: Mapping[str, Any] | None = None,
              texts: list[str] | tuple[str, ...] = (), *, timing_only: bool = False) -> dict[str, Any]:
        """Default shape (``timing_only``: with ``timing_defaults``) updated with typed
        ``overrides`` and ``key=value`` ``texts``.

        Format keys come back in the kernel's spelling whichever one was given (``act_fmt="e4m3"``
        is stored as ``"fp8e4"``), so builds, plans and reports see one name per format.
        """
        keys = {k.name: k for k in self.shape_keys}
        shape = self.defaults(timing_only=timing_only)
        for name, value in (overrides or {}).items():
            if name not in keys:
                raise InvalidArgumentError(
                    f"kernel {self.name} has no shape key {name!r}; keys: {sorted(keys)}")
            shape[name] = keys[name].normalize(value, self.name)
        for text in texts:
            name, sep, raw = text.partition("=")
            if not sep:
                raise InvalidArgumentError(f"--shape {text!r} is not key=value")
            if name not in keys:
                raise InvalidArgumentError(
                    f"kernel {self.name} has no shape key {name!r}; keys: {sorted(keys)}")
            shape[name] = keys[name].parse(raw, self.name)
        return shape
