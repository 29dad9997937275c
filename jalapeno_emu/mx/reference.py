"""Generates ``docs/mx-formats.md``, the format reference, from the format table.

Run ``python -m jalapeno_emu.mx.reference > docs/mx-formats.md``; a test fails when the file and
the table drift apart.
"""

from __future__ import annotations

from jalapeno_emu.mx.formats import FORMATS, SCALE_BIAS, ElementFormat, format_spellings

_SPECIALS = {
    "e2m1": "none (no Inf, no NaN)",
    "e2m3": "none (no Inf, no NaN)",
    "e3m2": "none (no Inf, no NaN)",
    "e4m3": "NaN = S.1111.111; no Inf",
    "e5m2": "Inf = S.11111.00, NaN = S.11111.{01,10,11}",
    "int8": "none",
}


def _fmt_value(v) -> str:
    return f"{float(v):g}"


def _block(f: ElementFormat) -> list[str]:
    lines = [f"## `{f.name}`" + (" (MXINT8)" if f.is_int else ""), ""]
    if f.is_int:
        lines.append("- encoding: 8-bit two's complement, value = int8 / 64")
    else:
        lines.append(f"- encoding: `0b{'S' + 'E' * f.ebits + 'M' * f.mbits}` in the low "
                     f"{f.bits} bits of a uint8 code; exponent bias {f.bias}")
    others = [name for name in format_spellings(f.name) if name != f.name]
    if others:
        lines.append(f"- also spelled: {', '.join(f'`{n}`' for n in others)}")
    lines += [
        f"- emax (OCP): {f.emax}; largest magnitude: {_fmt_value(f.decode(f.max_code_mag))} "
        f"(code 0x{f.max_code_mag:02X})",
        f"- smallest normal: 2^{f.emin}; smallest subnormal (quantum): 2^{f.unit_exp}",
        f"- special values: {_SPECIALS[f.name]}",
        "- out of range after scaling: saturates to +-largest magnitude, sign kept",
        f"- mantissa width used by scale_mode='even': {f.rounding_mbits}",
    ]
    if f.ml_dtype is not None and not f.is_int:
        lines.append(f"- same encoding as `ml_dtypes.{f.ml_dtype.__name__}`")
    if f.bits <= 6:
        values = ", ".join(_fmt_value(f.decode(c)) for c in range(f.max_code_mag + 1))
        lines += ["", f"Non-negative values (codes 0x00 .. 0x{f.max_code_mag:02X}): {values}"]
    return [*lines, ""]


def format_reference_markdown() -> str:
    """The whole reference page as Markdown text."""
    out = [
        "# MX element formats (generated)",
        "",
        "Generated from `jalapeno_emu/mx/formats.py` by `python -m jalapeno_emu.mx.reference`;",
        "do not edit by hand.",
        "",
        f"Shared scales are E8M0: byte b means 2^(b - {SCALE_BIAS}); 0xFF is NaN for the whole",
        "block. Scale exponents are clamped to [-127, 127].",
        "",
    ]
    for f in FORMATS.values():
        out += _block(f)
    return "\n".join(out)


if __name__ == "__main__":
    print(format_reference_markdown(), end="")
