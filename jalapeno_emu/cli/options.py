"""Options shared by several commands: ``--set`` and ``--shape`` lists of ``KEY=VALUE`` items.

Every such option accepts the three ways people write a list, alone or mixed, and collects them
into one flat list of ``"key=value"`` strings in the order given:

- repeated: ``--shape m=1 --shape n=2``;
- several items after one flag: ``--shape m=1 n=2``;
- comma-separated: ``--shape m=1,n=2``, split only when every piece is itself ``key=value`` (no
  value of a shape key or chip field holds a comma today; a value that did would stay whole and
  be refused, or accepted, by the key's own parser).

An item without ``=`` is refused at parse time. Since one flag takes every following item that is
not an option, a positional argument written after the list would be taken for an item, so the
message says to write positional arguments first (``kernel gemm --shape m=1``, not ``kernel
--shape m=1 gemm``). Values are parsed (and refused, naming the key) by the command itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["KeyValueItems", "add_key_value_option", "split_items"]


def split_items(text: str) -> list[str]:
    """``"m=1,n=2"`` -> ``["m=1", "n=2"]``; text with a piece that is not ``key=value`` stays whole."""
    pieces = text.split(",")
    if len(pieces) > 1 and all("=" in piece for piece in pieces):
        return pieces
    return [text]


class KeyValueItems(argparse.Action):
    """argparse action (``nargs="+"``) appending every ``KEY=VALUE`` item to one flat list.

    Args:
        example: one item, quoted by the error for an item without ``=``.
        (the rest: as for ``argparse.Action``)
    """

    def __init__(self, option_strings: Sequence[str], dest: str, *, example: str = "key=value",
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.example = example

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        """Check each item has ``=``, split comma lists, and extend the list at ``dest``."""
        flag = option_string or self.dest
        # A copy: extending the default list in place would leak items into later parses.
        items = list(getattr(namespace, self.dest, None) or [])
        for i, value in enumerate([values] if isinstance(values, str) else values or []):
            if "=" not in value:
                # After an item, a bare word is most likely a positional argument written late.
                late = f"; arguments that are not key=value go before {flag}" if i else ""
                raise argparse.ArgumentError(
                    self, f"{value!r} must look like key=value, e.g. {self.example}{late}")
            items.extend(split_items(value))
        setattr(namespace, self.dest, items)


def add_key_value_option(parser: argparse.ArgumentParser, flag: str, *, dest: str, what: str,
                         examples: tuple[str, str]) -> argparse.Action:
    """Add ``flag KEY=VALUE [KEY=VALUE ...]`` (repeatable, comma lists too) storing a list at ``dest``.

    Args:
        parser: the command's parser.
        flag: ``"--set"`` or ``"--shape"``.
        dest: the attribute the command reads: a flat list of ``"key=value"`` strings ([] if absent).
        what: what one item does, for the help ("override a chip spec field").
        examples: two items, for the help and the error message ("m=1", "k=2880").
    """
    one, two = examples
    return parser.add_argument(
        flag, dest=dest, action=KeyValueItems, nargs="+", default=[], metavar="KEY=VALUE",
        example=one,
        help=f"{what}. Any of `{flag} {one} {two}`, `{flag} {one} {flag} {two}`, "
             f"`{flag} {one},{two}`; positional arguments go before {flag}")
