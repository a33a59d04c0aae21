"""What a package registers to add an ``rlfleet`` subcommand: a `Command` under the
``rlfleet.commands`` entry-point group (``play``, ``init-model``, ``export``), and the table
printer such commands share.

The ``rlfleet`` command itself (launch/cli.py) finds and runs them; a service package builds its
commands from this module, so it never imports the tooling. A command's module must be cheap to
import: the parser is built from every command at start, so heavy imports (torch, vLLM) belong
inside the handler.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["COMMANDS_GROUP", "Command", "Handler", "print_table"]

COMMANDS_GROUP = "rlfleet.commands"

Handler = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Command:
    """One subcommand: its one-line help, its argument setup and its handler (exit code)."""

    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    handler: Handler


def print_table(rows: Iterable[Any]) -> None:
    """Print strings one per line, or mappings/objects/protobuf messages as aligned columns."""
    records = []
    for row in rows:
        if isinstance(row, str):
            row = {"id": row}
        elif hasattr(row, "ListFields"):
            row = {d.name: v for d, v in row.ListFields()}
        elif not isinstance(row, dict):
            row = dict(vars(row))
        records.append({k: str(v) for k, v in row.items()})
    if not records:
        print("(none)")
        return
    columns = list(dict.fromkeys(k for r in records for k in r))
    widths = {c: max(len(c), *(len(r.get(c, "")) for r in records)) for c in columns}
    for line in [dict(zip(columns, columns, strict=True)), *records]:
        print("  ".join(line.get(c, "").ljust(widths[c]) for c in columns).rstrip())
