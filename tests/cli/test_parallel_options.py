"""``--workers`` and ``--scheduler`` on sweep, compare and validate: one-line errors before any work."""

import sys

import pytest

from jalapeno_emu.cli.main import main

COMMANDS = {
    "sweep": ["sweep", "--model", "tiny-gpt-oss", "--isl", "128", "--osl", "16"],
    "compare": ["compare", "--model", "tiny-gpt-oss", "--isl", "128", "--osl", "16",
                "--presets", "tiny,jalapeno-v1"],
    "validate": ["validate", "--rows", "17"],
}


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("workers", ["0", "-2", "two"])
def test_workers_must_be_a_positive_integer(capsys, command, workers):
    assert main([*COMMANDS[command], "--workers", workers]) == 2
    assert f"argument --workers: '{workers}' must be an integer >= 1" in _one_line_error(capsys)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_scheduler_without_distributed_installed_is_one_line(capsys, monkeypatch, command):
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if not installed, whatever this machine has
    assert main([*COMMANDS[command], "--scheduler", "tcp://x:1"]) == 2
    err = _one_line_error(capsys)
    assert "tcp://x:1" in err and "needs the 'distributed' package" in err
    assert "pip install 'jalapeno-emu[distributed]'" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_workers_and_scheduler_exclude_each_other(capsys, command):
    assert main([*COMMANDS[command], "--workers", "2", "--scheduler", "tcp://x:1"]) == 2
    assert "argument --scheduler: not allowed with argument --workers" in _one_line_error(capsys)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_documents_both_options(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--workers N" in out and "--scheduler ADDRESS" in out and "not with --workers" in out
