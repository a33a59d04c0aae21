"""The progress record: what a trainer publishes beside its Metrics so that a console can show
one compact progress line for the run.

The runtime knows no domain, so whoever trains says what the line needs: the unit counted
(``step``, ``update``), how many are done of how many, the policy version and a short ordered
list of headline values with their display labels. It travels as a ``google.protobuf.Struct``
on ``rlfleet.v1.events.<run>.progress`` (event kind ``PROGRESS_EVENTS``); `progress_record`
builds one, `Progress.from_fields` reads one back. How it is shown is the console's business
(launch/console.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2

__all__ = ["PROGRESS_EVENTS", "Progress", "progress_record"]

PROGRESS_EVENTS = "progress"  # the event kind of progress records


def progress_record(
    source: str,
    *,
    unit: str,
    done: float,
    total: float,
    version: int | None,
    headline: Iterable[tuple[str, float]] = (),
) -> struct_pb2.Struct:
    """A progress record: ``source`` has done ``done`` of ``total`` ``unit``s at policy
    ``version`` (None: no policy versions, e.g. offline DPO, or a warm start before the first);
    ``headline``: (label, value) pairs in display order (non-finite ones left out)."""
    record = struct_pb2.Struct()
    fields: dict[str, Any] = {
        "source": source,
        "unit": unit,
        "done": float(done),
        "total": float(total),
        "headline": [[label, float(v)] for label, v in headline if math.isfinite(v)],
    }
    if version is not None:
        fields["version"] = int(version)
    record.update(fields)
    return record


@dataclass(frozen=True)
class Progress:
    """A decoded progress record."""

    source: str
    unit: str
    done: float
    total: float
    version: int | None = None
    headline: tuple[tuple[str, float], ...] = ()

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> Progress | None:
        """From a record's fields (``progress_record``); None when it is not one."""
        try:
            done, total = float(fields["done"]), float(fields["total"])
        except (KeyError, TypeError, ValueError):
            return None
        headline = []
        for pair in fields.get("headline") or ():
            if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int | float):
                headline.append((str(pair[0]), float(pair[1])))
        version = fields.get("version")
        return cls(
            source=str(fields.get("source", "")),
            unit=str(fields.get("unit", "")),
            done=done,
            total=total,
            version=int(version) if isinstance(version, int | float) else None,
            headline=tuple(headline),
        )
