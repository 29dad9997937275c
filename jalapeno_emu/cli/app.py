"""What every command shares: output (rich table or JSON) and the one error channel."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from jalapeno_emu.cli.narrow import fit_table
from jalapeno_emu.errors import EmuError
from jalapeno_emu.files import check_output_path

JSON_SCHEMA_VERSION = 1
"""Bumped when a field of any command's --json output changes meaning or disappears."""


class Abort(Exception):
    """Raised by a command to stop with one readable line and an exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 1")
    return n


def output_file(text: str) -> str:
    """The argparse ``type=`` of every output option (``-o``, ``--trace``, ``--csv``, ``--plot``):
    :func:`jalapeno_emu.files.check_output_path` at parse time, so a path that cannot be written
    (a directory, a FIFO, a device, a missing directory) is refused before any computing, naming
    the path as given. Returns the text unchanged."""
    try:
        check_output_path(text)
    except EmuError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_executor_options(p: argparse.ArgumentParser) -> None:
    """``--workers N`` and ``--scheduler ADDRESS`` (one or the other): where a command's independent
    tasks run (:func:`jalapeno_emu.parallel.executor`)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--workers",
        type=_workers,
        metavar="N",
        help="local processes for the independent tasks (default: as many as there are CPUs and "
        "tasks; 1, or a single task, runs in this process)",
    )
    group.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="run the tasks on a Dask cluster instead, e.g. tcp://host:8786 (not with --workers; needs "
        "pip install 'jalapeno-emu[distributed]' here and jalapeno-emu on the cluster's workers)",
    )


PIPE_WIDTH = 200
"""Columns of a console that is not a terminal (a pipe, a file, captured output) when $COLUMNS does
not say: rich's default there is 80, which cut the headers of wide tables (``tok/s/…``); a file
has no width to keep to, so a table gets the width its content needs, up to this."""


class FittingConsole(Console):
    """A console that prints a table too wide for it as records (``cli.narrow.fit_table``)
    instead of cutting its headers and numbers; everything else prints as rich prints it."""

    def print(self, *objects, **kwargs) -> None:
        super().print(*(fit_table(o, self) if isinstance(o, Table) else o for o in objects), **kwargs)


def _console(*, stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr) that keeps a terminal's width and takes
    ``PIPE_WIDTH`` columns anywhere else; tables wider than it print as records."""
    console = FittingConsole(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH
    return console


@dataclass
class App:
    """Per-invocation state handed to each command."""

    json_output: bool = False
    console: Console = field(default_factory=_console)
    err_console: Console = field(default_factory=lambda: _console(stderr=True))

    def emit_json(self, command: str, payload: dict[str, Any]) -> None:
        """Print one JSON document with the schema header every command shares."""
        doc = {"schema_version": JSON_SCHEMA_VERSION, "command": command, **payload}
        sys.stdout.write(json.dumps(doc, indent=2, allow_nan=True) + "\n")

    def status(self, text: str) -> None:
        """Progress text for humans, on stderr so --json output stays clean."""
        if not self.json_output:
            self.err_console.print(f"[dim]{text}[/dim]")
