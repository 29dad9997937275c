"""Every output option, checked before computing (issue 13): a directory, FIFO, device node or a
missing directory at the path is one error line naming the user's path, with nothing computed and
nothing replaced; ``sweep --plot`` takes its format from the suffix; a sweep's outputs appear
together or not at all; ``compare`` errors reach stderr; no command is a usage error."""

import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest

import jalapeno_emu.kernels
import jalapeno_emu.model
import jalapeno_emu.rack.deployment
import jalapeno_emu.serving
from jalapeno_emu.cli import asm as asm_cli
from jalapeno_emu.cli import run as run_cli
from jalapeno_emu.cli.main import main
from tests.serving.models import roofline

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "asm" / "tile_matmul.jasm"
TINY = ["--model", "tiny-gpt-oss", "--isl", "128", "--osl", "16"]


class Computed(Exception):
    """Raised by the patched computation: reaching it means the output was checked too late."""


def _computes(*_args, **_kwargs):
    raise Computed


# (argv with {out} for the output path, module, attribute that does the work)
COMMANDS = {
    "asm": (["asm", "{src}", "-o", "{out}"], asm_cli, "assemble"),
    "disasm": (["disasm", "{bin}", "-o", "{out}"], asm_cli, "decode_program"),
    "run": (["run", "{src}", "--trace", "{out}"], run_cli, "check_program"),
    "kernel": (["kernel", "gemm", "--trace", "{out}"], jalapeno_emu.kernels, "run_kernel"),
    "layer": (["layer", "--model", "tiny-gpt-oss", "--phase", "decode", "--trace", "{out}"],
              jalapeno_emu.model, "load_model_config"),
    "model": (["model", "--model", "tiny-gpt-oss", "--phase", "decode", "--trace", "{out}"],
              jalapeno_emu.model, "load_model_config"),
    "sweep --csv": (["sweep", *TINY, "--csv", "{out}"], jalapeno_emu.rack.deployment, "sweep_mappings"),
    "sweep --plot": (["sweep", *TINY, "--plot", "{out}"], jalapeno_emu.rack.deployment, "sweep_mappings"),
}


@pytest.fixture
def files(tmp_path):
    """The inputs and the awkward outputs: a directory, a FIFO, a path in a missing directory."""
    src = tmp_path / "tile.jasm"
    shutil.copy(EXAMPLE, src)
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir.png").mkdir()
    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "tile.bin").write_bytes(b"JEMU")  # never decoded: the output is refused first
    return tmp_path


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("out", "message"), [
    ("adir", "is a directory; give a file name"),
    ("fifo.png", "is a FIFO (named pipe), not a regular file; refusing to replace it"),
    ("missing/x.png", "directory {files}/missing does not exist"),
])
def test_an_unwritable_output_is_refused_before_computing(files, capsys, monkeypatch, command, out, message):
    argv, module, attribute = COMMANDS[command]
    if command == "sweep --plot" and out == "adir":
        out = "adir.png"  # a bare "adir" is refused for its suffix (below)
    monkeypatch.setattr(module, attribute, _computes)
    monkeypatch.chdir(files)
    before = sorted(p.name for p in files.rglob("*"))
    started = time.perf_counter()
    assert main([a.format(src="tile.jasm", bin="tile.bin", out=out) for a in argv]) == 2
    assert time.perf_counter() - started < 1
    captured = capsys.readouterr()
    message = message.format(files=files)
    assert captured.err.startswith("error: ") and f"{out}: {message}" in captured.err, captured.err
    assert captured.err.count("\n") == 1 and ".tmp" not in captured.err and not captured.out
    assert sorted(p.name for p in files.rglob("*")) == before
    assert stat.S_ISFIFO(os.lstat(files / "fifo.png").st_mode)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_character_device_is_refused_and_never_written(files, capsys, monkeypatch, command):
    argv, module, attribute = COMMANDS[command]
    monkeypatch.setattr(module, attribute, _computes)
    monkeypatch.chdir(files)
    link = files / "null.png"
    link.symlink_to("/dev/null")  # through a symlink, too: the link's target is what counts
    for out in ("/dev/null", "null.png"):
        assert main([a.format(src="tile.jasm", bin="tile.bin", out=out) for a in argv]) == 2
        assert f"{out}" in capsys.readouterr().err
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode) and link.is_symlink()


def test_the_default_asm_output_is_checked_before_assembling(files, capsys, monkeypatch):
    monkeypatch.setattr(asm_cli, "assemble", _computes)
    (files / "tile.bin").unlink()
    os.mkfifo(files / "tile.bin")
    assert main(["asm", str(files / "tile.jasm")]) == 2
    assert "tile.bin: is a FIFO" in capsys.readouterr().err
    assert stat.S_ISFIFO(os.lstat(files / "tile.bin").st_mode)


def test_run_trace_over_its_own_program_is_refused(files, capsys, monkeypatch):
    monkeypatch.setattr(run_cli, "check_program", _computes)
    assert main(["run", str(files / "tile.jasm"), "--trace", str(files / "tile.jasm")]) == 2
    assert "would overwrite the input" in capsys.readouterr().err
    assert (files / "tile.jasm").read_text() == EXAMPLE.read_text()


