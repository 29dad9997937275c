"""The functional pass's compiled functions kept on disk whole, so a later process neither traces
nor lowers them.

Stage: emulator, beside ``compile_cache.py``. JAX's persistent cache saves XLA's compile, but it is
keyed by the lowered program, so every process still traces and lowers each function before it
can look one up: in the demo's tiny model, about 300 instruction signatures at 30-40 ms each on
two cores, most of a warm run's time. The functional pass knows a complete key before tracing (an
instruction signature fixes every shape and operand, ``functional._signature``), so it keeps the
finished executable (``jax.experimental.serialize_executable``) and, under that key, the name of
its file; a later process loads it in a few milliseconds instead.

Two kinds of file, in ``executables`` inside JAX's cache directory (so wherever that is shared,
between the test workers for instance, so are these):

- ``<digest>.xla``: an executable, named by the lowered program (its text and argument trees), so
  keys that lower to the same program (a DMA load and a store of the same shapes) share one
  compile, as JAX's cache would have let them;
- ``<digest>.key``: the name of the ``.xla`` file a key's function lowers to, and on a second
  line the code fingerprint that wrote it.

Every digest also covers what an executable depends on besides its program: the versions of jax
and jaxlib, the backend, the host CPU (XLA's CPU code is compiled for the machine's instruction
set, and a cache directory may be shared between machines) and JAX's precision settings; a key's
also the code (``fingerprint.code_fingerprint``): after an edit of the emulator, ISA, MX or kernel
code each key is traced and lowered again, once, and finds its program's executable unless the
edit changed the program. On whenever JAX's persistent cache is (the same switches turn both off:
``JALAPENO_EMU_COMPILE_CACHE=0``, ``jalapeno-emu --no-compile-cache``, ``disable_compile_cache``);
``JALAPENO_EMU_EXECUTABLE_STORE=0`` turns this store off alone (to measure what it saves). A file
is written whole (a temporary file, then a rename) or not at all, at once (never deferred with a
command's outputs in ``files.all_or_nothing``); a key's file is touched whenever it is used, so
``jalapeno-emu cache prune`` can tell the keys old code left; one that cannot be read, loaded
or run is compiled anew and rewritten. Storing never makes a run fail. An executable XLA cannot
serialise (a sort's comparator on the CPU backend: the batched ``vec.group`` of a MoE router) is
compiled in every process, as it was with JAX's cache alone.

Only an executable XLA compiled in this process can be stored: one that JAX's persistent cache
served serialises into a file that cannot run (XLA's CPU backend, jax 0.10: "Function ... not
found" when called). So stored functions are compiled under a module name nothing else uses and
JAX's persistent cache keeps nothing of those compiles: no JAX cache can serve one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import platform
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jalapeno_emu.emu.compile_cache import compile_cache_dir, switched_on
from jalapeno_emu.files import atomic_write

__all__ = ["STORE_SUBDIR", "Stored", "store_dir", "stored"]

STORE_SUBDIR = "executables"
_FORMAT = 1  # of the stored files: (serialized executable, in tree, out tree), pickled
_MODULE_NAME = "jalapeno_stored"  # every stored function's (see Stored._first)


def store_dir() -> Path | None:
    """Where executables are kept now: ``executables`` in the directory of JAX's persistent cache
    while that is on in this process (JAX's cache only touches its own ``*-cache`` files there),
    None while it is off."""
    where = compile_cache_dir()
    return where / STORE_SUBDIR if where is not None else None


@functools.cache
def _host() -> str:
    """The CPU this process compiles for: its model and instruction-set flags where Linux says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    except OSError:
        lines = []
    seen = sorted(set(lines))
    return "|".join([platform.machine(), platform.processor(), *seen])


@functools.cache
def _environment() -> str:
    """What an executable depends on besides its program: the compiler and the machine."""
    import jax
    import jaxlib

    client = jax.devices()[0].client
    return "\n".join([jax.__version__, jaxlib.__version__, client.platform, client.platform_version,
                      str(jax.config.jax_enable_x64), str(jax.config.jax_default_matmul_precision), _host()])


def _digest(text: str, *, code: bool) -> str:
    from jalapeno_emu.fingerprint import code_fingerprint

    where = f"{code_fingerprint()}\n" if code else ""
    return hashlib.sha256(f"{_FORMAT}\n{where}{_environment()}\n{text}".encode()).hexdigest()[:32]


def _key_file(directory: Path, key: Any) -> Path:
    """A key's file: what its function lowers to depends on the code that traces it."""
    return directory / f"{_digest(repr(key), code=True)}.key"


def _module_file(directory: Path, lowered: Any) -> Path:
    """An executable's file: its program's text says everything the code put in it, so an edit of
    the code that leaves a program as it was keeps its executable."""
    text = f"{lowered.in_tree}|{lowered.out_tree}|{lowered.as_text()}"
    return directory / f"{_digest(text, code=False)}.xla"


def _read_name(path: Path) -> str | None:
    try:
        lines = path.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        return None
    name = lines[0] if lines else ""
    return name if name.endswith(".xla") and "/" not in name else None


def _write_name(path: Path, name: str) -> None:
    """Write a key's file: the name of its executable, then the code fingerprint it was made by
    (``jalapeno-emu cache prune`` removes the keys of other code; the lookup reads the name)."""
    from jalapeno_emu.fingerprint import code_fingerprint

    text = f"{name}\n{code_fingerprint()}\n"
    with contextlib.suppress(Exception):  # a full disk: the key is looked up by lowering next time
        atomic_write(path, lambda f: f.write(text.encode("ascii")), alone=True)


def _load(path: Path) -> Callable | None:
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        return deserialize_and_load(payload, in_tree, out_tree)
    except FileNotFoundError:
        return None
    except Exception:  # a truncated, foreign or stale file: compile it anew
        return None


def _save(path: Path, compiled: Any) -> bool:
    from jax.experimental.serialize_executable import serialize

    try:
        blob = pickle.dumps(serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(blob), alone=True)
    except Exception:  # a full disk, a backend that cannot serialise: run on
        return False
    return True


@contextlib.contextmanager
def _jax_cache_not_written() -> Iterator[None]:
    """JAX's persistent cache keeps nothing compiled inside (what it would keep is this store's)."""
    import jax

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def _loaded_run(path: Path, args: tuple) -> tuple[Callable, Any] | None:
    """(executable, its results on ``args``) from the file at ``path``, or None when there is no
    such file or it does not load or run. The run is on copies of the arguments: a donated
    argument is gone once a call starts, even one that fails, and a file that loads may still not
    run (one written from an executable JAX's cache served, for instance)."""
    exe = _load(path)
    if exe is None:
        return None
    import jax
    import numpy as np

    try:
        return exe, exe(*jax.tree.map(lambda a: np.array(a, copy=True), args))
    except Exception:  # it does not run here, whatever the reason: compile it
        return None


class Stored:
    """A function compiled through the store: called like ``jax.jit(fn)``.

    The first call runs the executable its key names (its ``.key`` file holds the name of the
    ``.xla`` file of the program it lowers to), or traces and lowers ``fn`` for the arguments it
    was given and runs the executable of that program if another key stored it (a DMA load and a
    store of the same shapes lower to one program), or compiles it and stores it; later calls run
    that executable directly. Every call must pass arguments of the same shapes and dtypes as the
    first: the key promises it.

    Attributes:
        path: the key's file.
        loaded: True when the executable came from the store, False when it was compiled here,
            None before the first call.
    """

    __slots__ = ("_call", "_donate", "_fn", "loaded", "path")

    def __init__(self, fn: Callable, path: Path, donate_argnums: int | tuple[int, ...]) -> None:
        self._fn, self.path, self._donate = fn, path, donate_argnums
        self._call: Callable | None = None
        self.loaded: bool | None = None

    def __call__(self, *args: Any) -> Any:
        call = self._call
        if call is None:
            return self._first(args)
        return call(*args)

    def _first(self, args: tuple) -> Any:
        name = _read_name(self.path)
        ran = _loaded_run(self.path.parent / name, args) if name is not None else None
        if ran is None:
            import jax

            # One module name for every stored function, used by nothing else, and JAX's
            # persistent cache never keeps these compiles (below): so no JAX cache serves one (what
            # it serves serialises into files that cannot run: XLA's CPU backend, jax 0.10,
            # "Function ... not found" when called), and equal programs lower to equal text.
            self._fn.__name__ = self._fn.__qualname__ = _MODULE_NAME
            lowered = jax.jit(self._fn, donate_argnums=self._donate).lower(*args)
            module = _module_file(self.path.parent, lowered)
            ran = _loaded_run(module, args)
            if ran is None:
                with _jax_cache_not_written():
                    exe = lowered.compile()
                self._call, self.loaded = exe, False
                out = exe(*args)
                if _save(module, exe):
                    _write_name(self.path, module.name)
                return out
            _write_name(self.path, module.name)
        self._call, out = ran
        self.loaded = True
        with contextlib.suppress(OSError):  # used now: `jalapeno-emu cache prune` keeps it
            os.utime(self.path)
        return out


def stored(fn: Callable, key: Any, *, donate_argnums: int | tuple[int, ...] = ()) -> Callable:
    """``jax.jit(fn, donate_argnums=...)``, its executable kept in the store under ``key`` (a value
    whose ``repr`` names everything the traced function depends on besides the code and the
    environment); plain ``jax.jit`` while the store is off (see the module docstring)."""
    directory = store_dir()
    if directory is None or not switched_on("JALAPENO_EMU_EXECUTABLE_STORE"):
        import jax

        return jax.jit(fn, donate_argnums=donate_argnums)
    return Stored(fn, _key_file(directory, key), donate_argnums)
