"""``jalapeno-emu chip show [PRESET] [--set key=value ...] [--json]``: a chip spec with provenance.

Prints one table per block (field, value with its unit, provenance, source or reason), then the
derived totals with their formulas. ``--set`` applies overrides first (``--set hbm.efficiency=0.85``),
so what-if questions start here.
"""

from __future__ import annotations

import argparse

from rich.table import Table

from jalapeno_emu.chip import (
    BLOCKS,
    DERIVED_QUANTITIES,
    FIELDS,
    ChipSpec,
    apply_overrides,
    format_quantity,
    list_presets,
    load_preset,
)
from jalapeno_emu.cli.app import App
from jalapeno_emu.cli.options import add_key_value_option

DEFAULT_PRESET = "jalapeno-v1"

_KIND_STYLE = {"public": "green", "assumed": "yellow", "derived": "cyan"}


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``chip`` command group and its ``show`` command."""
    p = sub.add_parser("chip", help="chip presets: spec, provenance and derived totals")
    chip_sub = p.add_subparsers(dest="chip_command", metavar="SUBCOMMAND", required=True)
    show = chip_sub.add_parser("show", help="show a preset's spec, provenance and derived totals")
    show.add_argument("preset", nargs="?", default=DEFAULT_PRESET,
                      help=f"shipped preset ({', '.join(list_presets())}) or a path to a TOML "
                           f"preset (default {DEFAULT_PRESET})")
    add_key_value_option(show, "--set", dest="overrides", what="override fields",
                         examples=("hbm.efficiency=0.85", "core.clock_hz=1.8GHz"))
    show.add_argument("--json", action="store_true", help="print JSON instead of tables")
    show.set_defaults(run=run_show)


def _payload(spec: ChipSpec, preset: str, overrides: list[str]) -> dict:
    """The ``chip show`` JSON document's body (schema_version 1)."""
    return {
        "preset": preset,
        "name": spec.name,
        "spec": spec.to_dict(),
        "units": {path: info.unit for path, info in FIELDS.items()},
        "provenance": {path: {"kind": p.kind, "note": p.note} for path, p in spec.provenance.items()},
        "derived": spec.derived(),
        "derived_units": {name: q.unit for name, q in DERIVED_QUANTITIES.items()},
        "overrides": list(overrides),
    }


def run_show(app: App, args: argparse.Namespace) -> int:
    """Load the preset, apply ``--set`` overrides, print tables or JSON."""
    spec = apply_overrides(load_preset(args.preset), args.overrides)
    if app.json_output:
        app.emit_json("chip show", _payload(spec, args.preset, args.overrides))
        return 0
    overridden = {item.partition("=")[0].strip() for item in args.overrides}
    app.console.print(f"[bold]{spec.name}[/bold]: {spec.description}")
    for block, cls in BLOCKS.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0].replace("``", "")
        table = Table(title=f"[bold]{block}[/bold]: {doc}", title_justify="left")
        table.add_column("field", no_wrap=True)
        table.add_column("value", justify="right", no_wrap=True)
        table.add_column("provenance", no_wrap=True)
        table.add_column("source / reason", overflow="fold")
        for path, info in FIELDS.items():
            if not path.startswith(block + "."):
                continue
            prov = spec.provenance[path]
            style = "bold magenta" if path in overridden else _KIND_STYLE[prov.kind]
            table.add_row(path.split(".", 1)[1], format_quantity(spec.get(path), info.unit),
                          f"[{style}]{prov.kind}[/{style}]", prov.note)
        app.console.print(table)
    derived = spec.derived()
    table = Table(title="derived totals", title_justify="left")
    table.add_column("quantity", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("formula", overflow="fold")
    for name, q in DERIVED_QUANTITIES.items():
        table.add_row(name, format_quantity(derived[name], q.unit), q.formula)
    app.console.print(table)
    if args.overrides:
        app.console.print(f"overrides: {', '.join(args.overrides)}")
    return 0
