"""Issue 13, one vocabulary for formats: "e2m1" and "fp4" (and each other pair) name one format
everywhere, give identical results, and come out in each layer's own spelling."""

import jax.numpy as jnp
import numpy as np
import pytest

from jalapeno_emu import mx
from jalapeno_emu.chip import load_preset
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.table import DTYPES
from jalapeno_emu.kernels import get_kernel
from jalapeno_emu.mx.formats import FORMAT_SPELLINGS, canonical_format

MX_PAIRS = [(g[0], g[1]) for g in FORMAT_SPELLINGS if g[0] in mx.FORMATS]
X = jnp.asarray(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32) * 10)


@pytest.mark.parametrize(("mx_name", "isa_name"), MX_PAIRS)
def test_quantize_is_bit_identical_in_either_spelling(mx_name, isa_name):
    a, b = mx.quantize(X, mx_name), mx.quantize(X, isa_name)
    assert a.fmt == b.fmt == mx_name  # the MX layer's canonical name, whatever was given
    assert np.array_equal(a.codes, b.codes) and np.array_equal(a.scales, b.scales)
    assert mx.element_format(isa_name) is mx.FORMATS[mx_name]


def test_mxarray_matmul_and_dequantize_take_either_spelling():
    q = mx.quantize(X, "fp4")
    alias = mx.MXArray(codes=q.codes, scales=q.scales, fmt="fp4", axis=q.axis)
    assert alias == q  # fmt normalised at construction: same pytree, same jit cache entry
    assert np.array_equal(mx.dequantize(alias), mx.dequantize(q))
    a, b = mx.quantize(X, "fp8e4", axis=1), mx.quantize(X.T, "e4m3", axis=0)
    assert np.array_equal(mx.matmul(a, b), mx.matmul(mx.quantize(X, "e4m3", axis=1), b))
    assert mx.block_sum_is_exact_in_f32("fp4", "e2m1") == mx.block_sum_is_exact_in_f32("e2m1", "e2m1")


def test_the_isa_dtypes_agree_with_the_spelling_table():
    for d in DTYPES.values():
        if d.mx_fmt is not None:
            assert canonical_format(d.mx_fmt, DTYPES) == d.name
            assert canonical_format(d.name, mx.FORMATS) == d.mx_fmt


def test_unknown_formats_list_both_spellings():
    with pytest.raises(InvalidArgumentError, match=r"e2m1 \(or fp4\).*e4m3 \(or fp8e4\)"):
        mx.quantize(X, "fp16")
    with pytest.raises(InvalidArgumentError, match=r"fp8e4 \(or e4m3\), fp4 \(or e2m1\)"):
        get_kernel("gemm").shape({"act_fmt": "fp16"})
    with pytest.raises(InvalidArgumentError, match="fmt"):  # spelling stays case-sensitive
        mx.quantize(X, "FP4")


@pytest.mark.parametrize(
    ("kernel", "key", "alias", "canonical"),
    [
        ("gemm", "act_fmt", "e4m3", "fp8e4"),
        ("gemm", "act_fmt", "e2m1", "fp4"),
        ("gemm", "weight_fmt", "e2m1", "fp4"),
        ("gemm", "act_fmt", "bfloat16", "bf16"),
        ("moe", "act_fmt", "e4m3", "fp8e4"),
        ("attention-decode", "kv_dtype", "e4m3", "fp8e4"),
    ],
)
def test_kernel_shape_keys_take_either_spelling_and_keep_their_own(kernel, key, alias, canonical):
    kdef = get_kernel(kernel)
    want = kdef.shape({key: canonical})
    assert kdef.shape({key: alias}) == want  # typed overrides (library callers)
    assert kdef.shape(texts=[f"{key}={alias}"]) == want  # --shape text
    assert want[key] == canonical  # reports and JSON print the kernel's spelling


def test_a_gemm_built_from_either_spelling_is_the_same_program():
    # timing-only build; the program's name carries the formats, so it shows the normalisation.
    kdef = get_kernel("gemm")
    spec = load_preset("tiny")
    a = kdef.build(kdef.shape({"act_fmt": "e4m3", "weight_fmt": "e2m1"}), spec).program
    b = kdef.build(kdef.shape({"act_fmt": "fp8e4", "weight_fmt": "fp4"}), spec).program
    assert a.name == b.name and len(a.instructions) == len(b.instructions)


def test_the_builder_takes_either_spelling():
    kb = KernelBuilder("spellings")
    t = kb.sram_mx(0, "x", (32, 64), "e4m3")
    assert t.codes.dtype == "fp8e4"
    assert kb.hbm("y", (4, 32), "bfloat16").dtype == "bf16"
    with pytest.raises(InvalidArgumentError, match=r"fp4 \(or e2m1\)"):
        kb.sram_mx(0, "z", (32, 64), "bf16")
