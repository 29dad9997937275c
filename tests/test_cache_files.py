"""The cache directory: what ``survey`` counts as stale, what ``prune`` and ``clear`` remove, the
``cache`` command, and the executable store's keys naming the code that wrote them."""

import json
import os
import time

import pytest

from jalapeno_emu.cache_files import clear, prune, survey
from jalapeno_emu.cli.main import main
from jalapeno_emu.emu import executable_store
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.fingerprint import code_fingerprint

OLD_S = time.time() - 40 * 86400


def _file(path, text="x", old=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if old:
        os.utime(path, (OLD_S, OLD_S))
    return path


@pytest.fixture
def cache(tmp_path):
    code, other = code_fingerprint(), "0123456789abcdef"
    root = tmp_path / "cache"
    f = {
        "timings_now": _file(root / f"timings-aaaa-{code}.jsonl"),
        "timings_old": _file(root / f"timings-aaaa-{other}.jsonl"),
        "steps_now": _file(root / f"step-timings-aaaa-{code}" / "k.json"),
        "steps_old": _file(root / f"step-timings-aaaa-{other}" / "k.json"),
        "key_now": _file(root / "jax/executables/k1.key", f"a.xla\n{code}\n"),
        "key_other": _file(root / "jax/executables/k2.key", f"b.xla\n{other}\n"),
        "key_unused": _file(root / "jax/executables/k3.key", f"c.xla\n{code}\n", old=True),
        "key_one_line": _file(root / "jax/executables/k4.key", "d.xla"),  # written before keys named code
        "a": _file(root / "jax/executables/a.xla", old=True),  # named by a fresh key: kept however old
        "b": _file(root / "jax/executables/b.xla"),  # only other code named it: stale at once
        "c": _file(root / "jax/executables/c.xla", old=True),  # its key is unused: stale
        "d": _file(root / "jax/executables/d.xla"),
        "orphan_new": _file(root / "jax/executables/e.xla"),  # perhaps about to be named: kept
        "jax_old": _file(root / "jax/jit_f-1-cache", old=True),
        "jax_new": _file(root / "jax/jit_f-2-cache"),
        "mine_not": _file(root / "notes.txt"),  # not the cache's: never touched
    }
    return root, f


def test_survey_counts_what_no_run_of_this_code_reads_as_stale(cache):
    root, f = cache
    parts = {p.name: p for p in survey(root)}
    assert [(parts[n].files, parts[n].stale_files) for n in
            ("kernel timings", "step timings", "stored executables", "JAX compile cache")] == \
        [(2, 1), (2, 1), (9, 4), (2, 1)]
    assert parts["kernel timings"].stale_bytes == f["timings_old"].stat().st_size
    with pytest.raises(InvalidArgumentError, match="older_than_days"):
        survey(root, older_than_days=-1)


def test_prune_removes_the_stale_files_and_clear_every_file_of_the_cache(cache):
    root, f = cache
    sizes = {name: path.stat().st_size for name, path in f.items()}
    removed, freed = prune(root)
    gone = {name for name, path in f.items() if not path.exists()}
    assert gone == {"timings_old", "steps_old", "key_other", "key_unused", "b", "c", "jax_old"}
    assert removed == len(gone) and freed == sum(sizes[name] for name in gone)
    assert not (root / f"step-timings-aaaa-{'0123456789abcdef'}").exists()  # its empty directory too
    assert prune(root) == (0, 0)
    # with no age allowed, every executable and JAX entry goes; this code's timings stay
    assert prune(root, older_than_days=0)[0] == 6
    assert f["timings_now"].exists() and f["steps_now"].exists()
    assert clear(root)[0] == 2 and [p.name for p in root.iterdir()] == ["notes.txt"]


def test_the_cache_command_shows_prunes_and_refuses_a_bad_age(cache, monkeypatch, capsys):
    root, _ = cache
    monkeypatch.setenv("JALAPENO_EMU_CACHE_DIR", str(root))
    assert main(["cache", "show", "--json", "--older-than", "30d"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["command"] == "cache show" and doc["root"] == str(root)
    assert sum(p["stale_files"] for p in doc["parts"]) == 7
    assert main(["cache", "prune", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed_files"] == 7
    assert main(["cache", "prune", "--older-than", "soon"]) == 2
    assert "number of days" in capsys.readouterr().err
    assert main(["cache", "clear"]) == 0 and "removed 8 files" in capsys.readouterr().out


def test_a_stored_key_names_its_executable_and_the_code_that_wrote_it(tmp_path):
    key = tmp_path / "k.key"
    executable_store._write_name(key, "abc.xla")
    assert key.read_text().split() == ["abc.xla", code_fingerprint()]
    assert executable_store._read_name(key) == "abc.xla"
    key.write_text("old.xla")  # a key written before keys named their code still reads
    assert executable_store._read_name(key) == "old.xla"
    key.write_text("../x.xla\nabc")
    assert executable_store._read_name(key) is None
