"""``jalapeno-emu``: the root command. Registers each command module and owns error handling.

User errors (any ``EmuError``, a bad option) print one line and exit 2; only bugs print a
traceback (exit 1). No command at all prints the help on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from rich.markup import escape

from jalapeno_emu import __version__
from jalapeno_emu.cli import asm, bench, cache, chip, compare, demo, kernel, model, rack, run, stack, validate
from jalapeno_emu.cli.app import Abort, App
from jalapeno_emu.emu.compile_cache import disable_compile_cache
from jalapeno_emu.errors import EmuError

COMMANDS = (demo, chip, stack, asm, run, bench, kernel, model, rack, compare, validate, cache)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would exit 2 with usage; keep one line
        raise Abort(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree: one subparser per command module (each has ``register``)."""
    parser = _Parser(prog="jalapeno-emu", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"jalapeno-emu {__version__}")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not keep compiled functions on disk (default: on, in jax/ "
                             "under $JALAPENO_EMU_CACHE_DIR or ~/.cache/jalapeno-emu)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = build_parser()
    app = App()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            # A usage error, as argparse treats a missing required argument: the help (it lists the
            # commands) goes to stderr, since stdout carries only a command's results, and exit 2.
            # `jalapeno-emu --help` still prints it to stdout and exits 0.
            parser.print_help(sys.stderr)
            raise Abort("no command given; choose one of the commands above")
        app.json_output = bool(getattr(args, "json", False))
        if args.no_compile_cache:
            disable_compile_cache()
        return int(args.run(app, args) or 0)
    except (Abort, EmuError) as exc:
        # escape: messages quote tiles and regions ("sram[c0]:0x0..0x40"), which rich would
        # otherwise take for markup tags and silently drop.
        app.err_console.print(f"[bold red]error:[/bold red] {escape(str(exc))}", markup=True, soft_wrap=True)
        return exc.code if isinstance(exc, Abort) else 2
    except OSError as exc:  # unreadable input, unwritable output: the user's to fix, not a bug
        where = f"{exc.filename}: " if exc.filename else ""
        app.err_console.print(f"[bold red]error:[/bold red] {escape(where + (exc.strerror or str(exc)))}",
                              markup=True, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        app.err_console.print("interrupted")
        return 130


def console() -> NoReturn:
    """The ``jalapeno-emu`` console script: :func:`main`, then :func:`exit_now` with its status."""
    exit_now(main())


def exit_now(code: int) -> NoReturn:
    """End the process with ``code``: the exit handlers run and the output is flushed, but the
    interpreter does not free every object first, when nothing else is running.

    Why: a demo's process ends holding about 800k Python objects and 300 XLA executables;
    freeing them took 2 s of a 15 s warm demo, for memory the system takes back anyway. With a
    thread or a child process still running, the ordinary exit waits for it as it always did.
    """
    import atexit
    import contextlib
    import multiprocessing
    import os
    import threading

    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    run_handlers = getattr(atexit, "_run_exitfuncs", None)  # CPython's, as the exit itself runs them
    # A profiler or tracer (cProfile, coverage) writes its results after this function returns.
    watched = sys.getprofile() is not None or sys.gettrace() is not None
    if others or watched or multiprocessing.active_children() or run_handlers is None:
        sys.exit(code)
    run_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (`| head`): nothing to do
            stream.flush()
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    # `python -m` runs under runpy, often inside a profiler: the ordinary exit lets it finish.
    sys.exit(main())
