"""``--set KEY=VALUE`` job overrides of the benchmarks that start jobs (YAML values; a dotted
key reaches into a nested mapping: ``algo.old_logp=recompute``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml

__all__ = ["apply_overrides", "parse_overrides"]


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["engine=hf", "algo.old_logp=recompute"]`` -> a dict of YAML values
    (SystemExit naming the item that is not KEY=VALUE)."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set wants KEY=VALUE, got {item!r}")
        overrides[key] = yaml.safe_load(value)
    return overrides


def apply_overrides(job: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Set each (dotted) key in ``job``, making the mappings on its way that are missing."""
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = job
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
