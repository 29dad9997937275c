"""The format table: finfo-style identities, every code against ml_dtypes, and the generated doc."""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jalapeno_emu import mx
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.mx.reference import format_reference_markdown

FLOAT_FORMATS = [f for f in mx.FORMATS.values() if not f.is_int]
# OCP MX v1.0 table 1/2: emax and largest normal of each element type.
OCP_EMAX_MAX = {"e2m1": (2, 6.0), "e2m3": (2, 7.5), "e3m2": (4, 28.0), "e4m3": (8, 448.0),
                "e5m2": (15, 57344.0), "int8": (0, 1.984375)}


@pytest.mark.parametrize("name", sorted(mx.FORMATS))
def test_emax_and_max_normal_match_ocp_table(name):
    f = mx.FORMATS[name]
    assert (f.emax, f.max_normal) == OCP_EMAX_MAX[name]


@pytest.mark.parametrize("f", FLOAT_FORMATS, ids=lambda f: f.name)
def test_float_format_identities(f):
    assert f.bits == 1 + f.ebits + f.mbits
    assert f.max_normal == float(ml_dtypes.finfo(f.ml_dtype).max)
    assert 2.0**f.unit_exp == float(ml_dtypes.finfo(f.ml_dtype).smallest_subnormal)
    assert 2.0**f.emin == float(ml_dtypes.finfo(f.ml_dtype).smallest_normal)


@pytest.mark.parametrize("f", FLOAT_FORMATS, ids=lambda f: f.name)
def test_every_finite_code_decodes_like_ml_dtypes(f):
    for code in range(1 << f.bits):
        if (code & ((1 << f.sign_bit) - 1)) > f.max_code_mag:
            with pytest.raises(InvalidArgumentError, match="NaN or Inf"):
                f.decode(code)
            continue
        want = float(np.array([code], np.uint8).view(f.ml_dtype)[0])
        assert float(f.decode(code)) == want, code


def test_int8_decodes_two_complement_over_64():
    f = mx.FORMATS["int8"]
    assert [float(f.decode(c)) for c in (0, 1, 127, 128, 255)] == [0, 1 / 64, 127 / 64, -2.0, -1 / 64]


def test_generated_format_reference_is_up_to_date():
    doc = Path(__file__).resolve().parents[2] / "docs" / "mx-formats.md"
    assert doc.read_text() == format_reference_markdown(), (
        "docs/mx-formats.md drifted from the format table; regenerate with "
        "`python -m jalapeno_emu.mx.reference > docs/mx-formats.md`"
    )
