"""Smoke test of the public API surface: every exported name exists and the subpackages import."""

import doctest
import importlib

import jax.numpy as jnp

import jalapeno_emu
from jalapeno_emu import mx


def test_public_names_resolve():
    for name in mx.__all__:
        assert getattr(mx, name) is not None, name
    assert jalapeno_emu.__version__


def test_isa_and_kernels_install_under_the_package():
    for name in ("jalapeno_emu.isa", "jalapeno_emu.kernels"):
        mod = importlib.import_module(name)
        assert mod.__name__ == name


def test_round_trip_of_exact_values():
    x = jnp.array([[0.0, 0.5, -1.0, 1.5, 2.0, -3.0, 4.0, 6.0] * 4])
    q = mx.quantize(x)
    assert q.scales.tolist() == [[127]]
    assert (mx.dequantize(q) == x).all()


def test_docstring_examples_run():
    # The package re-exports the function under the submodule's name; fetch the module itself.
    quantize_module = importlib.import_module("jalapeno_emu.mx.quantize")
    result = doctest.testmod(quantize_module)
    assert result.attempted > 0 and result.failed == 0
