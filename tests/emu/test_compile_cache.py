"""The functional pass's persistent compilation cache: on by default in the user cache, off when
asked, never a reason for a run to fail. Each case runs in its own process (JAX's cache settings
are per process)."""

import os
import subprocess
import sys

_RUN = """
import numpy as np
from jalapeno_emu.emu import run_functional
from jalapeno_emu.emu.compile_cache import compile_cache_dir
from tests.emu.programs import vector_program
import jax.numpy as jnp
jnp.ones(3).sum().block_until_ready()  # something compiled before the pass turns the cache on
prog = vector_program("add", rows=4, cols=64)
x = np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64)
run_functional(prog, {"X": x, "Y": x})
print("CACHE", compile_cache_dir())
"""


def _run(tmp_path, **env) -> str:
    full = {**os.environ, "JALAPENO_EMU_CACHE_DIR": str(tmp_path / "root"), **env}
    full.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", _RUN], env=full, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    return out.stdout.split("CACHE", 1)[1].strip()


def test_functional_runs_fill_the_default_cache(tmp_path):
    where = _run(tmp_path)
    assert where == str(tmp_path / "root" / "jax")
    assert any((tmp_path / "root" / "jax").iterdir())  # compiled functions were written
    assert any((tmp_path / "root" / "jax" / "executables").iterdir())  # and the pass's executables


def test_the_environment_turns_it_off(tmp_path):
    assert _run(tmp_path, JALAPENO_EMU_COMPILE_CACHE="off") == "None"
    assert not (tmp_path / "root" / "jax").exists()
    assert not (tmp_path / "root" / "jax" / "executables").exists()


def test_an_unusable_directory_leaves_the_cache_off(tmp_path):
    blocker = tmp_path / "root"
    blocker.write_text("a file where the cache directory would go")
    assert _run(tmp_path) == "None"


def test_the_cli_option_turns_it_off(tmp_path):
    env = {**os.environ, "JALAPENO_EMU_CACHE_DIR": str(tmp_path / "root")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "jalapeno_emu.cli.main", "--no-compile-cache", "kernel", "rmsnorm",
           "--check", "--shape", "tokens=2", "--shape", "hidden=64", "--json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "root" / "jax").exists()
    assert not (tmp_path / "root" / "jax" / "executables").exists()  # nor the executable store