def test_a_trace_through_a_symlink_replaces_the_target_and_keeps_the_link(tmp_path, capsys):
    real = tmp_path / "traces" / "t.json"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(real)
    assert main(["run", str(EXAMPLE), "--timing-only", "--trace", str(link), "--json"]) == 0
    capsys.readouterr()
    assert link.is_symlink() and "traceEvents" in json.loads(real.read_text())


@pytest.fixture(scope="module")
def points():
    models = [roofline(name="tp4"), roofline(name="tp8", chips=8, flops_per_s=8e15, bytes_per_s=4e13)]
    power = {"package": 700, "sustained": 550, "all_in": 1180}
    return jalapeno_emu.serving.sweep(models, [1, 2], power_w=power, isl=400, osl=40, requests=8)


@pytest.fixture
def quick_sweep(monkeypatch, points):
    """``sweep`` with its simulation replaced by canned points: only the outputs are under test."""
    monkeypatch.setattr(jalapeno_emu.rack.deployment, "sweep_mappings",
                        lambda *_a, **_k: (points, len({p.mapping for p in points})))


@pytest.mark.parametrize(("plot", "written"), [("f.png", ["f.png", "f.svg", "p.csv"]),
                                               ("F.SVG", ["F.SVG", "p.csv"])])
def test_sweep_plot_takes_its_format_from_the_suffix(tmp_path, capsys, quick_sweep, plot, written):
    assert main(["sweep", *TINY, "--plot", str(tmp_path / plot), "--csv", str(tmp_path / "p.csv")]) == 0
    capsys.readouterr()
    assert sorted(os.listdir(tmp_path)) == written
    if plot.endswith("SVG"):
        assert (tmp_path / plot).read_text().lstrip().startswith("<?xml")
    else:
        assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("plot", "message"), [
    ("adir", "{path}: is a directory"),  # used to write adir.png and adir.svg beside it
    ("plot", "--plot {path}: the file name must end in .png (a PNG, with an SVG beside it) or .svg"),
    ("plot.pdf", "--plot {path}: the file name must end in .png"),
])
def test_sweep_plot_without_a_known_suffix_is_refused(tmp_path, capsys, monkeypatch, plot, message):
    monkeypatch.setattr(jalapeno_emu.rack.deployment, "sweep_mappings", _computes)
    (tmp_path / "adir").mkdir()
    assert main(["sweep", *TINY, "--plot", str(tmp_path / plot)]) == 2
    assert message.format(path=tmp_path / plot) in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["adir"] and not os.listdir(tmp_path / "adir")


def test_sweep_outputs_clashing_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(jalapeno_emu.rack.deployment, "sweep_mappings", _computes)
    argv = ["sweep", *TINY, "--plot", str(tmp_path / "f.png"), "--csv", str(tmp_path / "f.svg")]
    assert main(argv) == 2
    assert "both --csv and the SVG beside --plot" in capsys.readouterr().err


def test_a_failed_plot_leaves_no_csv_behind(tmp_path, capsys, monkeypatch, quick_sweep):
    def broken_plot(*_args, **_kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "f.png"))

    monkeypatch.setattr(jalapeno_emu.serving, "plot_pareto", broken_plot)
    (tmp_path / "p.csv").write_text("previous")
    assert main(["sweep", *TINY, "--plot", str(tmp_path / "f.png"), "--csv", str(tmp_path / "p.csv")]) == 2
    assert "f.png: No space left on device" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["p.csv"] and (tmp_path / "p.csv").read_text() == "previous"


def test_compare_an_unknown_preset_is_one_line_on_stderr_before_anything_runs(capsys, monkeypatch):
    monkeypatch.setattr(jalapeno_emu.rack.deployment, "compare_presets", _computes)
    for extra in (["--json"], []):
        assert main(["compare", *TINY, "--presets", "jalapeno-v1,bogus", *extra]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("error: --presets: unknown chip preset 'bogus'"), captured.err
        assert captured.err.count("\n") == 1 and not captured.out


def test_compare_errors_reach_stderr_with_json_too(capsys, monkeypatch):
    point = {"mapping": "tp=1", "chips": 1, "interactivity_tok_s_user": 10.0, "e2e_s": 1.0,
             "throughput_tok_s_per_chip": 20.0, "tok_s_per_kw": {"all_in": 5.0}}
    monkeypatch.setattr(jalapeno_emu.rack.deployment, "compare_presets", lambda *_a, **_k: (
        {"jalapeno-v1": [point]}, {"h200": "kernel gemm cannot run on h200"}))
    assert main(["compare", *TINY, "--presets", "jalapeno-v1,h200", "--concurrency", "2", "--json",
                 "--workers", "1"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["errors"] == {"h200": "kernel gemm cannot run on h200"}
    assert captured.err == "error: h200: kernel gemm cannot run on h200\n"


def test_no_command_is_a_usage_error_on_stderr(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert not captured.out
    assert captured.err.startswith("usage: jalapeno-emu") and "error: no command given" in captured.err
