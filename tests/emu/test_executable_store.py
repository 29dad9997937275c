"""The functional pass's executable store: a second process runs the stored executables without
tracing anything, with the same results; damaged files, and files that load but do not run, are
compiled anew; the switches turn it off. Each run is
a process of its own (JAX's cache settings and the in-memory tables are per process), in a fresh
cache directory."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jalapeno_emu.emu.executable_store import Stored

_ROOT = Path(__file__).resolve().parents[2]

_RUN = """
import hashlib, json, os
import numpy as np
if os.environ.get("EDITED_CODE"):  # as if the emulator's code had been edited since
    import jalapeno_emu.fingerprint as fingerprint
    fingerprint.code_fingerprint = lambda: "edited"
from jalapeno_emu.emu import functional
from jalapeno_emu.emu.executable_store import Stored
from jalapeno_emu.kernels.registry import get_kernel
from jalapeno_emu.chip import load_preset
from tests.emu.programs import vector_program

traced = [0]
run = functional._Exec.run
def counting(self, state):
    traced[0] += 1
    return run(self, state)
functional._Exec.run = counting

digest = hashlib.sha256()
prog = vector_program("scale", rows=4, cols=64)
x = np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64)
res = functional.run_functional(prog, {"X": x, "Y": x})
digest.update(np.asarray(res.read("Z")).tobytes())
# a kernel on two cores: batched calls as well as single ones
build = get_kernel("rmsnorm").build(get_kernel("rmsnorm").shape({"tokens": 4, "hidden": 64}),
                                    load_preset("tiny"))
res = functional.run_functional(build.program, build.make_inputs(0))
for name in sorted(res.buffers):
    digest.update(np.asarray(res.buffers[name]).tobytes())
fns = [f for f in (*functional._by_signature.values(), *functional._by_batch.values())
       if not isinstance(f, Stored) or f.loaded is not None]  # made and called
print("RESULT", json.dumps({"digest": digest.hexdigest(), "traced": traced[0], "functions": len(fns),
      "batched": len(functional._by_batch),
      "loaded": sum(1 for f in fns if isinstance(f, Stored) and f.loaded)}))
"""


def _run(root: Path, **env: str) -> dict:
    full = {**os.environ, "JALAPENO_EMU_CACHE_DIR": str(root), **env}
    full.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", _RUN], env=full, capture_output=True, text=True,
                         timeout=300, cwd=_ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.split("RESULT", 1)[1])


def _files(root: Path) -> dict[str, str]:
    where = root / "jax" / "executables"
    if not where.exists():
        return {}
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in where.iterdir()}


def test_a_second_process_runs_the_stored_executables_without_tracing(tmp_path):
    first = _run(tmp_path)
    stored = _files(tmp_path)
    assert first["traced"] > 0 and first["loaded"] == 0
    assert first["batched"] > 0  # the kernel's cores ran as batches: those are stored too
    keys = [n for n in stored if n.endswith(".key")]
    programs = [n for n in stored if n.endswith(".xla")]
    assert len(keys) == first["functions"]
    assert 0 < len(programs) <= len(keys)
    second = _run(tmp_path)
    assert second["digest"] == first["digest"]
    assert second["traced"] == 0  # every function came from its file, under the same name
    assert second["loaded"] == second["functions"] == first["functions"]
    assert _files(tmp_path) == stored
    # After an edit of the code each key is traced and lowered again, and finds its program's
    # executable: nothing is compiled.
    edited = _run(tmp_path, EDITED_CODE="1")
    assert edited["digest"] == first["digest"]
    assert edited["traced"] > 0 and edited["loaded"] == edited["functions"]
    assert {n for n in _files(tmp_path) if n.endswith(".xla")} == set(programs)


def test_damaged_files_are_compiled_anew_and_rewritten(tmp_path):
    first = _run(tmp_path)
    names = sorted(_files(tmp_path))
    for name in [n for n in names if n.endswith(".xla")]:
        path = tmp_path / "jax" / "executables" / name
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    again = _run(tmp_path)
    assert again["digest"] == first["digest"]
    assert again["loaded"] == 0 and again["traced"] > 0
    assert sorted(_files(tmp_path)) == names
    third = _run(tmp_path)  # the rewritten files are whole and run
    assert third["digest"] == first["digest"] and third["traced"] == 0
    assert third["loaded"] == third["functions"]


def test_the_switches_turn_it_off(tmp_path):
    off = _run(tmp_path, JALAPENO_EMU_EXECUTABLE_STORE="off")
    assert not (tmp_path / "jax" / "executables").exists()
    jax_entries = sorted(p.name for p in (tmp_path / "jax").iterdir())
    assert jax_entries  # JAX's own cache stays on
    # With the store on, JAX's cache keeps nothing of what the store holds.
    assert _run(tmp_path)["digest"] == off["digest"] and _files(tmp_path)
    assert sorted(p.name for p in (tmp_path / "jax").iterdir()) == sorted([*jax_entries, "executables"])
    other = tmp_path / "other"
    assert _run(other, JALAPENO_EMU_COMPILE_CACHE="0")["digest"] == off["digest"]
    assert not (other / "jax" / "executables").exists()


def _double(buffers, k):
    (a,) = buffers
    return (a * 2 + k,), jnp.zeros((0,), bool)


def _halve(buffers, k):
    (a,) = buffers
    return (a / 2 - k,), jnp.zeros((0,), bool)


def test_a_file_that_loads_but_does_not_run_is_compiled_anew(tmp_path):
    """The first run of a loaded executable is on copies of its (donated) arguments, so a file
    that fails when run (here: another program's, for other shapes) still leaves them to compile
    with; the file is rewritten with what was compiled."""
    a, k = np.arange(8, dtype=np.float32), np.float32(1)
    first = Stored(_double, tmp_path / "good.key", 0)
    np.testing.assert_array_equal(np.asarray(first((jnp.asarray(a),), k)[0][0]), a * 2 + 1)
    Stored(_halve, tmp_path / "other.key", 0)((jnp.zeros(5, jnp.float32),), k)  # shapes (5,)
    good, other = (tmp_path / (tmp_path / f"{n}.key").read_text().split()[0] for n in ("good", "other"))
    assert good != other
    shutil.copyfile(other, good)
    x = jnp.asarray(a)
    again = Stored(_double, tmp_path / "good.key", 0)
    out = again((x,), k)
    assert again.loaded is False
    np.testing.assert_array_equal(np.asarray(out[0][0]), a * 2 + 1)
    assert good.read_bytes() != other.read_bytes()
    third = Stored(_double, tmp_path / "good.key", 0)
    np.testing.assert_array_equal(np.asarray(third((jnp.asarray(a),), k)[0][0]), a * 2 + 1)
    assert third.loaded is True
    jax.block_until_ready(out)


def test_keys_that_lower_to_one_program_share_its_executable(tmp_path):
    a, k = np.arange(8, dtype=np.float32), np.float32(1)
    first = Stored(_double, tmp_path / "load.key", 0)
    first((jnp.asarray(a),), k)
    second = Stored(_double, tmp_path / "store.key", 0)  # another key, the same program
    np.testing.assert_array_equal(np.asarray(second((jnp.asarray(a),), k)[0][0]), a * 2 + 1)
    assert first.loaded is False and second.loaded is True
    assert (tmp_path / "load.key").read_text() == (tmp_path / "store.key").read_text()
    assert len(list(tmp_path.glob("*.xla"))) == 1
