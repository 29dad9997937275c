"""The first contents of a functional run's memory: the program's inputs, checked, as bytes.

Stage: emulator (memory), for ``functional.py``. An input must be exactly the tensor the program
recorded for its HBM allocation (shape, element dtype, MX format and axis): a host array of any
other shape or dtype would be reinterpreted into the allocation without complaint. ``.init``
fills are written first, then the inputs; on-chip memory starts uniform (zeros, or 0xFF bytes
with ``debug``). The backing arrays are ``memory_layout.MemoryLayout``'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jalapeno_emu.emu.memory_layout import MemoryLayout
from jalapeno_emu.emu.result import host_dtype
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.program import Allocation, Program
from jalapeno_emu.isa.table import DTYPES, Space
from jalapeno_emu.mx.array import MXArray

__all__ = ["State", "initial_state"]

State = dict[str, Any]  # array name -> bytes: a jax.Array, or a numpy array not yet read


def _hbm_alloc(program: Program, name: str, by_name: Mapping[str, Allocation]) -> Allocation:
    """HBM allocation ``name``; ``by_name`` is ``_hbm_by_name(program)``, looked up once per run
    by the caller (each lookup of that cache compares programs that are equal but not the same
    object field by field: 5 ms of a tiny decode step when done per input)."""
    hit = by_name.get(name)
    if hit is not None:
        return hit
    names = sorted(a.name for a in program.allocations if a.space is Space.HBM)
    raise InvalidArgumentError(f"no HBM allocation named {name!r}; the program has {names}")


@functools.lru_cache(maxsize=16)
def _hbm_by_name(program: Program) -> dict[str, Allocation]:
    """Name -> HBM allocation (the first of a name), made once: a fused step binds hundreds of
    inputs among tens of thousands of on-chip allocations."""
    out: dict[str, Allocation] = {}
    for a in program.allocations:
        if a.space is Space.HBM:
            out.setdefault(a.name, a)
    return out


def _to_bytes(value: Any, dtype: str | None) -> np.ndarray:
    """Host value -> bytes for an allocation of ``dtype`` (None: raw bytes expected)."""
    if isinstance(value, np.ndarray) and value.dtype == np.uint8 and dtype in (None, "u8", "e8m0"):
        return value.reshape(-1)
    if dtype == "fp4":
        codes = np.asarray(value, np.uint8).reshape(value.shape[0], -1)
        return ((codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)).reshape(-1)
    host = np.asarray(value).astype(host_dtype(dtype or "u8"))
    return np.ascontiguousarray(host).view(np.uint8).reshape(-1)


_ML_DTYPES = {"fp4": ml_dtypes.float4_e2m1fn, "fp8e4": ml_dtypes.float8_e4m3fn,
              "fp8e5": ml_dtypes.float8_e5m2}


def _init_bytes(values: np.ndarray, dtype: str) -> np.ndarray:
    """Bytes of an ``.init`` fill: the values as elements of ``dtype``.

    MX element dtypes take each value rounded to the element format (scale 2^0); E8M0 scales
    take the power of two nearest each value's magnitude, kept within 2^-2..2^2 for "normal"
    fills, so "ones" is the scale 2^0 (byte 127) and "zeros" the smallest scale (byte 0).
    """
    if dtype in _ML_DTYPES:
        codes = values.astype(_ML_DTYPES[dtype]).view(np.uint8)
        return _to_bytes(codes.reshape(1, -1), dtype) if dtype == "fp4" else codes
    if dtype == "e8m0":
        with np.errstate(divide="ignore"):
            exp = np.clip(np.round(np.log2(np.abs(values))), -2, 2)
        return np.where(values == 0, 0, 127 + np.nan_to_num(exp)).astype(np.uint8)
    return _to_bytes(values, dtype)


def _initial_buffers(program: Program, layout: MemoryLayout, inputs: Mapping[str, Any],
                     debug: bool) -> dict[str, np.ndarray]:
    """The HBM arrays' first contents (``.init`` fills, then ``inputs``), by array name."""
    fill = 0xFF if debug else 0
    bufs = {k: np.full(n, fill, np.uint8) for k, n in layout.backing.items() if k.startswith("hbm:")}
    tensors = dict(dict(program.meta).get("tensors", {}))
    by_name = _hbm_by_name(program)
    for init in program.inits:
        alloc = _hbm_alloc(program, init.name, by_name)
        dt = DTYPES[init.dtype]
        count = alloc.nbytes * 8 // dt.bits
        if init.kind == "normal":
            vals = np.random.default_rng(init.seed).standard_normal(count).astype(np.float32)
        else:
            vals = np.full(count, 1.0 if init.kind == "ones" else 0.0, np.float32)
        data = _init_bytes(vals, init.dtype)
        bufs[f"hbm:{alloc.name}"][: data.size] = data
    for name, value in inputs.items():
        if isinstance(value, MXArray):
            _check_mx_input(tensors, name, value)
            _write_input(program, bufs, tensors, name, np.asarray(value.codes), by_name)
            _write_input(program, bufs, tensors, f"{name}.scales", np.asarray(value.scales), by_name)
        else:
            _write_input(program, bufs, tensors, name, value, by_name)
    return bufs


