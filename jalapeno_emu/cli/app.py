"""What every command shares: output (rich table or JSON) and the one error channel."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

JSON_SCHEMA_VERSION = 1
"""Bumped when a field of any command's --json output changes meaning or disappears."""


class Abort(Exception):
    """Raised by a command to stop with one readable line and an exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class App:
    """Per-invocation state handed to each command."""

    json_output: bool = False
    console: Console = field(default_factory=lambda: Console(highlight=False))
    err_console: Console = field(default_factory=lambda: Console(stderr=True, highlight=False))

    def emit_json(self, command: str, payload: dict[str, Any]) -> None:
        """Print one JSON document with the schema header every command shares."""
        doc = {"schema_version": JSON_SCHEMA_VERSION, "command": command, **payload}
        sys.stdout.write(json.dumps(doc, indent=2, allow_nan=True) + "\n")

    def status(self, text: str) -> None:
        """Progress text for humans, on stderr so --json output stays clean."""
        if not self.json_output:
            self.err_console.print(f"[dim]{text}[/dim]")
