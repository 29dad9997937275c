"""``jalapeno_emu.files``: outputs never replace what is not a regular file, follow symlinks to their
target, name the user's path in every error, and appear together or not at all (issue 13)."""

import errno
import os
import stat

import pytest

from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.files import all_or_nothing, atomic_write, check_output_path, check_output_paths


def _write(data: bytes):
    return lambda f: f.write(data)


def _never(f):
    raise AssertionError("the writer must not run for a refused path")


def _no_temporaries(*dirs):
    return not [p for d in dirs for p in os.listdir(d) if p.endswith(".tmp")]


def test_a_fifo_is_refused_and_stays_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for call in (lambda: check_output_path(fifo), lambda: atomic_write(fifo, _never)):
        with pytest.raises(InvalidArgumentError, match=rf"^{fifo}: is a FIFO \(named pipe\), not a regular"):
            call()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and _no_temporaries(tmp_path)


def test_a_character_device_is_refused_before_anything_is_written():
    # /dev/null is never written to: the refusal comes before the writer runs.
    with pytest.raises(InvalidArgumentError, match=r"^/dev/null: is a character device"):
        check_output_path("/dev/null")
    with pytest.raises(InvalidArgumentError, match=r"^/dev/null: is a character device"):
        atomic_write("/dev/null", _never)
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)


def test_a_directory_is_refused_naming_the_path_given_not_a_temporary(tmp_path, monkeypatch):
    (tmp_path / "adir").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError) as info:
        atomic_write("adir", _never)
    assert str(info.value) == "adir: is a directory; give a file name"
    assert (tmp_path / "adir").is_dir() and _no_temporaries(tmp_path)


@pytest.mark.parametrize(("where", "message"), [("missing/out.json", "does not exist"),
                                                 ("afile/out.json", "is not a directory"),
                                                 ("", "the output path is empty"),
                                                 ("new/", "ends in /, a directory")])
def test_an_impossible_directory_is_refused(tmp_path, monkeypatch, where, message):
    (tmp_path / "afile").write_text("x")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match=message) as info:
        check_output_path(where)
    assert str(info.value).startswith(where)


def test_a_symlink_is_written_through_and_stays_a_symlink(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real = elsewhere / "real.json"
    real.write_text("old")
    real.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    chain = tmp_path / "chain.json"
    chain.symlink_to(link)
    atomic_write(chain, _write(b"new"))
    assert os.readlink(link) == str(real) and os.readlink(chain) == str(link)
    assert real.read_text() == "new" and stat.S_IMODE(real.stat().st_mode) == 0o640
    assert _no_temporaries(tmp_path, elsewhere)


def test_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "later.json")
    atomic_write(link, _write(b"x"))
    assert link.is_symlink() and (tmp_path / "later.json").read_bytes() == b"x"


def test_symlinks_to_special_files_and_loops_are_refused(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "to_pipe").symlink_to(tmp_path / "pipe")
    (tmp_path / "to_null").symlink_to("/dev/null")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(InvalidArgumentError, match=rf"to_pipe \(a symlink to {tmp_path}/pipe\): is a FIFO"):
        atomic_write(tmp_path / "to_pipe", _never)
    with pytest.raises(InvalidArgumentError, match=r"to_null \(a symlink to /dev/null\): is a character"):
        atomic_write(tmp_path / "to_null", _never)
    with pytest.raises(InvalidArgumentError, match="the symlink loops"):
        atomic_write(tmp_path / "a", _never)
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode) and stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode)
    assert (tmp_path / "to_pipe").is_symlink() and (tmp_path / "to_null").is_symlink()


def test_permissions_kept_for_an_existing_file_and_the_umask_for_a_new_one(tmp_path):
    old = tmp_path / "old.bin"
    old.write_bytes(b"old")
    old.chmod(0o644)
    atomic_write(old, _write(b"new"))
    mask = os.umask(0o022)
    try:
        atomic_write(tmp_path / "new.bin", _write(b"new"))
    finally:
        os.umask(mask)
    # tempfile.mkstemp's 0600 used to become every output's mode.
    assert stat.S_IMODE(old.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "new.bin").stat().st_mode) == 0o644


def test_a_failed_rename_names_the_users_path(tmp_path, monkeypatch):
    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link", src, dst)

    monkeypatch.setattr(os, "replace", cross_device)
    with pytest.raises(OSError) as info:
        atomic_write(tmp_path / "out.json", _write(b"x"))
    assert info.value.filename == str(tmp_path / "out.json") and ".tmp" not in str(info.value)
    assert _no_temporaries(tmp_path)


def test_a_long_name_still_gets_a_temporary(tmp_path):
    name = "n" * 250  # the temporary's name would pass 255 bytes if it carried the whole name
    atomic_write(tmp_path / name, _write(b"x"))
    assert (tmp_path / name).read_bytes() == b"x"


def test_outputs_appear_together_or_not_at_all(tmp_path):
    keep = tmp_path / "keep.csv"
    keep.write_text("old")
    with pytest.raises(RuntimeError, match="plot failed"), all_or_nothing():
        atomic_write(keep, _write(b"new"))
        atomic_write(tmp_path / "new.json", _write(b"{}"))
        assert keep.read_text() == "old"  # deferred: nothing renamed yet
        raise RuntimeError("plot failed")
    assert keep.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["keep.csv"]

    with all_or_nothing():
        atomic_write(keep, _write(b"new"))
        with all_or_nothing():  # a nested block joins the outer one
            atomic_write(tmp_path / "new.json", _write(b"{}"))
        assert not (tmp_path / "new.json").exists()
    assert keep.read_text() == "new" and (tmp_path / "new.json").read_text() == "{}"
    assert _no_temporaries(tmp_path)


def test_a_file_written_alone_does_not_join_the_batch(tmp_path):
    """A cache file written during a command is none of its outputs: it lands at once and stays
    when the outputs fail."""
    with pytest.raises(RuntimeError, match="plot failed"), all_or_nothing():
        atomic_write(tmp_path / "out.csv", _write(b"rows"))
        atomic_write(tmp_path / "cache.xla", _write(b"exe"), alone=True)
        assert (tmp_path / "cache.xla").read_bytes() == b"exe"
        raise RuntimeError("plot failed")
    assert sorted(os.listdir(tmp_path)) == ["cache.xla"]
    assert _no_temporaries(tmp_path)


def test_a_target_that_became_a_directory_stops_the_whole_batch(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"b\.json: is a directory"), all_or_nothing():
        atomic_write(tmp_path / "a.json", _write(b"a"))
        atomic_write(tmp_path / "b.json", _write(b"b"))
        (tmp_path / "b.json").mkdir()
    assert sorted(os.listdir(tmp_path)) == ["b.json"]


def test_two_outputs_naming_one_file_or_an_input_are_refused(tmp_path):
    (tmp_path / "in.jasm").write_text("")
    (tmp_path / "alias.csv").symlink_to(tmp_path / "p.csv")
    with pytest.raises(InvalidArgumentError, match="both --csv and --plot would write this one file"):
        check_output_paths({"--csv": tmp_path / "p.csv", "--plot": tmp_path / "alias.csv"})
    with pytest.raises(InvalidArgumentError, match="would overwrite the input"):
        check_output_paths([tmp_path / "in.jasm"], inputs=[tmp_path / "in.jasm"])
    # a model name is not a file: nothing to overwrite
    assert check_output_paths([None, tmp_path / "t.json"], inputs=["gpt-oss-120b", None]) == [
        tmp_path / "t.json"]