def initial_state(program: Program, layout: MemoryLayout, inputs: Mapping[str, Any],
                   debug: bool) -> State:
    """Every array's first contents: HBM from ``_initial_buffers``, on-chip memory uniform.

    The HBM arrays stay numpy arrays: the first compiled call that reads one moves it to the
    device inside jit's own dispatch (about 15 us an array, where ``jnp.asarray`` took 45 us; a
    tiny model's decode step stages about 300 of them). On-chip memory is made on the device by
    one compiled call per set of sizes (the host writes nothing there: 16 MiB of scratchpads took
    14 ms to copy, and one ``jnp.full`` per array cost 150 us).
    """
    state: State = dict(_initial_buffers(program, layout, inputs, debug))
    onchip = tuple((k, n) for k, n in layout.backing.items() if not k.startswith("hbm:"))
    made = _uniform_arrays(tuple(n for _, n in onchip), 0xFF if debug else 0)()
    state.update(zip((k for k, _ in onchip), made, strict=True))
    return state


@functools.lru_cache(maxsize=64)
def _uniform_arrays(sizes: tuple[int, ...], fill: int) -> Callable[[], tuple[jax.Array, ...]]:
    """A compiled () -> uint8 arrays of ``sizes`` bytes, every byte ``fill``."""
    return jax.jit(lambda: tuple(jnp.full(n, fill, jnp.uint8) for n in sizes))


def _expected(dtype: str, shape: tuple[int, int]) -> str:
    """What an input for a recorded tensor must be, in words."""
    rows, cols = shape
    if DTYPES[dtype].mx_fmt is not None:
        return (f"{dtype} [{rows}, {cols}] (uint8 codes of shape ({rows}, {cols}), one per element, "
                "or an MXArray)")
    what = f"{dtype} [{rows}, {cols}] (a {host_dtype(dtype)} array of shape ({rows}, {cols})"
    if dtype in ("u8", "e8m0"):
        what += f", or its {rows * DTYPES[dtype].row_bytes(cols):,} raw bytes"
    return what + ")"


def _mismatch(name: str, dtype: str, shape: tuple[int, int], given: str,
              hint: str | None = None) -> InvalidArgumentError:
    """The error for input ``name``, described as ``given``, that is not the recorded tensor."""
    return InvalidArgumentError(f"input {name!r}: the program's tensor {name!r} is "
                                f"{_expected(dtype, shape)}; given {given}", hint=hint)


