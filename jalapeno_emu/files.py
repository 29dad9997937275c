"""Files written whole or not at all, and only where a file may be written; files read only when
they are regular files.

Stage: shared by every stage that writes output (traces, sweeps, binaries, plots). The rules:

- **Whole or not at all.** A temporary file in the target's directory is filled and then renamed
  onto the target: a rename is atomic within one filesystem, so a reader sees the old file or
  the whole new one, and a failure leaves the target as it was.
- **Only regular files are replaced.** An existing directory, FIFO, device node or socket at the
  path is refused (renaming over it would replace a device with a JSON file, or a pipe someone
  reads with a file nobody does).
- **Symlinks are written through.** A symlink at the path is followed to its final target, and
  the target is replaced atomically in its own directory; the link itself is left as it is (as
  a shell's ``>`` does). A link loop is refused.
- **Checked before computing.** :func:`check_output_path` says, in a few microseconds, whether a
  path could be written, so a command refuses it before an hour of work rather than after; the
  same check runs again just before each rename.
- **Together or not at all.** Inside :func:`all_or_nothing`, every :func:`atomic_write` fills its
  temporary file but defers the rename to the end of the block, so a command whose second output
  fails leaves none of its outputs behind.

Every refusal is an :class:`~jalapeno_emu.errors.InvalidArgumentError` that names the path as the
user gave it, never an internal temporary file.

Inputs (programs, binaries, presets, model configs) go through :func:`check_input_file` before
they are opened: reading a FIFO blocks until someone writes to it, and a device such as
``/dev/zero`` never ends, so anything but a regular file (through any symlinks) is refused with
one line saying what the path is.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from jalapeno_emu.errors import EmuError, InvalidArgumentError

__all__ = ["OutputBatch", "all_or_nothing", "atomic_write", "atomic_write_json", "cache_root",
           "check_input_file", "check_output_path", "check_output_paths", "read_input_bytes"]

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)

_MAX_TEMP_STEM = 100
"""Characters of the target's name kept in its temporary file's name: the name also carries a
random part and ``.tmp``, and must stay under the usual 255-byte limit for any target name."""


def _shown(path: str | os.PathLike[str], target: str) -> str:
    """The path as the user gave it, with the link's target when the two differ."""
    given = os.fspath(path)
    return given if os.path.abspath(given) == target else f"{given} (a symlink to {target})"


def _target(path: str | os.PathLike[str]) -> str:
    """The absolute file that writing ``path`` replaces: the path itself, or for a symlink the file
    at the end of its chain (which need not exist yet).

    Raises:
        InvalidArgumentError: the path is empty, ends in a slash, or is a symlink that loops.
    """
    given = os.fspath(path)
    if not given:
        raise InvalidArgumentError("the output path is empty; give a file name")
    if given.endswith(os.sep):  # abspath would drop the slash and write a file the user meant as a folder
        raise InvalidArgumentError(f"{given}: ends in {os.sep}, a directory; give a file name")
    absolute = os.path.abspath(given)
    if not os.path.islink(absolute):
        return absolute
    target = os.path.realpath(absolute)
    # realpath (not strict) stops at a loop and returns a path that is still a link.
    if os.path.islink(target):
        raise InvalidArgumentError(f"{given}: the symlink loops (too many levels of symbolic links)")
    return target


def _check_target(path: str | os.PathLike[str], target: str) -> os.stat_result | None:
    """Refuse ``target`` unless a regular file may be put there; its current stat, None if absent."""
    shown = _shown(path, target)
    try:
        st = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):  # the directory check below says which
        st = None
    except OSError as exc:
        raise InvalidArgumentError(f"{shown}: cannot be written ({exc.strerror or exc})") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise InvalidArgumentError(f"{shown}: is a directory; give a file name")
        for test, kind in _KINDS:
            if test(st.st_mode):
                raise InvalidArgumentError(
                    f"{shown}: is {kind}, not a regular file; refusing to replace it (give the path of "
                    "a regular file, or of one that does not exist yet)")
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgumentError(f"{shown}: is not a regular file; refusing to replace it")
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise InvalidArgumentError(f"{shown}: directory {directory} {what}")
    # The rename needs write and search permission on the directory, not on the file itself.
    effective = os.access in os.supports_effective_ids
    if not os.access(directory, os.W_OK | os.X_OK, effective_ids=effective):
        raise InvalidArgumentError(f"{shown}: directory {directory} is not writable")
    return st


