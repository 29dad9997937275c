"""``jalapeno-emu stack show [STACK] [--preset P] [--json]``: a serving stack's costs with provenance.

The costs the serving simulator charges around the device's steps (``jalapeno_emu.serving.stack``):
host time per step and how much of it overlaps the device, sampling, and the per-request HTTP,
tokenizing and response times; each ``public`` with its source or ``assumed`` with its reason, as
``chip show`` prints a chip's.
"""

from __future__ import annotations

import argparse

from rich.table import Table

from jalapeno_emu.chip import format_quantity
from jalapeno_emu.chip.spec import STACK_NAMES
from jalapeno_emu.cli.app import App

_KIND_STYLE = {"public": "green", "assumed": "yellow", "derived": "cyan"}


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``stack`` command group and its ``show`` command."""
    p = sub.add_parser("stack", help="serving stacks: host costs per step and per request, with provenance")
    stack_sub = p.add_subparsers(dest="stack_command", metavar="SUBCOMMAND", required=True)
    show = stack_sub.add_parser("show", help="show a serving stack's costs and where each comes from")
    show.add_argument("stack", nargs="?", default=None,
                      help=f"{', '.join(STACK_NAMES)} (default: the --preset's own stack)")
    show.add_argument("--preset", default="jalapeno-v1",
                      help="chip preset whose default stack to show when no STACK is named "
                      "(default jalapeno-v1)")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    show.set_defaults(run=run_show)


def run_show(app: App, args: argparse.Namespace) -> int:
    """Print one stack's costs, each with its unit, provenance and source or reason."""
    from jalapeno_emu.chip import load_preset
    from jalapeno_emu.serving.stack import load_stack

    name = args.stack if args.stack is not None else load_preset(args.preset).software.stack
    stack = load_stack(name)
    if app.json_output:
        app.emit_json("stack show", {**stack.as_dict(), "preset": None if args.stack else args.preset})
        return 0
    where = "" if args.stack else f" ({args.preset}'s default)"
    table = Table(title=f"[bold]{stack.name}[/bold]{where}: {stack.description}", title_justify="left")
    table.add_column("cost", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("provenance", no_wrap=True)
    table.add_column("what it is; source / reason", overflow="fold")
    for row in stack.rows():
        style = _KIND_STYLE[row["kind"]]
        value = f"{row['value']:g}" if row["unit"] == "" else format_quantity(row["value"], row["unit"])
        kind = f"[{style}]{row['kind']}[/{style}]"
        table.add_row(row["field"], value, kind, f"{row['doc']}; {row['note']}")
    app.console.print(table)
    return 0