def _check_mx_input(tensors: Mapping[str, tuple[str, tuple[int, int]]], name: str,
                    value: MXArray) -> None:
    """Raise InvalidArgumentError unless ``value`` is exactly MX tensor ``name`` as recorded:
    its element format, shape and (through the scales' shape) blocked axis and block size."""
    if name not in tensors:
        return  # nothing recorded (an assembled program): the byte count is checked on writing
    dtype, shape = tensors[name]
    given = (f"an MXArray ({value.fmt}, shape {tuple(value.shape)}, axis {value.axis}, "
             f"block {value.block_size})")
    if DTYPES[dtype].mx_fmt is None:
        raise _mismatch(name, dtype, shape, given)
    if value.fmt != DTYPES[dtype].mx_fmt or tuple(value.shape) != tuple(shape):
        raise _mismatch(name, dtype, shape, given, hint=_transposed_hint(tuple(value.shape), shape))
    scales = f"{name}.scales"
    if scales in tensors and tuple(np.shape(value.scales)) != tuple(tensors[scales][1]):
        raise InvalidArgumentError(
            f"input {name!r}: the program's scales {scales!r} are {tensors[scales][1]} (blocks of "
            f"32 along one axis); given {given} with scales of shape "
            f"{tuple(np.shape(value.scales))}", hint="quantize along the axis the kernel expects")


def _transposed_hint(got: tuple[int, ...], shape: tuple[int, int]) -> str | None:
    """A hint when ``got`` is ``shape`` transposed (the likeliest wrong layout), else None."""
    if got == tuple(shape)[::-1] and shape[0] != shape[1]:
        return "the shape is the transpose of the tensor's: pass the array in the kernel's layout"
    return None


def _write_input(program, bufs, tensors, name, value, by_name) -> None:
    alloc = _hbm_alloc(program, name, by_name)
    if name in tensors:
        dtype = tensors[name][0]
        data = _to_bytes(_checked_input(name, value, *tensors[name]), dtype)
    else:
        # Nothing recorded (an assembled program): only the allocation's size is known, and a
        # smaller input fills its start.
        data = _to_bytes(value, None)
    if data.size > alloc.nbytes:
        raise InvalidArgumentError(f"input {name!r} has {data.size:,} B but its allocation holds "
                                   f"{alloc.nbytes:,} B")
    bufs[f"hbm:{alloc.name}"][: data.size] = data


def _checked_input(name: str, value: Any, dtype: str, shape: tuple[int, int]) -> np.ndarray:
    """``value`` as an array, once it is shown to be exactly tensor ``name`` (``dtype``, ``shape``).

    A host array of any other shape or dtype would be converted or reinterpreted into the
    allocation without complaint, and the kernel would compute on misplaced or garbled values
    (a transposed [1024, 256] fills a [256, 1024] tensor just as well), so nothing is converted:
    the array must have the recorded shape and the element's own numpy dtype. The one other form
    is raw bytes (a flat uint8 array of exactly the tensor's size) for byte tensors (u8, e8m0),
    whose bytes are their values.
    """
    arr = np.asarray(value)
    want = host_dtype(dtype)
    rows, cols = shape
    nbytes = rows * DTYPES[dtype].row_bytes(cols)
    if (dtype in ("u8", "e8m0") and arr.dtype == np.uint8 and arr.ndim == 1
            and arr.size == nbytes):
        return arr
    if arr.shape != (rows, cols) or arr.dtype != want:
        given = f"a {arr.dtype} array of shape {arr.shape}"
        hint = _transposed_hint(arr.shape, shape)
        if hint is None and arr.size == rows * cols and arr.shape != (rows, cols):
            hint = (f"it has the tensor's number of elements: if they are in its row-major order, "
                    f".reshape({rows}, {cols}) first")
        if hint is None and arr.shape == (rows, cols):
            host = "ml_dtypes.bfloat16" if dtype == "bf16" else f"np.{want.name}"
            hint = (f"convert it first (.astype({host})) if its values are meant"
                    if DTYPES[dtype].mx_fmt is None
                    else "pass the element codes (uint8), or an MXArray")
        raise _mismatch(name, dtype, shape, given, hint=hint)
    return arr