def check_input_file(path: str | os.PathLike[str], *, what: str = "input",
                     error: type[EmuError] = InvalidArgumentError) -> Path:
    """Refuse, before it is opened, an input that is not a readable regular file: a missing path,
    a directory, a FIFO (reading it blocks until something writes), a device (``/dev/zero`` never
    ends), a socket, a symlink loop. Symlinks are followed; a few ``stat`` calls, nothing read.

    Args:
        path: the path as the user gave it (named in every message).
        what: what the file is for the message ("program", "chip preset", "model config").
        error: the class raised (a loader of configuration files raises ``ConfigError``).

    Returns:
        The path as given, as a ``Path``.

    Raises:
        ``error`` (InvalidArgumentError by default): one line naming the path and what it is.
    """
    given = os.fspath(path)
    if not given:
        raise error(f"the {what} path is empty; give a file name")
    try:
        st = os.stat(given)
    except (FileNotFoundError, NotADirectoryError):
        kind = "a symlink to nothing" if os.path.islink(given) else "no such file"
        raise error(f"{given}: {kind} (the {what} file)") from None
    except OSError as exc:  # ELOOP, EACCES on a directory above, ENAMETOOLONG
        raise error(f"{given}: cannot be read as the {what} ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{given}: is a directory, not a file (the {what} must be a file)")
    for test, kind in _KINDS:
        if test(st.st_mode):
            raise error(f"{given}: is {kind}, not a regular file; refusing to read it as the {what} "
                        "(reading it could wait forever or never end)")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{given}: is not a regular file; refusing to read it as the {what}")
    effective = os.access in os.supports_effective_ids
    if not os.access(given, os.R_OK, effective_ids=effective):
        raise error(f"{given}: cannot be read as the {what} (permission denied)")
    return Path(given)


