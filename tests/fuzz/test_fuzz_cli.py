"""Fuzzing the command line: ``jalapeno-emu`` with random arguments exits with a status and at most
one error line, never a traceback, never a hang, and never harms a file it should not touch.

Each example is an argv for one real command, built from its real options: values small enough
to run in a second on the tiny preset (kernels timing-only), the invalid spellings a user types
(zero, negative, text, a number of 23 digits, an unknown preset or model), input files that are
valid, mutated, empty, a directory, a FIFO, missing or a symlink, and output paths that are new,
existing, a directory, a FIFO, in a missing folder, a symlink or a symlink loop. Runs in-process
(``main(argv)``), so an uncaught exception fails the test with its traceback.

Checked after every run:

- the status is an int, and 2 comes with an ``error:`` line on stderr;
- ``--json`` output that succeeded is one strict JSON document (no NaN or Infinity);
- a FIFO, directory or symlink given as an output is still what it was; a pre-existing file is
  untouched unless the command succeeded; a failed command leaves no new output behind, and no
  command leaves a temporary file.

Commands whose valid runs take tens of seconds (``generate``, ``validate``, ``demo`` without
``--numerics``) always get one argument they must refuse, so what is fuzzed there is the argument
checking. ``--no-compile-cache`` is left out: it switches the compile cache off for the rest of
the test process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hypothesis import event, given
from hypothesis import strategies as st

from jalapeno_emu.cli.main import main
from jalapeno_emu.isa import assemble, encode_program
from jalapeno_emu.kernels.registry import all_kernels
from tests.fuzz.helpers import fuzz_settings, time_limit
from tests.fuzz.test_fuzz_asm import EXAMPLE as EXAMPLE_TEXT
from tests.fuzz.test_fuzz_asm import mutated_example
from tests.fuzz.test_fuzz_binary import mutated_binary

EXAMPLE_BINARY = encode_program(assemble(EXAMPLE_TEXT), sources=False)

# --- the files an example may name -----------------------------------------------------------------
# Names in the example's temporary folder; each is created (or deliberately not) by _files().
INPUTS = ["ex.jasm", "mut.jasm", "ex.bin", "mut.bin", "empty.jasm", "text.bin", "latin1.jasm", "bom.jasm",
          "adir", "fifo", "missing.jasm", "link.jasm", "/dev/null"]
OUTPUTS = ["out.bin", "out.json", "existing.json", "adir", "fifo", "missing/out.json", "link_out", "loop",
           "adir/", ""]
PLOTS = ["p.png", "p.svg", "p.pdf", "p", "adir", "fifo", "missing/p.png"]
_KEEP = b"keep"  # the content of existing.json and link_target before the run


@contextlib.contextmanager
def _files(mutated_text: str, mutated_bytes: bytes) -> Iterator[Path]:
    """A temporary folder holding every input and output of INPUTS / OUTPUTS that exists."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "ex.jasm").write_text(EXAMPLE_TEXT)
        (d / "mut.jasm").write_text(mutated_text, encoding="utf-8", errors="surrogatepass")
        (d / "ex.bin").write_bytes(EXAMPLE_BINARY)
        (d / "mut.bin").write_bytes(mutated_bytes)
        (d / "empty.jasm").write_text("")
        (d / "text.bin").write_text(EXAMPLE_TEXT)
        (d / "latin1.jasm").write_bytes(EXAMPLE_TEXT.replace("Semaphores", "Sémaphores").encode("latin-1"))
        (d / "bom.jasm").write_bytes(b"\xef\xbb\xbf" + EXAMPLE_TEXT.encode())  # as some editors save it
        (d / "adir").mkdir()
        os.mkfifo(d / "fifo")
        (d / "link.jasm").symlink_to(d / "ex.jasm")
        (d / "existing.json").write_bytes(_KEEP)
        (d / "link_target").write_bytes(_KEEP)
        (d / "link_out").symlink_to(d / "link_target")
        (d / "loop").symlink_to(d / "loop")
        yield d


def _path(d: Path, name: str) -> str:
    """The absolute path of ``name`` in folder ``d`` (absolute names and "" as they are)."""
    return name if not name or name.startswith("/") else str(d / name) + ("/" if name.endswith("/") else "")


# --- values ----------------------------------------------------------------------------------------
BAD_INTS = ["0", "-1", "x", "1.5", "", "99999999999999999999999", "2147483648", "1e3", "0x10"]


