"""``jalapeno-emu cache show|prune|clear``: what the cache directory holds, and removing what no
run will read again (:mod:`jalapeno_emu.cache_files`).

``show`` lists the four parts (kernel timings, step timings, stored executables, JAX's compile
cache) with their files, sizes and what of them is stale; ``prune`` removes the stale files;
``clear`` removes every file of the four parts. Neither loses anything a run needs: it is
computed and written again.
"""

from __future__ import annotations

import argparse

from rich.table import Table

from jalapeno_emu.cli.app import App
from jalapeno_emu.cli.human import mb


def _days(text: str) -> float:
    try:
        days = float(text.removesuffix("d"))
    except ValueError:
        days = -1.0
    if not days >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"{text!r} must be a number of days >= 0 (30 or 30d)")
    return days


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``cache`` command group: ``show``, ``prune``, ``clear``."""
    p = sub.add_parser("cache", help="the cache directory: show it, prune what no run reads, clear it")
    cache_sub = p.add_subparsers(dest="cache_command", metavar="SUBCOMMAND", required=True)
    for name, run, text, aged in (
        ("show", run_show, "the cache directory's parts: files, sizes, and what is stale", True),
        ("prune", run_prune, "remove the stale files: timings of other code, executables and JAX "
                             "cache entries unused for --older-than days", True),
        ("clear", run_clear, "remove every file of the cache directory's parts", False),
    ):
        q = cache_sub.add_parser(name, help=text)
        if aged:
            q.add_argument("--older-than", type=_days, default=30.0, metavar="DAYS",
                           help="an executable or JAX cache entry unused this long is stale (default 30)")
        q.add_argument("--json", action="store_true", help="print JSON instead of tables")
        q.set_defaults(run=run)


def run_show(app: App, args: argparse.Namespace) -> int:
    """Print the cache directory's parts."""
    from jalapeno_emu.cache_files import survey
    from jalapeno_emu.files import cache_root

    parts = survey(older_than_days=args.older_than)
    if app.json_output:
        app.emit_json("cache show", {
            "root": str(cache_root()), "older_than_days": args.older_than,
            "parts": [{"name": p.name, "path": str(p.path), "files": p.files, "bytes": p.bytes,
                       "stale_files": p.stale_files, "stale_bytes": p.stale_bytes} for p in parts]})
        return 0
    table = Table(title=f"cache directory {cache_root()}")
    for col, just in (("part", "left"), ("files", "right"), ("MB", "right"), ("stale files", "right"),
                      ("stale MB", "right"), ("path", "left")):
        table.add_column(col, justify=just)
    for p in parts:
        table.add_row(p.name, f"{p.files:,}", mb(p.bytes), f"{p.stale_files:,}", mb(p.stale_bytes),
                      str(p.path))
    app.console.print(table)
    stale = sum(p.stale_bytes for p in parts)
    app.console.print(f"stale: timings of other code, and executables or JAX cache entries unused for "
                      f"{args.older_than:g} days; `jalapeno-emu cache prune` frees {mb(stale)} MB")
    return 0


def run_prune(app: App, args: argparse.Namespace) -> int:
    """Remove the stale files."""
    from jalapeno_emu.cache_files import prune

    files, freed = prune(older_than_days=args.older_than)
    if app.json_output:
        app.emit_json("cache prune", {"older_than_days": args.older_than, "removed_files": files,
                                      "removed_bytes": freed})
    else:
        app.console.print(f"removed {files:,} stale files, {mb(freed)} MB")
    return 0


def run_clear(app: App, args: argparse.Namespace) -> int:
    """Remove every file of the four parts."""
    from jalapeno_emu.cache_files import clear

    files, freed = clear()
    if app.json_output:
        app.emit_json("cache clear", {"removed_files": files, "removed_bytes": freed})
    else:
        app.console.print(f"removed {files:,} files, {mb(freed)} MB")
    return 0
