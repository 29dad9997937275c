"""What every kernel provides: shape keys, a Program builder, inputs, a pure-JAX reference.

Stage: kernels (on top of the ISA builder and the emulator). A kernel is registered once as a
``KernelDef``; ``kernels.runner`` checks it, times it (timing-only at any size) and, with
``check=True``, runs it functionally and compares with its reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.program import Program
from jalapeno_emu.mx.formats import canonical_format, describe_formats

__all__ = ["ROLES", "KernelBuild", "KernelDef", "ShapeKey", "TensorSpec", "Tolerance"]


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
    """

    name: str
    type: type
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    minimum: int | None = None

    def parse(self, text: str) -> Any:
        """The value of ``text`` for this key; InvalidArgumentError naming the key otherwise."""
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
                f"shape key {self.name}={text!r} is not a valid {self.type.__name__}") from None
        return self.normalize(value)

    def normalize(self, value: Any) -> Any:
        """``value`` as this key stores it (a format in its canonical spelling); raises like ``check``."""
        if self.choices:
            canonical = canonical_format(value, self.choices)
            if canonical is None:
                raise InvalidArgumentError(
                    f"shape key {self.name}={value!r} is not one of {describe_formats(self.choices)}")
            value = canonical
        if self.minimum is not None and value < self.minimum:
            raise InvalidArgumentError(f"shape key {self.name}={value} must be >= {self.minimum}")
        return value

    def check(self, value: Any) -> None:
        """Raise InvalidArgumentError when ``value`` is out of this key's range (either format spelling)."""
        self.normalize(value)


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
            impossible shapes before building anything.
        emit: (ctx, shape, tensors, outs) -> an emitter (``kernels/emit.py``): the kernel
            emitted into a fused program, ``tensors`` mapping every name of ``tensors_of`` to a
            ``TensorRef`` and ``outs`` each output name to an ``Out``. None: the kernel only
            runs stand-alone.
        tensors_of: (shape, chip spec) -> the kernel's HBM tensors (``TensorSpec``), in the
            order the stand-alone program allocates them.
    """

    name: str
    doc: str
    shape_keys: tuple[ShapeKey, ...]
    build: Callable[[dict[str, Any], ChipSpec], KernelBuild]
    emit: Callable[..., Any] | None = None
    tensors_of: Callable[[dict[str, Any], ChipSpec], tuple[TensorSpec, ...]] | None = None

    def defaults(self) -> dict[str, Any]:
        """The default (small) shape."""
        return {k.name: k.default for k in self.shape_keys}

    def shape(self, overrides: Mapping[str, Any] | None = None,
              texts: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
        """Default shape updated with typed ``overrides`` and ``key=value`` ``texts``.

        Format keys come back in the kernel's spelling whichever one was given (``act_fmt="e4m3"``
        is stored as ``"fp8e4"``), so builds, plans and reports see one name per format.
        """
        keys = {k.name: k for k in self.shape_keys}
        shape = self.defaults()
        for name, value in (overrides or {}).items():
            if name not in keys:
                raise InvalidArgumentError(
                    f"kernel {self.name} has no shape key {name!r}; keys: {sorted(keys)}")
            shape[name] = keys[name].normalize(value)
        for text in texts:
            name, sep, raw = text.partition("=")
            if not sep:
                raise InvalidArgumentError(f"--shape {text!r} is not key=value")
            if name not in keys:
                raise InvalidArgumentError(
                    f"kernel {self.name} has no shape key {name!r}; keys: {sorted(keys)}")
            shape[name] = keys[name].parse(raw)
        return shape
