"""Element formats of OCP Microscaling (MX) v1.0, derived from one parameter table.

Stage: numerics (the bottom of the pipeline). Everything else that touches MX data reads these
rows: the quantiser, the matmul, later the ISA's legality rules.

Bit layout (as ml_dtypes lays it out): the element's bit pattern sits in the low bits of a uint8
code, sign bit at bit ``ebits + mbits``. INT8 (MXINT8) is two's complement with an implied scale
of 2^-6 (value = int8 / 64). E8M0 scale byte ``b`` means 2^(b - 127); 0xFF is NaN.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

from jalapeno_emu.errors import InvalidArgumentError

__all__ = [
    "FORMATS",
    "FORMAT_SPELLINGS",
    "SCALE_BIAS",
    "SCALE_NAN",
    "ElementFormat",
    "canonical_format",
    "describe_formats",
    "element_format",
    "format_spellings",
]

SCALE_BIAS = 127
"""E8M0 exponent bias: scale byte b means 2^(b - SCALE_BIAS)."""
SCALE_NAN = 0xFF
"""The E8M0 byte that means NaN for its whole block."""
SCALE_EXP_MIN = -127
SCALE_EXP_MAX = 127


@dataclass(frozen=True, kw_only=True)
class ElementFormat:
    """One MX element format.

    Attributes:
        name: the short name used everywhere ("e2m1", ..., "int8").
        ebits: exponent bits (0 for int8).
        mbits: mantissa (fraction) bits; for int8 the 7 magnitude bits are not a mantissa and
            ``mbits`` is 0.
        bias: exponent bias (0 for int8).
        max_code_mag: the code, sign bit clear, of the largest finite magnitude (saturation target).
        is_int: True for MXINT8.
        ml_dtype_name: "module.type" of the scalar type with the same element encoding (an
            ml_dtypes type; numpy's int8 for int8), or None; :attr:`ml_dtype` is the type.
        even_mbits: mantissa width that scale_mode="even" rounds amax to (int8: 6, since 127/64 is
            1.111111b).
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    max_code_mag: int
    is_int: bool = False
    ml_dtype_name: str | None = None
    even_mbits: int = -1

    @property
    def ml_dtype(self) -> type | None:
        """The scalar type with the same element encoding (see ``ml_dtype_name``), or None. Its
        module loads here, on first use: importing ml_dtypes costs about 0.5 s, which every
        process (each sweep worker) would pay at start-up for numerics it may never run."""
        if self.ml_dtype_name is None:
            return None
        module, _, name = self.ml_dtype_name.rpartition(".")
        return getattr(importlib.import_module(module), name)

    @property
    def bits(self) -> int:
        """Width of one element in bits (4, 6 or 8)."""
        return 8 if self.is_int else 1 + self.ebits + self.mbits

    @property
    def sign_bit(self) -> int:
        """Bit position of the sign in a code (7 for int8, whose sign is two's complement)."""
        return 7 if self.is_int else self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal (int8: exponent of its quantum, -6)."""
        return -6 if self.is_int else 1 - self.bias

    @property
    def unit_exp(self) -> int:
        """Every element value is an integer multiple of 2^unit_exp (the smallest subnormal)."""
        return -6 if self.is_int else self.emin - self.mbits

    @property
    def max_units(self) -> int:
        """Largest magnitude as an integer multiple of 2^unit_exp."""
        if self.is_int:
            return self.max_code_mag
        e_field = self.max_code_mag >> self.mbits
        frac = self.max_code_mag & ((1 << self.mbits) - 1)
        return ((1 << self.mbits) + frac) << (e_field - 1)

    @property
    def max_normal(self) -> float:
        """Largest finite magnitude (exact)."""
        return float(Fraction(self.max_units) * Fraction(2) ** self.unit_exp)

    @property
    def emax(self) -> int:
        """floor(log2(max_normal)): the OCP ``emax`` the floor scale rule subtracts."""
        return self.max_units.bit_length() - 1 + self.unit_exp

    @property
    def rounding_mbits(self) -> int:
        """Mantissa width used by scale_mode="even"."""
        return self.even_mbits if self.even_mbits >= 0 else self.mbits

    def decode(self, code: int) -> Fraction:
        """Exact value of one element code (no scale), as a Fraction; NaN/Inf codes raise."""
        code &= 0xFF
        if self.is_int:
            return Fraction(code - 256 if code >= 128 else code, 64)
        sign = -1 if (code >> self.sign_bit) & 1 else 1
        mag = code & ((1 << self.sign_bit) - 1)
        if mag > self.max_code_mag:
            raise InvalidArgumentError(f"code {code:#04x} of {self.name} is NaN or Inf")
        e_field, frac = mag >> self.mbits, mag & ((1 << self.mbits) - 1)
        units = frac if e_field == 0 else ((1 << self.mbits) + frac) << (e_field - 1)
        return sign * Fraction(units) * Fraction(2) ** self.unit_exp


# The table: every other property is derived from these rows.
FORMATS: dict[str, ElementFormat] = {
    f.name: f
    for f in (
        ElementFormat(name="e2m1", ebits=2, mbits=1, bias=1, max_code_mag=0b111,
                      ml_dtype_name="ml_dtypes.float4_e2m1fn"),
        ElementFormat(name="e2m3", ebits=2, mbits=3, bias=1, max_code_mag=0b11111,
                      ml_dtype_name="ml_dtypes.float6_e2m3fn"),
        ElementFormat(name="e3m2", ebits=3, mbits=2, bias=3, max_code_mag=0b11111,
                      ml_dtype_name="ml_dtypes.float6_e3m2fn"),
        # E4M3: S.1111.111 is NaN, so the largest finite magnitude is S.1111.110 = 448.
        ElementFormat(name="e4m3", ebits=4, mbits=3, bias=7, max_code_mag=0b1111110,
                      ml_dtype_name="ml_dtypes.float8_e4m3fn"),
        # E5M2: exponent field 31 is Inf/NaN, as in IEEE; the largest finite is 57344.
        ElementFormat(name="e5m2", ebits=5, mbits=2, bias=15, max_code_mag=0b1111011,
                      ml_dtype_name="ml_dtypes.float8_e5m2"),
        # MXINT8 saturates symmetrically to +-127/64; -128 is never produced.
        ElementFormat(name="int8", ebits=0, mbits=0, bias=0, max_code_mag=127, is_int=True,
                      ml_dtype_name="numpy.int8", even_mbits=6),
    )
}


# The one table of format spellings. This package names element formats by their bit layout
# ("e2m1"); the ISA, the kernels' shape keys and the model configs name the stored type ("fp4",
# "fp8e4", "bf16"). Users meet both, so every boundary accepts either spelling and normalises to
# its own layer's canonical one (``canonical_format``); internal code and JSON outputs keep using
# the canonical names. The ISA's ``DTYPES[...].mx_fmt`` must agree with these rows (tested).
FORMAT_SPELLINGS: tuple[tuple[str, ...], ...] = (
    ("e2m1", "fp4"),  # MXFP4 elements
    ("e2m3", "fp6e2"),  # MXFP6 elements (no ISA type yet)
    ("e3m2", "fp6e3"),
    ("e4m3", "fp8e4"),  # MXFP8 elements
    ("e5m2", "fp8e5"),
    ("bf16", "bfloat16"),  # not an MX format: kernels take it where they take fp4/fp8e4
)
_SPELLING_GROUP: dict[str, tuple[str, ...]] = {name: group for group in FORMAT_SPELLINGS for name in group}


def format_spellings(name: str) -> tuple[str, ...]:
    """Every spelling of the format ``name`` (``("e2m1", "fp4")`` for either); ``(name,)`` if it has one."""
    return _SPELLING_GROUP.get(name, (name,)) if isinstance(name, str) else ()


def canonical_format(value: object, choices: Iterable[str]) -> str | None:
    """The member of ``choices`` that names the same format as ``value``, or None.

    ``choices`` are one layer's canonical names (``FORMATS`` here; ``("fp4", "fp8e4", "bf16")``
    for a kernel shape key), so ``canonical_format("e4m3", ("bf16", "fp8e4"))`` is ``"fp8e4"``
    and ``canonical_format("fp8e4", FORMATS)`` is ``"e4m3"``. Spelling is case-sensitive.
    """
    if not isinstance(value, str):
        return None
    if value in choices:  # the common case: already canonical, no alias lookup
        return value
    for spelling in _SPELLING_GROUP.get(value, ()):
        if spelling in choices:
            return spelling
    return None


def describe_formats(choices: Iterable[str]) -> str:
    """``choices`` for a message, each with its other spellings: "fp4 (or e2m1), bf16 (or bfloat16)"."""
    parts = []
    for name in choices:
        others = [s for s in format_spellings(name) if s != name]
        parts.append(f"{name} (or {', '.join(others)})" if others else name)
    return ", ".join(parts)


def element_format(fmt: str | ElementFormat, *, argname: str = "fmt") -> ElementFormat:
    """Look up an element format by name, in either spelling (``"e2m1"`` or ``"fp4"``).

    Args:
        fmt: a format name (see ``FORMATS`` and ``FORMAT_SPELLINGS``) or an ``ElementFormat``.
        argname: the caller's argument name, used in the error message.

    Raises:
        InvalidArgumentError: the name is unknown (also for a non-string).
    """
    if isinstance(fmt, ElementFormat):
        return fmt
    name = canonical_format(fmt, FORMATS)
    if name is None:
        raise InvalidArgumentError(
            f"{argname}={fmt!r} is not an MX element format; expected one of "
            f"{describe_formats(FORMATS)}"
        )
    return FORMATS[name]