def mostly(good: list[str], bad: list[str]) -> st.SearchStrategy[str]:
    """One of ``good`` five times in six, else one of ``bad``: a command with several options then
    still often runs (its success path is fuzzed too), and every option is sometimes wrong."""
    return st.integers(0, 5).flatmap(lambda i: st.sampled_from(bad if i == 0 else good))


def ints(*small: str) -> st.SearchStrategy[str]:
    """A small valid integer most of the time, else one of the spellings users get wrong."""
    return mostly(list(small or ("1", "2", "4")), BAD_INTS)


PRESETS = mostly(["tiny"], ["bogus", "tin", "TINY", ""])
MODELS = mostly(["tiny-gpt-oss", "tiny-gpt-oss", "tiny-deepseek", "tiny-kimi"],
                ["gpt-oss-120b", "bogus", "missing/config.json", ""])
SETS = mostly(
    ["hbm.efficiency=0.5", "core.count=1", "core.count=4", "core.clock_hz=2GHz", "software.fusion=layer",
     "sram.scratchpad_bytes=128KiB", "hbm.efficiency=0.5,core.count=1"],
    ["bogus.key=1", "core.count=0", "core.count=1e300", "hbm.stacks=1e300", "core.clock_hz=1e1000000",
     "matrix.tile_k=1e18", "core.count=9223372036854775808", "x", "=",
     "hbm.efficiency=0.5 core.count=1"])  # one token with a space: two items need two tokens
FUSIONS = mostly(["none", "layer", "step"], ["bogus"])


def kernel_shapes(name: str) -> st.SearchStrategy[list[str]]:
    """``KEY=VALUE`` items for kernel ``name``: its real keys with small, edge and wrong values."""
    keys = {k.name: k for kd in all_kernels() if kd.name == name for k in kd.shape_keys}

    def values(key: str) -> st.SearchStrategy[str]:
        k = keys.get(key)
        if k is None:
            return st.sampled_from(["1", "x"])
        if k.type is bool:
            return st.sampled_from(["true", "false", "1", "no", "maybe", ""])
        if k.type is str:
            return st.sampled_from([*k.choices, "e4m3", "bfloat16", "fp16", ""])
        if k.type is float:
            return st.sampled_from([str(k.default), "0.5", "0", "-1", "nan", "inf", "1e400", "x", "1e9"])
        limit = k.limit.maximum if k.limit else 2**31
        edge = [str(k.minimum or 0), str(limit), str(limit + 1)]
        return st.sampled_from([str(k.default), str(k.default), "1", "2", "32", "64", *edge, *BAD_INTS])

    key_names = st.sampled_from(["bogus", "M", ""])  # no such key
    if keys:  # (a name that is no kernel has none)
        key_names = st.one_of(st.sampled_from(sorted(keys)), key_names)
    return st.lists(key_names.flatmap(lambda key: values(key).map(lambda v: f"{key}={v}")), max_size=3)


KERNELS = sorted(kd.name for kd in all_kernels())
COMMAND_NAMES = {"chip", "asm", "disasm", "run", "bench", "kernel", "layer", "model", "serve", "sweep",
                 "compare", "demo", "generate", "validate"}


# --- argv per command ------------------------------------------------------------------------------
@st.composite
def options(draw: st.DrawFn, table: dict[str, st.SearchStrategy | None], forced: dict[str, st.SearchStrategy]
            ) -> list[str]:
    """Some of ``table``'s options (flag -> value strategy, None for a switch) in random order, and
    every option of ``forced`` (the small sizes that keep a run short)."""
    chosen = draw(st.lists(st.sampled_from(sorted(table)), unique=True, max_size=len(table)))
    argv: list[str] = []
    for flag in [*chosen, *forced]:
        strategy = forced.get(flag, table.get(flag))
        if strategy is None:
            argv.append(flag)
            continue
        value = draw(strategy)
        argv += [flag, *value] if isinstance(value, list) else [flag, value]
    return argv


def choice(good: list[str], bad: list[str]) -> st.SearchStrategy[str]:
    """An option's value: one of its ``good`` choices, sometimes one of the ``bad``."""
    return mostly(good, bad)


OUTPUT_PATHS = mostly(["out.json", "out.bin", "existing.json", "link_out"],
                      ["adir", "fifo", "missing/out.json", "loop", "adir/", ""])
