"""``jalapeno-emu asm`` / ``disasm`` in-process: file round trips, JSON, and one-line errors (exit 2)
that leave nothing written."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from jalapeno_emu.cli.main import main
from jalapeno_emu.isa import assemble, decode_program

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "asm" / "tile_matmul.jasm"


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "tile.jasm"
    shutil.copy(EXAMPLE, path)
    return path


def _one_line_error(capsys, argv, message):
    assert main([str(a) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and message in captured.err, captured.err
    assert captured.err.strip().count("\n") == 0 and "Traceback" not in captured.err
    return captured.err


def test_asm_then_disasm_round_trips_through_files(src, tmp_path, capsys):
    out = tmp_path / "tile.bin"
    assert main(["asm", str(src), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip().startswith(f"wrote {out}: 14 instructions,")
    original = assemble(src.read_text(), source=str(src))
    unsourced = tuple(dataclasses.replace(i, source="") for i in original.instructions)
    assert decode_program(out.read_bytes()) == dataclasses.replace(original, instructions=unsourced)

    back = tmp_path / "back.jasm"
    assert main(["disasm", str(out), "-o", str(back)]) == 0
    capsys.readouterr()
    again = assemble(back.read_text(), source="back.jasm")
    strip = [(i.mnemonic, i.engine, i.args) for i in again.instructions]
    assert strip == [(i.mnemonic, i.engine, i.args) for i in original.instructions]
    assert (again.allocations, again.semaphores, again.inits) == (
        original.allocations, original.semaphores, original.inits)

    assert main(["disasm", str(out)]) == 0
    assert capsys.readouterr().out == back.read_text()  # stdout unmangled: "[0]" survives
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_default_output_is_next_to_the_source(src, capsys):
    assert main(["asm", str(src)]) == 0
    assert src.with_suffix(".bin").read_bytes()[:4] == b"JEMU"


def test_json_outputs(src, tmp_path, capsys):
    out = tmp_path / "t.bin"
    assert main(["asm", str(src), "-o", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"schema_version": 1, "command": "asm", "kernel": "tile_matmul", "instructions": 14,
                   "bytes": out.stat().st_size, "output": str(out)}
    assert main(["disasm", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and doc["command"] == "disasm" and doc["output"] is None
    first = doc["instructions"][0]
    assert first["engine"] == "c0.dma0" and first["mnemonic"] == "dma.load"
    assert first["text"].startswith("c0.dma0: dma.load sram[0]:0x0:fp4[32,64]")
    assert first["source"] == ""  # the binary keeps no sources (isa/encoding.py)


def test_a_bad_statement_is_one_line_and_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.jasm"
    bad.write_text(".alloc hbm A 0 64\nc0.dma0: dma.load sram[0]:0:f32[4,4], hbm:0:f32[4,4]\n"
                   "c0.vpu: vec.unary exp, sram[1]:0x0:f32[4,4], sram[0]:0:f32[4,4]\n")
    out = tmp_path / "bad.bin"
    err = _one_line_error(capsys, ["asm", bad, "-o", out], f"{bad}:3:1: vec.unary: rule `dst.core == ")
    assert "dst.core=1, src.core=0, core=0" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.jasm"]


def test_an_existing_output_survives_a_failed_run(src, tmp_path, capsys):
    out = tmp_path / "keep.bin"
    out.write_bytes(b"previous")
    src.write_text(src.read_text() + "c0.mxu: mxu.matmull\n")
    _one_line_error(capsys, ["asm", src, "-o", out], "unknown mnemonic 'mxu.matmull'")
    assert out.read_bytes() == b"previous"


def test_rich_markup_in_messages_is_printed_verbatim(tmp_path, capsys):
    bad = tmp_path / "m.jasm"
    bad.write_text("c0.vpu: vec.unary exp, hbm:0x0:f32[8,8], sram[0]:0:f32[8,8]\n")
    err = _one_line_error(capsys, ["asm", bad], "operand dst is in hbm")
    assert "[hbm:0x0..0x100]" in err  # the region list in brackets is not eaten as a style tag


@pytest.mark.parametrize(
    ("setup", "argv", "message"),
    [
        (None, ["asm", "{tmp}/missing.jasm"], "missing.jasm: no such file"),
        (None, ["asm", "{tmp}"], "is a directory, not a file"),
        ("binary", ["asm", "{tmp}/x.bin"], "this is a jalapeno-emu binary, not assembly text"),
        ("nul", ["asm", "{tmp}/x.jasm"], "byte 3 is NUL: this is a binary file"),
        ("latin1", ["asm", "{tmp}/x.jasm"], "byte 2 is not UTF-8"),
        (None, ["disasm", "{tmp}/missing.bin"], "missing.bin: no such file"),
        (None, ["disasm", "{tmp}"], "is a directory, not a file"),
        ("text", ["disasm", "{tmp}/x.jasm"], "byte 0: not a jalapeno-emu binary"),
        ("truncated", ["disasm", "{tmp}/x.bin"], "truncated"),
        ("text", ["asm", "{tmp}/x.jasm", "-o", "{tmp}/nodir/x.bin"], "does not exist"),
        ("text", ["asm", "{tmp}/x.jasm", "-o", "{tmp}/x.jasm"], "would overwrite the input"),
        ("text", ["asm", "{tmp}/x.jasm", "-o", "{tmp}"], "is a directory; give a file name"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, capsys, setup, argv, message):
    if setup == "binary":
        assert main(["asm", str(EXAMPLE), "-o", str(tmp_path / "x.bin")]) == 0
        capsys.readouterr()
    elif setup == "nul":
        (tmp_path / "x.jasm").write_bytes(b"; a\0b\n")
    elif setup == "latin1":
        (tmp_path / "x.jasm").write_bytes(b"; \xe9t\xe9\n")
    elif setup == "text":
        (tmp_path / "x.jasm").write_text("c0.mxu: sem.signal 1\n")
    elif setup == "truncated":
        assert main(["asm", str(EXAMPLE), "-o", str(tmp_path / "x.bin")]) == 0
        capsys.readouterr()
        (tmp_path / "x.bin").write_bytes((tmp_path / "x.bin").read_bytes()[:-7])
    before = sorted(p.name for p in tmp_path.rglob("*"))
    err = _one_line_error(capsys, [a.format(tmp=tmp_path) for a in argv], message)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    if setup == "text" and argv[0] == "disasm":
        assert "use `jalapeno-emu asm` on it" in err


EXAMPLES = sorted(EXAMPLE.parent.glob("*.jasm"))


def test_the_binary_does_not_depend_on_the_folder(tmp_path, monkeypatch, capsys):
    # Issue 13: the path as given was in every instruction's source, so the bytes changed with it.
    text = EXAMPLE.read_text()
    blobs = []
    for where, arg in (("a", "tile.jasm"), ("b/c", None)):
        folder = tmp_path / where
        folder.mkdir(parents=True)
        (folder / "tile.jasm").write_text(text)
        monkeypatch.chdir(folder)
        source = arg or str((folder / "tile.jasm").resolve())  # relative, then absolute
        assert main(["asm", source, "-o", str(folder / "tile.bin")]) == 0
        blobs.append((folder / "tile.bin").read_bytes())
    capsys.readouterr()
    assert blobs[0] == blobs[1]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_asm_disasm_asm_gives_back_the_same_bytes(example, tmp_path, capsys):
    first, text, second = tmp_path / "first.bin", tmp_path / "back.jasm", tmp_path / "second.bin"
    assert main(["asm", str(example), "-o", str(first)]) == 0
    assert main(["disasm", str(first), "-o", str(text)]) == 0
    assert main(["asm", str(text), "-o", str(second)]) == 0
    capsys.readouterr()
    assert second.read_bytes() == first.read_bytes()


@pytest.mark.parametrize(
    ("statement", "column", "message"),
    [
        ("c0.mxu: sem.signal " + "9" * 5000, 20,
         "sem.signal operand sem 9999999999999999...9999 (5,000 characters) does not fit in 32 bits: "
         "the binary format stores it as u32 (0..4294967295)"),
        ("c0.vpu: barrier " + "1" * 5000 + ", 1", 17, "does not fit in 64 bits: the binary format stores "
         "it as i64 (-9223372036854775808..9223372036854775807)"),
        (".alloc hbm A 0x" + "f" * 5000 + " 64", 14, "allocation offset 0xffffffffffffff...ffff (5,002 "
         "characters) does not fit in 64 bits"),
        ("c" + "1" * 5000 + ".mxu: sem.signal 1", 1, "has a core or queue number of 5,000 digits"),
    ],
)
def test_a_huge_integer_is_one_line_naming_the_column_and_the_field(tmp_path, capsys, statement, column,
                                                                      message):
    bad = tmp_path / "big.jasm"
    bad.write_text(f"; too big\n{statement}\n")
    err = _one_line_error(capsys, ["asm", bad], f"{bad}:2:{column}: ")
    assert message in err and len(err) < 400
