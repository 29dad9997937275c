"""Inputs must be regular files (issue 13): a FIFO, a device, a directory or a dangling link given as
a program, a binary, a preset or a model config is one error line naming the path, instead of a
read that waits forever (``asm some_fifo`` used to hang)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from jalapeno_emu.cli.main import main
from jalapeno_emu.errors import ConfigError, InvalidArgumentError
from jalapeno_emu.files import check_input_file, read_input_bytes
from tests.deadline import deadline

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


@pytest.fixture
def fifo(tmp_path):
    """A FIFO nobody writes to; if a test opens it anyway, a writer comes after a few seconds so
    that the test fails (reads an empty file) instead of hanging."""
    path = tmp_path / "pipe.jasm"
    os.mkfifo(path)
    done = threading.Event()

    def rescue() -> None:
        if not done.wait(5):
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK) if _has_reader(path) else None
            if fd is not None:
                os.close(fd)

    thread = threading.Thread(target=rescue, daemon=True)
    thread.start()
    yield path
    done.set()
    thread.join()


def _has_reader(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # ENXIO: no reader has it open
        return False
    return True


@pytest.mark.parametrize(("argv", "what"), [
    (["asm", "{fifo}"], "assembly source"),
    (["asm", "{fifo}", "-o", "{tmp}/out.bin"], "assembly source"),
    (["disasm", "{fifo}"], "binary program"),
    (["run", "{fifo}"], "program"),
    (["chip", "show", "{fifo}.toml"], "chip preset"),
    (["kernel", "gemm", "--preset", "{fifo}.toml"], "chip preset"),
    (["layer", "--model", "{fifo}", "--phase", "decode"], "model config"),
    (["serve", "--model", "{fifo}", "--concurrency", "1"], "model config"),
], ids=["asm", "asm-o", "disasm", "run", "chip-show", "kernel-preset", "layer-model", "serve-model"])
def test_a_fifo_input_is_one_error_line(capsys, tmp_path, fifo, argv, what):
    if "{fifo}.toml" in argv:  # presets are recognised as paths by their suffix
        os.mkfifo(f"{fifo}.toml")
    args = [a.format(fifo=fifo, tmp=tmp_path) for a in argv]
    with deadline(15):
        assert main(args) == 2
    err = capsys.readouterr().err
    assert "is a FIFO (named pipe), not a regular file" in err and f"as the {what}" in err, err
    assert err.count("error:") == 1 and "Traceback" not in err


def test_a_character_device_is_refused():
    with pytest.raises(InvalidArgumentError, match="/dev/null: is a character device, not a regular file"):
        check_input_file("/dev/null", what="program")


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p.mkdir(), "is a directory, not a file"),
    (lambda p: None, "no such file"),
    (lambda p: p.symlink_to(p.parent / "nowhere"), "a symlink to nothing"),
    (lambda p: p.symlink_to(p), "cannot be read as the input"),
], ids=["directory", "missing", "dangling-link", "link-loop"])
def test_other_non_files_are_refused_by_name(tmp_path, make, message):
    path = tmp_path / "thing"
    make(path)
    with pytest.raises(InvalidArgumentError, match=message) as info:
        check_input_file(path)
    assert str(info.value).startswith(str(path))


def test_a_symlink_to_a_fifo_is_refused_and_a_regular_file_is_read(tmp_path, fifo):
    link = tmp_path / "link"
    link.symlink_to(fifo)
    with deadline(15), pytest.raises(ConfigError, match="link: is a FIFO"):
        read_input_bytes(link, what="model config", error=ConfigError)
    text = tmp_path / "ok.jasm"
    text.write_bytes(b"# nothing\n")
    assert check_input_file(text) == text and read_input_bytes(str(text)) == b"# nothing\n"