def read_input_bytes(path: str | os.PathLike[str], *, what: str = "input",
                     error: type[EmuError] = InvalidArgumentError) -> bytes:
    """The bytes of the regular file ``path`` (:func:`check_input_file` first); an error while
    reading is ``error`` naming the path, not an ``OSError``."""
    checked = check_input_file(path, what=what, error=error)
    try:
        # Opened without blocking and checked again on the descriptor: a FIFO put at the path
        # after the check above would otherwise block this open until a writer came.
        fd = os.open(checked, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise error(f"{os.fspath(path)}: is not a regular file; refusing to read it as the {what}")
            return fh.read()
    except OSError as exc:
        raise error(f"{os.fspath(path)}: cannot read the {what} ({exc.strerror or exc})") from None


def check_output_path(path: str | os.PathLike[str]) -> Path:
    """Refuse, before any computing, an output path that could not be written or must not be
    replaced: an existing directory, FIFO, device node or socket, a missing or unwritable
    directory, a symlink loop. Cheap (a few ``stat`` calls) and writes nothing.

    Returns:
        The path as given, as a ``Path`` (messages should keep naming what the user typed).

    Raises:
        InvalidArgumentError: naming the path as given (and a symlink's target).
    """
    _check_target(path, _target(path))
    return Path(path)


def check_output_paths(outputs: Iterable[str | os.PathLike[str] | None]
                       | Mapping[str, str | os.PathLike[str] | None], *,
                       inputs: Iterable[str | os.PathLike[str] | None] = ()) -> list[Path]:
    """:func:`check_output_path` on each output given (None: an option not given), and refuse two
    outputs that are one file (the second would silently replace the first) or an output that is
    one of the ``inputs`` (the input would be gone once the command ends; an input that is not an
    existing file, such as a model name, is skipped).

    Args:
        outputs: the paths, or option name -> path (``{"--csv": ..., "--plot": ...}``) so that a
            clash names the two options.
        inputs: the files the command reads.

    Returns:
        The outputs given, as ``Path`` objects, in order.
    """
    labelled = list(outputs.items()) if isinstance(outputs, Mapping) else [(None, o) for o in outputs]
    seen: dict[str, tuple[str | None, str]] = {}
    checked = []
    for label, out in labelled:
        if out is None:
            continue
        checked.append(check_output_path(out))
        target = _target(out)
        if target in seen:
            first_label, first = seen[target]
            both = f"both {first_label} and {label}" if first_label and label else f"{first} and {out}"
            raise InvalidArgumentError(f"{os.fspath(out)}: {both} would write this one file; give each "
                                       "output its own path")
        seen[target] = (label, os.fspath(out))
    for inp in inputs:
        if inp is None or not os.path.exists(inp):  # a name (a preset, a model), not a file
            continue
        real = os.path.realpath(inp)
        for target, (_, out) in seen.items():
            if target == real:
                raise InvalidArgumentError(f"{out}: the output would overwrite the input {os.fspath(inp)}; "
                                           "choose another path")
    return checked


def _create_temp(directory: str, name: str) -> tuple[int, str]:
    """A new file beside the target, opened for writing: (fd, path).

    Not ``tempfile.mkstemp``: that creates mode 0600 whatever the umask, so every output would end
    up private to its owner; ``os.open`` with 0666 lets the umask decide, as for any new file.
    """
    stem = name[:_MAX_TEMP_STEM]
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = os.path.join(directory, f".{stem}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue


@dataclass
class _Pending:
    path: str  # as the user gave it, for messages
    target: str
    tmp: str


@dataclass
class OutputBatch:
    """The outputs of one command, filled as temporary files and renamed together at the end of
    :func:`all_or_nothing`."""

    pending: dict[str, _Pending] = field(default_factory=dict)

    def add(self, item: _Pending) -> None:
        """Stage one filled temporary file; a second write to the same target replaces the first."""
        old = self.pending.pop(item.target, None)
        if old is not None:
            _unlink_quietly(old.tmp)
        self.pending[item.target] = item

    def discard(self) -> None:
        """Remove every staged temporary file; no target is touched."""
        for item in self.pending.values():
            _unlink_quietly(item.tmp)
        self.pending.clear()

    def commit(self) -> None:
        """Rename every staged file onto its target.

        Every target is checked again first, so one that became a directory or a FIFO while the
        command ran stops the batch before any rename. A rename itself fails only if the
        filesystem does (the temporary file is already in the target's directory); then the
        renames done stay done and the rest are discarded.
        """
        try:
            for item in self.pending.values():
                _check_target(item.path, item.target)
            for item in list(self.pending.values()):
                _rename(item)
                del self.pending[item.target]
        finally:
            self.discard()


_BATCH: ContextVar[OutputBatch | None] = ContextVar("jalapeno_emu_output_batch", default=None)


@contextlib.contextmanager
def all_or_nothing() -> Iterator[OutputBatch]:
    """Inside the block, :func:`atomic_write` (and everything built on it: traces, CSV, plots)
    fills temporary files and defers the renames to the block's end: all the outputs appear
    together if the block finishes, none if it raises. A nested block joins the outer one.
    """
    outer = _BATCH.get()
    if outer is not None:
        yield outer
        return
    batch = OutputBatch()
    token = _BATCH.set(batch)
    try:
        yield batch
    except BaseException:
        batch.discard()
        raise
    finally:
        _BATCH.reset(token)
    batch.commit()


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _rename(item: _Pending) -> None:
    try:
        os.replace(item.tmp, item.target)
    except OSError as exc:
        _unlink_quietly(item.tmp)
        raise OSError(exc.errno, exc.strerror, _shown(item.path, item.target)) from None


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None], *,
                 alone: bool = False) -> None:
    """Call ``write`` on a temporary binary file beside the target, then rename it onto the target
    (inside :func:`all_or_nothing`: at the end of the block, unless ``alone``: a cache file, say,
    which is none of a command's outputs and must not wait for them or fail with them).

    The target is ``path``, or for a symlink the file the link leads to (the link stays). An
    existing file's permission bits are kept; a new file gets the umask's.

    Raises:
        InvalidArgumentError: the path must not be replaced or cannot be written
            (:func:`check_output_path`); nothing was written.
        OSError: creating, filling or renaming the temporary file failed; the error names
            ``path``, not the temporary file, and the target is untouched. An exception ``write``
            raises itself propagates as it is.
    """
    target = _target(path)
    st = _check_target(path, target)
    shown = _shown(path, target)
    try:
        fd, tmp = _create_temp(os.path.dirname(target), os.path.basename(target))
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, shown) from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        if st is not None:  # replacing a file: keep who may read it
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
    except BaseException as exc:
        _unlink_quietly(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename in (None, tmp):
            # e.g. ENOSPC from a write: say which output, not which temporary file
            raise OSError(exc.errno, exc.strerror, shown) from None
        raise
    item = _Pending(os.fspath(path), target, tmp)
    batch = None if alone else _BATCH.get()
    if batch is not None:
        batch.add(item)
    else:
        _rename(item)


def atomic_write_json(path: str | os.PathLike[str], doc: Any) -> None:
    """``doc`` as JSON at ``path``, written whole or not at all."""
    atomic_write(path, lambda f: f.write(json.dumps(doc).encode("utf-8")))


def cache_root() -> Path:
    """The directory jalapeno-emu keeps its caches under (kernel timings, compiled functions):
    ``$JALAPENO_EMU_CACHE_DIR``, else ``~/.cache/jalapeno-emu``."""
    root = os.environ.get("JALAPENO_EMU_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "jalapeno-emu"
