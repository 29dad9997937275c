"""Every kernel shape key is bounded (issue 13): a size beyond its key's limit, or whose HBM tensors
exceed the preset's HBM, is refused in microseconds naming the key and the limit, whichever way the
kernel is built; overrides of the wrong type are project errors naming the key."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.cli.main import main
from jalapeno_emu.errors import InvalidArgumentError, InvalidTypeError
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.kernels import all_kernels, get_kernel, run_kernel
from jalapeno_emu.kernels.base import SHAPE_LIMITS, KeyLimit, ShapeKey
from jalapeno_emu.kernels.compose import Composer
from jalapeno_emu.kernels.planning import DoesNotFit
from tests.deadline import deadline

TINY = load_preset("tiny")


def _refused_fast(fn, error, *fragments):
    """``fn()`` raises ``error`` within a second, with every fragment in the message (without the
    limits some of these ran for hours: the deadline turns that into a failure)."""
    start = time.perf_counter()
    with deadline(20), pytest.raises(error) as info:
        fn()
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"refused after {elapsed:.2f} s"
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return info.value


def test_every_numeric_shape_key_of_every_kernel_has_a_limit_with_a_reason():
    for kdef in all_kernels():
        for key in kdef.shape_keys:
            if key.type in (int, float):
                assert key.limit is not None and key.limit.why, (kdef.name, key.name)
                # the small defaults are far inside the limits
                assert key.default <= key.limit.maximum, (kdef.name, key.name)


def test_a_numeric_key_without_a_limit_fails_when_declared():
    with pytest.raises(TypeError, match="no limit"):
        ShapeKey("no_such_key_name", int, 1, "a new key nobody bounded")
    bounded = ShapeKey("no_such_key_name", int, 1, "bounded here", limit=KeyLimit(8, "a test bound"))
    with pytest.raises(InvalidArgumentError, match=r"no_such_key_name=9 is above its limit of 8 \(a test"):
        bounded.check(9)
    assert "tokens" in SHAPE_LIMITS and "hidden" in SHAPE_LIMITS


def test_moe_hidden_beyond_its_limit_is_refused_at_once():
    # used to run without end (--timing-only --shape hidden=2147483648)
    moe = get_kernel("moe")
    _refused_fast(lambda: moe.shape(texts=["hidden=2147483648"]), InvalidArgumentError,
                  "kernel moe", "hidden=2147483648", "limit of 65,536")
    _refused_fast(lambda: run_kernel("moe", {"hidden": 2**31}, safety_checks=False), InvalidArgumentError,
                  "hidden=2147483648", "limit of 65,536")


def test_moe_tokens_beyond_its_limit_is_refused_at_once():
    # used to run without end (kernel moe --shape tokens=100000000)
    _refused_fast(lambda: run_kernel("moe", {"tokens": 100_000_000}), InvalidArgumentError,
                  "tokens=100000000", "limit of 1,048,576")


def test_a_build_that_bypasses_shape_is_checked_too():
    # The model planner, the rack's launch timer and the examples call kdef.build directly.
    moe = get_kernel("moe")
    shape = dict(moe.defaults(), tokens=100_000_000)
    _refused_fast(lambda: moe.build(shape, TINY), InvalidArgumentError, "tokens=100000000", "1,048,576")
    assert moe.build.__wrapped__ is not None  # the kernel's own build, kept for callers that need it


def test_tensors_beyond_the_presets_hbm_are_refused_before_building():
    logits = get_kernel("logits")
    shape = logits.shape({"vocab": 1_000_000, "hidden": 4096})  # 7.6 GiB of BF16 weights
    err = _refused_fast(lambda: logits.build(shape, TINY), DoesNotFit,
                        "vocab=1000000", "hidden=4096", "8,200,032,768 B", "67,108,864 B", "of tiny")
    assert "w [4096, 1000000] bf16" in str(err) and "reduce vocab, hidden" in err.hint
    # the same shape fits a preset with 216 GiB (checked only, not built)
    logits.check_shape(shape, load_preset("jalapeno-v1"))


@pytest.mark.parametrize(("kernel", "overrides", "fragment"), [
    ("gemm", {"m": "16"}, "shape key m must be int, found str '16'"),
    ("gemm", {"m": True}, "shape key m must be int, found bool"),
    ("gemm", {"m": 16.5}, "shape key m must be int, found float 16.5"),
    ("gemm", {"bias": "yes"}, "shape key bias must be bool, found str"),
    ("gemm", {"weight_fmt": 4}, "shape key weight_fmt must be str, found int"),
    ("rmsnorm", {"eps": "1e-5"}, "shape key eps must be float, found str"),
    ("rmsnorm", {"eps": None}, "shape key eps must be float, found NoneType"),
])
def test_overrides_of_the_wrong_type_are_project_errors_naming_the_key(kernel, overrides, fragment):
    # {"m": "16"} used to raise a bare TypeError from comparing "16" < 1
    with pytest.raises(InvalidTypeError, match=f"kernel {kernel}: ") as info:
        get_kernel(kernel).shape(overrides)
    assert fragment in str(info.value)


def test_numpy_integers_and_whole_floats_are_sizes():
    shape = get_kernel("gemm").shape({"m": np.int64(32), "n": 256.0})
    assert shape["m"] == 32 and type(shape["m"]) is int and type(shape["n"]) is int


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 10**400],
                         ids=["nan", "inf", "-inf", "10**400"])
def test_float_keys_must_be_finite(value):
    with pytest.raises(InvalidArgumentError, match=r"capacity_factor=.* must be a finite number"):
        get_kernel("moe").shape({"capacity_factor": value})


def test_float_keys_have_limits_too():
    with pytest.raises(InvalidArgumentError, match=r"routed_scaling_factor=1e\+30 is above its limit of"):
        get_kernel("moe").shape({"routed_scaling_factor": 1e30})


def test_a_shape_text_of_thousands_of_digits_is_refused():
    with pytest.raises(InvalidArgumentError, match=r"shape key tokens=.* is not a valid int"):
        get_kernel("rmsnorm").shape(texts=["tokens=" + "9" * 5000])


def test_a_fused_operator_is_checked_before_planning():
    comp = Composer(KernelBuilder("fused", chip=TINY), TINY)
    shape = dict(get_kernel("rmsnorm").defaults(), tokens=10**9)
    _refused_fast(lambda: comp.add_kernel("n", "rmsnorm", shape), InvalidArgumentError, "tokens=1000000000")


def test_cli_refuses_an_oversized_shape_with_one_line(capsys):
    start = time.perf_counter()
    with deadline(20):
        assert main(["kernel", "moe", "--timing-only", "--shape", "hidden=2147483648"]) == 2
    assert time.perf_counter() - start < 1.0
    err = capsys.readouterr().err
    assert err.startswith("error: kernel moe: shape key hidden=2147483648 is above its limit of 65,536")
    assert "Traceback" not in err


def test_a_library_build_fills_defaults_takes_either_spelling_and_a_preset_name():
    gemm = get_kernel("gemm")
    full = gemm.build(gemm.shape({"m": 1, "n": 256, "k": 256, "weight_fmt": "fp4"}), load_preset("tiny"))
    partial = gemm.build({"m": 1, "n": 256, "k": 256, "weight_fmt": "e2m1"}, "tiny")
    assert partial.program == full.program
    with pytest.raises(InvalidArgumentError, match="no shape key 'bogus'"):
        gemm.build({"m": 1, "bogus": 3}, "tiny")
    with pytest.raises(InvalidArgumentError, match="weight_fmt='e9m9'"):
        gemm.build({"weight_fmt": "e9m9"}, "tiny")
