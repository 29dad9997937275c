"""run_functional takes each input only as exactly the tensor the program recorded for it: a wrong
shape, a transposed array, another dtype or another MX format is refused, naming the tensor,
what it is and what was given, instead of being converted into garbage."""

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jalapeno_emu import mx
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.errors import InvalidArgumentError
from tests.emu.programs import matmul_tile_program, vector_program


def _x(rows: int = 8, cols: int = 64, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((rows, cols)).astype(dtype)


def _mx_inputs(m: int = 32, k: int = 128, n: int = 64) -> tuple[mx.MXArray, mx.MXArray]:
    rng = np.random.default_rng(1)
    a = mx.quantize(rng.standard_normal((m, k)).astype(np.float32), axis=1)
    b = mx.quantize(rng.standard_normal((k, n)).astype(np.float32), axis=0)
    return a, b


@pytest.mark.parametrize(("given", "said"), [
    (_x(8, 32), "float32 array of shape (8, 32)"),            # a slice: too few columns
    (_x(16, 64), "float32 array of shape (16, 64)"),          # too many rows
    (_x(8, 64).reshape(-1), "float32 array of shape (512,)"),  # flattened
    (np.float32(1.0), "float32 array of shape ()"),
])
def test_a_wrong_shape_is_refused_naming_the_tensor(given, said):
    with pytest.raises(InvalidArgumentError) as err:
        run_functional(vector_program("add"), {"X": _x(), "Y": given})
    msg = str(err.value)
    assert "input 'Y'" in msg and "f32 [8, 64]" in msg and said in msg


def test_a_transposed_array_is_refused_with_a_hint():
    with pytest.raises(InvalidArgumentError, match=r"'X'.*f32 \[8, 64\].*shape \(64, 8\)") as err:
        run_functional(vector_program("add"), {"X": _x(64, 8), "Y": _x()})
    assert "transpose" in err.value.hint


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32, ml_dtypes.bfloat16, np.uint8])
def test_a_wrong_dtype_is_refused_naming_both(dtype):
    with pytest.raises(InvalidArgumentError) as err:
        run_functional(vector_program("add"), {"X": _x(dtype=dtype), "Y": _x()})
    msg = str(err.value)
    assert "input 'X'" in msg and "a float32 array of shape (8, 64)" in msg
    assert f"given a {np.dtype(dtype)} array" in msg and "astype" in err.value.hint


def test_f32_values_are_not_rounded_into_a_bf16_tensor():
    with pytest.raises(InvalidArgumentError, match=r"'X'.*bf16 \[8, 64\].*bfloat16.*given a float32"):
        run_functional(vector_program("copy", dtype="bf16"), {"X": _x(), "Y": _x()})


def test_exact_inputs_in_any_array_form_give_identical_results():
    x, y = _x(), _x() + 1
    prog = vector_program("add")
    want = run_functional(prog, {"X": x, "Y": y}).buffers
    wide = np.zeros((8, 128), np.float32)
    wide[:, 32:96] = x  # a strided view of the right shape and dtype
    for xs in (wide[:, 32:96], np.asfortranarray(x), jnp.asarray(x)):
        got = run_functional(prog, {"X": xs, "Y": y}).buffers
        assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in want.items()}
    xb = x.astype(ml_dtypes.bfloat16)
    bf = vector_program("copy", dtype="bf16")
    assert np.array_equal(run_functional(bf, {"X": jnp.asarray(xb)}).read("Z").view(np.uint16),
                          run_functional(bf, {"X": xb}).read("Z").view(np.uint16))


def test_an_mx_tensor_takes_an_mxarray_its_codes_or_raw_scale_bytes_alike():
    a, b = _mx_inputs()
    prog = matmul_tile_program()
    want = run_functional(prog, {"A": a, "B": b}).read("C")
    parts = {"A": np.asarray(a.codes), "A.scales": np.asarray(a.scales).reshape(-1),  # raw bytes
             "B": np.asarray(b.codes), "B.scales": np.asarray(b.scales)}
    got = run_functional(prog, parts).read("C")
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_mx_inputs_of_another_format_shape_or_axis_are_refused():
    a, b = _mx_inputs()
    prog = matmul_tile_program()
    rng = np.random.default_rng(2)
    fp8 = mx.quantize(rng.standard_normal((32, 128)).astype(np.float32), "e4m3", axis=1)
    with pytest.raises(InvalidArgumentError, match=r"input 'A'.*fp4 \[32, 128\].*MXArray \(e4m3"):
        run_functional(prog, {"A": fp8, "B": b})
    with pytest.raises(InvalidArgumentError, match=r"input 'B'.*fp4 \[128, 64\].*shape \(64, 128\)"):
        run_functional(prog, {"A": a, "B": mx.quantize(rng.standard_normal((64, 128)).astype(np.float32),
                                                      axis=0)})
    other_axis = mx.quantize(rng.standard_normal((128, 64)).astype(np.float32), axis=1)
    with pytest.raises(InvalidArgumentError, match=r"input 'B'.*'B.scales' are \(4, 64\).*\(128, 2\)"):
        run_functional(prog, {"A": a, "B": other_axis})
    with pytest.raises(InvalidArgumentError, match=r"input 'A'.*uint8 codes.*given a float32"):
        run_functional(prog, {"A": np.asarray(a.codes, np.float32), "B": b})
    with pytest.raises(InvalidArgumentError, match=r"input 'X'.*f32 \[8, 64\].*given an MXArray"):
        run_functional(vector_program("add"), {"X": mx.quantize(_x(), axis=1), "Y": _x()})


def test_raw_bytes_must_be_the_whole_tensor():
    a, b = _mx_inputs()
    scales = np.asarray(a.scales).reshape(-1)
    with pytest.raises(InvalidArgumentError, match=r"'A.scales'.*e8m0 \[32, 4\].*128 raw bytes.*\(127,\)"):
        run_functional(matmul_tile_program(), {"A": a.codes, "A.scales": scales[:-1], "B": b})


def test_an_allocation_without_a_recorded_tensor_still_takes_bytes_up_to_its_size():
    prog = vector_program("add")
    bare = dataclasses.replace(prog, meta=())  # as an assembled program: no tensors recorded
    x, y = _x(), _x()
    got = run_functional(bare, {"X": x.view(np.uint8).reshape(-1), "Y": y.view(np.uint8)})
    assert np.array_equal(got.read("Z", "f32", (8, 64)), x + y)
    with pytest.raises(InvalidArgumentError, match="allocation holds"):
        run_functional(bare, {"X": np.zeros(8 * 64 * 4 + 1, np.uint8)})


def test_an_unknown_input_name_is_refused():
    with pytest.raises(InvalidArgumentError, match="no HBM allocation named 'W'"):
        run_functional(vector_program("add"), {"W": _x()})
