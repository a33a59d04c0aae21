"""YAML from users (run files, env overrides, CLI arguments) parsed within bounds.

A few hundred bytes of YAML can stand for billions of values (anchors whose aliases nest: an
"alias bomb"), a self-referencing anchor makes a structure no walker ends, and deep nesting
exhausts Python's recursion. PyYAML guards against none of these, so every YAML rlfleet reads
from a user goes through `BoundedLoader`: it counts the nodes of the document as if every alias
were expanded, refuses past `MAX_YAML_NODES` or `MAX_YAML_DEPTH` and refuses recursive aliases,
as a `yaml.MarkedYAMLError` that names the line; the text itself is refused past
`MAX_YAML_BYTES` before parsing starts.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.composer import ComposerError

__all__ = [
    "MAX_YAML_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "BoundedLoader",
    "YamlTooLarge",
    "check_size",
    "safe_load",
]

# Run files are a few kilobytes; the limit is far beyond any and bounds the time the (pure
# Python) scanner spends on one.
MAX_YAML_BYTES = 256 * 1024
# Nodes (scalars, sequences, mappings) of one document, every alias counted as the nodes it
# stands for: far above any run file, far below what would take seconds to walk and validate.
MAX_YAML_NODES = 100_000
# Nesting of sequences and mappings: run files nest a handful deep; the composer, the line
# walker and pydantic recurse once per level.
MAX_YAML_DEPTH = 64


class YamlTooLarge(ValueError):
    """YAML text over `MAX_YAML_BYTES`; the message says the size and the limit."""


def check_size(size: int) -> None:
    """Refuse YAML of ``size`` bytes (or characters) over `MAX_YAML_BYTES`."""
    if size > MAX_YAML_BYTES:
        raise YamlTooLarge(f"{size} bytes of YAML, over the limit of {MAX_YAML_BYTES}")


class BoundedLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses documents over `MAX_YAML_NODES` nodes with aliases
    expanded, nested over `MAX_YAML_DEPTH`, or with an alias inside its own anchor.

    Each composed node's expanded size is remembered (an alias is the anchored node itself, so
    its size is known once), which keeps the count linear in the text however aliases nest."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._expanded: dict[int, int] = {}  # id(node) -> nodes it stands for
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            node = self.anchors.get(event.anchor)
            if node is not None and id(node) not in self._expanded:
                raise ComposerError(
                    None,
                    None,
                    f"alias *{event.anchor} is inside its own anchor (a recursive structure)",
                    event.start_mark,
                )
            return super().compose_node(parent, index)
        start = self.peek_event().start_mark  # type: ignore[no-untyped-call]
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", start)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            children = []
        size = 1 + sum(self._expanded[id(child)] for child in children)
        if size > MAX_YAML_NODES:
            raise ComposerError(
                None,
                None,
                f"more than {MAX_YAML_NODES} values with aliases expanded (an alias bomb?)",
                start,
            )
        self._expanded[id(node)] = size
        return node


def safe_load(text: str) -> Any:
    """`yaml.safe_load` of ``text`` within the bounds above (YamlTooLarge, yaml.YAMLError)."""
    check_size(len(text))
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