INPUT_JASM = mostly(["ex.jasm", "mut.jasm", "link.jasm"],
                    ["empty.jasm", "latin1.jasm", "bom.jasm", "adir", "fifo", "missing.jasm", "/dev/null"])
INPUT_BIN = mostly(["ex.bin", "mut.bin"],
                   ["text.bin", "ex.jasm", "adir", "fifo", "missing.jasm", "/dev/null"])
SERVING_FORCED = {"--model": MODELS, "--preset": PRESETS, "--isl": ints("16", "32"), "--osl": ints("4", "8")}
SERVING_OPTIONS = {"--routing": choice(["uniform", "zipf:1.2"], ["zipf:0", "zipf:x", "bogus"]),
                   "--finalists": ints("1", "2"), "--max-batch-tokens": ints("64", "256"), "--no-cache": None,
                   "--fusion": FUSIONS, "--json": None, "--chips": ints("1", "2", "4")}


@st.composite
def argvs(draw: st.DrawFn) -> list[str]:
    """A whole argv for one command (see the module docstring); paths are names in the temp folder."""
    command = draw(st.sampled_from(["chip", "asm", "disasm", "run", "run", "bench", "kernel", "kernel",
                                    "layer", "model", "serve", "sweep", "compare", "demo", "generate",
                                    "validate", "top"]))
    sets = st.lists(SETS, min_size=1, max_size=2)
    if command == "top":
        argv = draw(st.sampled_from([[], ["--version"], ["--help"], ["bogus"], ["-x"], ["kernel"], ["chip"],
                                     ["bench"], ["chip", "bogus"], ["--", "kernel"]]))
    elif command == "chip":
        preset = draw(choice(["tiny", "jalapeno-v1", "h100", "mi355x"],
                             ["bogus", "ex.jasm", "adir", "fifo", "missing.toml", "/dev/null"]))
        argv = ["chip", "show", preset, *draw(options({"--set": sets, "--json": None}, {}))]
    elif command in ("asm", "disasm"):
        source = INPUT_JASM if command == "asm" else INPUT_BIN
        argv = [command, draw(source), *draw(options({"-o": OUTPUT_PATHS, "--json": None}, {}))]
    elif command == "run":
        argv = ["run", draw(st.one_of(INPUT_JASM, INPUT_BIN)),
                *draw(options({"--preset": PRESETS, "--set": sets, "--trace": OUTPUT_PATHS, "--debug": None,
                               "--json": None}, {"--timing-only": None}))]
    elif command == "bench":
        which = draw(st.sampled_from(["hbm", "mxu"]))
        size = ({"--bytes": choice(["1MiB", "64KiB"], ["1", "0", "1GiB", "x", "1e1000", "-1MiB"])}
                if which == "hbm" else
                {"--shape": choice(["128x256x512", "256x256x512"],
                                   ["64x64x64", "0x0x0", "x", "1x2", "99999999999x1x1"])})
        forced = {"--preset": choice(["tiny"], ["jalapeno-v1", "bogus"]), **size}
        argv = ["bench", which, *draw(options({"--set": sets, "--json": None}, forced))]
    elif command == "kernel":
        name = draw(choice(KERNELS, ["list", "bogus", ""]))
        argv = ["kernel", name, *draw(options({"--preset": PRESETS, "--set": sets, "--trace": OUTPUT_PATHS,
                                               "--json": None, "--shape": kernel_shapes(name)},
                                              {"--timing-only": None}))]
        # An empty --shape list is a usage error of its own; leave it to the draw that removes it.
        argv = [a for i, a in enumerate(argv) if not (a == "--shape" and (i + 1 == len(argv) or
                                                                         argv[i + 1].startswith("--")))]
    elif command in ("layer", "model"):
        phase = draw(choice(["decode", "prefill"], ["bogus"]))
        # Each phase's own sizes (the other phase's are refused, which the bad draws cover).
        # Each phase's own size is always given: the defaults (8,192 tokens) take minutes.
        table = {"--batch": ints("1", "2"), "--set": sets, "--fusion": FUSIONS, "--json": None,
                 "--routing": choice(["uniform", "any"], ["x"]), "--trace": OUTPUT_PATHS}
        forced = {"--model": MODELS, "--phase": st.just(phase), "--preset": PRESETS}
        if phase == "prefill":
            forced["--seq"] = ints("32", "64")
            table["--chunk"] = ints("0", "32")
        else:
            forced["--context"] = ints("16", "32")
        if command == "layer":
            table["--layer"] = choice(["0", "1"], ["-1", "99", "x"])
        argv = [command, *draw(options(table, forced))]
    elif command == "serve":
        table = {**SERVING_OPTIONS, "--seed": ints("0", "1"),
                 "--mapping": choice(["tp=1,ep=1,dp=1,pp=1"], ["tp=2", "tp=0", "x", "tp=1,tp=2"]),
                 "--objective": choice(["interactivity", "throughput"], ["x"])}
        forced = {**SERVING_FORCED, "--concurrency": ints("1", "2"), "--requests": ints("2", "4")}
        argv = ["serve", *draw(options(table, forced))]
    elif command == "sweep":
        table = {**SERVING_OPTIONS, "--csv": OUTPUT_PATHS,
                 "--plot": choice(["p.png", "p.svg"], ["p.pdf", "p", "adir", "fifo", "missing/p.png"]),
                 "--y": choice(["throughput_tok_s_per_chip", "tok_s_per_kw.all_in"], ["x"])}
        forced = {**SERVING_FORCED, "--workers": choice(["1"], ["0", "x"]),
                  "--concurrency": choice(["1,2", "1", "1,1,1"], ["0", "1,x", "", ",", "99999999"])}
        argv = ["sweep", *draw(options(table, forced))]
    elif command == "compare":
        table = {**SERVING_OPTIONS, "--objective": choice(["interactivity", "throughput"], ["x"]),
                 "--power": choice(["package", "sustained", "all_in"], ["x"])}
        forced = {**SERVING_FORCED, "--workers": st.just("1"),
                  "--presets": choice(["tiny,tiny"], ["tiny", "tiny,bogus", "bogus,tiny", "", "tiny,"]),
                  "--concurrency": choice(["1", "1,2"], ["0", "x"])}
        argv = ["compare", *draw(options(table, forced))]
    elif command == "demo":
        if draw(st.booleans()):  # the numerics demo is quick at small sizes
            argv = ["demo", "--numerics", *draw(options(
                {"--fmt": choice(["e2m1", "fp4", "e4m3", "int8"], ["bogus"]), "--seed": ints("0", "3"),
                 "--json": None},
                {"--rows": choice(["32", "64"], ["31", "0", "x"]),
                 "--cols": choice(["8", "16"], ["0", "-1", "x"])}))]
        else:
            argv = ["demo", *draw(options({"--json": None, "--seed": ints()},
                                          {"--tokens": st.sampled_from(["0", "-1", "x", ""])}))]
    elif command == "generate":
        bad = draw(st.sampled_from([("--tokens", "0"), ("--tokens", "-2"), ("--prompt-len", "0"),
                                    ("--batch", "0"), ("--model", "bogus"), ("--chunk", "-1"),
                                    ("--tokens", "x")]))
        table = {"--model": MODELS, "--prompt-len": ints("4"), "--tokens": ints("1"), "--batch": ints("1"),
                 "--seed": ints("0"), "--preset": PRESETS, "--check": None, "--fusion": FUSIONS,
                 "--json": None}
        table.pop(bad[0], None)  # the bad value is the option's only occurrence
        argv = ["generate", *draw(options(table, {})), *bad]
    else:  # validate
        # Not "" or "1-": both are accepted (see the xfail tests below) and run for many minutes.
        rows = st.sampled_from(["0", "x", "3-1", "99999", " ", "-1", "1,,2", "62", "-", "1--2"])
        argv = ["validate", *draw(options({"--no-calibrate": None, "--json": None,
                                           "--workers": choice(["1"], ["0", "x"])},
                                          {"--rows": rows}))]
    if draw(st.integers(0, 9)) == 0:  # now and then a stray token somewhere
        junk = draw(st.sampled_from(["--bogus", "-", "--", "extra", "--json", "--help", "-h", ""]))
        argv.insert(draw(st.integers(0, len(argv))), junk)
    return argv


