"""``jalapeno-emu asm`` and ``jalapeno-emu disasm``: assembly text <-> the binary program format.

``asm FILE.jasm -o FILE.bin`` assembles, checks every instruction against the ISA table and
writes the encoding, without instruction sources, so the bytes depend only on the program (the
same text assembled anywhere, and asm -> disasm -> asm, give the same bytes); ``disasm FILE.bin
[-o FILE.jasm]`` turns a binary back into assembly. Both check the output path before reading
the input and write their output atomically (a temporary file in the same directory, then a
rename), so a failed run leaves no partial file behind (:mod:`jalapeno_emu.files`). Bad input is
one ``error:`` line and exit status 2; an input that is not a regular file (a FIFO, a device) is
refused before it is opened.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jalapeno_emu.cli.app import App, output_file
from jalapeno_emu.errors import AssemblyError, InvalidArgumentError
from jalapeno_emu.files import atomic_write, check_output_paths, read_input_bytes
from jalapeno_emu.isa.asm import assemble, disassemble, format_instruction
from jalapeno_emu.isa.encoding import MAGIC, decode_program, encode_program
from jalapeno_emu.isa.legality import check_legality


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``asm`` and ``disasm`` commands."""
    p = sub.add_parser("asm", help="assemble a .jasm file into the binary program format")
    p.add_argument("file", metavar="FILE.jasm", help="assembly source")
    p.add_argument("-o", "--output", metavar="FILE.bin", type=output_file,
                   help="where to write the binary (default: FILE with the suffix .bin)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(run=run_asm)

    d = sub.add_parser("disasm", help="disassemble a binary program into assembly text")
    d.add_argument("file", metavar="FILE.bin", help="binary written by `jalapeno-emu asm`")
    d.add_argument("-o", "--output", metavar="FILE.jasm", type=output_file,
                   help="write the assembly here instead of stdout")
    d.add_argument("--json", action="store_true", help="print the instructions as JSON")
    d.set_defaults(run=run_disasm)


def _read(path: Path, what: str) -> bytes:
    """The file's bytes; a missing file, a directory, a FIFO or a device is one readable error
    (:func:`jalapeno_emu.files.read_input_bytes`: reading a FIFO would wait for a writer)."""
    return read_input_bytes(path, what=what)


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (:func:`jalapeno_emu.files.atomic_write`:
    a directory, FIFO or device there is refused, a symlink written through)."""
    try:
        atomic_write(path, lambda f: f.write(data))
    except OSError as exc:
        raise InvalidArgumentError(f"{path}: cannot write ({exc.strerror or exc})") from None


def run_asm(app: App, args: argparse.Namespace) -> int:
    """Assemble, check and encode one file."""
    src = Path(args.file)
    out = Path(args.output) if args.output else src.with_suffix(".bin")
    data = _read(src, "assembly source")
    if data.startswith(MAGIC):
        raise AssemblyError("this is a jalapeno-emu binary, not assembly text", source=str(src),
                            hint="use `jalapeno-emu disasm` on it")
    nul = data.find(b"\0")
    if nul >= 0:
        raise AssemblyError(f"byte {nul} is NUL: this is a binary file, not assembly text", source=str(src))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AssemblyError(f"byte {exc.start} is not UTF-8: this is not assembly text",
                            source=str(src)) from None
    # Before assembling: -o was checked at parse time, the default path not; after the checks
    # above, so that `asm K.bin` says it is a binary rather than that it would be overwritten.
    check_output_paths([out], inputs=[src])
    program = assemble(text, source=str(src))
    check_legality(program)  # assemble checks each line; this also covers the whole-program checks
    # No instruction sources: they hold the path as given, so the bytes would depend on the folder
    # the file was assembled from and would not survive asm -> disasm -> asm (isa/encoding.py).
    blob = encode_program(program, sources=False)
    _write(out, blob)
    if app.json_output:
        app.emit_json("asm", {"kernel": program.name, "instructions": len(program.instructions),
                              "bytes": len(blob), "output": str(out)})
    else:
        app.console.print(f"wrote {out}: {len(program.instructions)} instructions, {len(blob)} bytes",
                          markup=False, soft_wrap=True)
    return 0


def run_disasm(app: App, args: argparse.Namespace) -> int:
    """Decode one binary and print or write its assembly."""
    src = Path(args.file)
    out = Path(args.output) if args.output else None
    check_output_paths([out], inputs=[src])
    program = decode_program(_read(src, "binary program"), source=str(src))
    text = disassemble(program)
    if out is not None:
        _write(out, text.encode("utf-8"))
    if app.json_output:
        sems = dict(program.semaphores)
        app.emit_json("disasm", {
            "kernel": program.name,
            "preset": program.preset,
            "output": str(out) if out is not None else None,
            "instructions": [
                {"index": i, "engine": str(ins.engine), "mnemonic": ins.mnemonic,
                 "text": format_instruction(ins, sem_names=sems),
                 "source": ins.source}
                for i, ins in enumerate(program.instructions)
            ],
        })
    elif out is None:
        sys.stdout.write(text)  # not through rich: its markup would eat the "[c0]"-like brackets
    else:
        app.console.print(f"wrote {out}: {len(program.instructions)} instructions", markup=False,
                          soft_wrap=True)
    return 0
