"""The producer record: how a service whose training data comes from connections it accepts
(an env server's game links) tells the run how many of them are live.

A producer the launcher starts itself (a game actor, a rollout driver) is gone when its process
has finished; one fed by connections is gone when its last one has ended, which only it knows.
It publishes a record on ``rlfleet.v1.events.<run>.producers`` (event kind
``PRODUCER_EVENTS``) whenever one opens or ends; `rlfleet up` follows them
(launch/producers.py) to say when nothing can feed the learner any more. A
``google.protobuf.Struct``, as the progress record (services/progress.py): the runtime knows
no game.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2

__all__ = ["PRODUCER_EVENTS", "ProducerReport", "producer_record"]

PRODUCER_EVENTS = "producers"  # the event kind of producer records


def producer_record(source: str, *, live: int, what: str, change: str) -> struct_pb2.Struct:
    """``source`` has ``live`` connections feeding it (``what``: "game links") after
    ``change`` (one line: "game snake-py linked", "link 3 ended")."""
    record = struct_pb2.Struct()
    record.update({"source": source, "live": int(live), "what": what, "change": change})
    return record


@dataclass(frozen=True)
class ProducerReport:
    """A decoded producer record."""

    source: str
    live: int
    what: str
    change: str

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> ProducerReport | None:
        """From a record's fields (``producer_record``); None when it is not one."""
        live = fields.get("live")
        if not isinstance(live, int | float) or not fields.get("source"):
            return None
        return cls(
            source=str(fields["source"]),
            live=int(live),
            what=str(fields.get("what", "")),
            change=str(fields.get("change", "")),
        )