# --- the property ----------------------------------------------------------------------------------
def _snapshot(d: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry of the folder: its file type, and the bytes of regular files."""
    out = {}
    for p in sorted(d.rglob("*")):
        mode = os.lstat(p).st_mode
        out[str(p.relative_to(d))] = (stat.S_IFMT(mode), p.read_bytes() if stat.S_ISREG(mode) else None)
    return out


def _strict_json(text: str) -> object:
    """``json.loads`` that refuses NaN and Infinity, which are not JSON."""
    def refuse(constant: str) -> object:
        raise AssertionError(f"--json printed {constant}, which is not JSON")
    return json.loads(text, parse_constant=refuse)


@fuzz_settings(max_examples=120, deadline_s=60)
@given(argvs(), mutated_example(), mutated_binary())
def test_cli_arguments(argv, mutated_text, mutated_bytes):
    with _files(mutated_text, mutated_bytes) as d:
        names = set(INPUTS) | set(OUTPUTS) | set(PLOTS)
        argv = [_path(d, a) if a in names else a for a in argv]
        before = _snapshot(d)
        out, err = io.StringIO(), io.StringIO()
        with time_limit(120, f"jalapeno-emu {' '.join(argv)}"), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's own --help / --version: exit 0, nothing else
                assert exc.code == 0 and {"-h", "--help", "--version"} & set(argv), (argv, exc.code)
                code = 0
        after = _snapshot(d)
    stdout, stderr = out.getvalue(), err.getvalue()
    assert isinstance(code, int), (argv, code)
    assert "Traceback" not in stderr + stdout, stderr
    command = next((a for a in argv if not a.startswith("-")), "(none)")
    event(f"{command if command in COMMAND_NAMES else '(other)'}: exit {code}")
    assert stderr.count("error:") <= 1, stderr  # one line says what is wrong, not a cascade
    if code == 2:
        assert "error:" in stderr, (argv, stderr)
    if code == 0 and "--json" in argv and not {"-h", "--help", "--version"} & set(argv):
        _strict_json(stdout)
    # Files: non-regular outputs stay what they were, and a failure leaves nothing new behind.
    for name, kind in before.items():
        assert name in after, f"{name} was removed"
        if kind[0] != stat.S_IFREG or code != 0:
            assert after[name] == kind, f"{name} changed (exit {code})"
    new = sorted(set(after) - set(before))
    assert not [n for n in new if n.endswith(".tmp")], f"temporary files left behind: {new}"
    if code != 0:
        assert not new, f"outputs of a failed command left behind: {new}"


def test_the_fuzzed_commands_run_at_their_small_sizes():
    # The values the fuzzer calls small must make quick, successful runs, or every fuzzed run of
    # a command would stop at an error and its success path would go untested.
    with _files(EXAMPLE_TEXT, EXAMPLE_BINARY) as d:
        for argv in (["kernel", "moe", "--timing-only", "--json"],
                     ["run", str(d / "ex.bin"), "--timing-only", "--trace", str(d / "t.json")],
                     ["asm", str(d / "ex.jasm"), "-o", str(d / "out.bin")],
                     ["layer", "--model", "tiny-gpt-oss", "--phase", "decode", "--preset", "tiny",
                      "--context", "16"],
                     ["serve", "--model", "tiny-gpt-oss", "--preset", "tiny", "--isl", "16", "--osl", "4",
                      "--concurrency", "1", "--requests", "2", "--json"],
                     ["sweep", "--model", "tiny-gpt-oss", "--preset", "tiny", "--isl", "16", "--osl", "4",
                      "--concurrency", "1,2", "--workers", "1", "--csv", str(d / "s.csv")]):
            out = io.StringIO()
            with time_limit(120, " ".join(argv)), contextlib.redirect_stdout(out), \
                    contextlib.redirect_stderr(io.StringIO()):
                assert main(argv) == 0, argv
            if "--json" in argv:
                _strict_json(out.getvalue())


def _validate_without_running(monkeypatch, rows: str) -> tuple[int, str, bool]:
    """``validate --rows ROWS``, with the validation itself replaced by a stub (a real one takes
    minutes a row): (exit status, stderr, whether the stub was reached)."""
    import jalapeno_emu.validation.run as validation_run

    reached = []

    def stub(*args, **kwargs):
        reached.append(args)
        raise AssertionError("stop: the validation would run now")

    monkeypatch.setattr(validation_run, "run_validation", stub)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(["validate", "--rows", rows, "--no-calibrate", "--workers", "1"])
        except AssertionError:
            code = -1
    return code, err.getvalue(), bool(reached)


def test_validate_refuses_empty_rows(monkeypatch):
    code, err, reached = _validate_without_running(monkeypatch, "")
    assert not reached and code == 2 and "--rows" in err


def test_validate_refuses_a_range_without_its_end(monkeypatch):
    code, err, reached = _validate_without_running(monkeypatch, "1-")
    assert not reached and code == 2 and "not N or N-M" in err
