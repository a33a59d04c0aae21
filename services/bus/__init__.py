"""The bus: a local nats-server for embedded runs, and the client every service uses.

See docs/internals.md ("services/bus/") for the contract and subjects.py for the names.
"""

from services.bus.client import REPLICAS_ENV, Bus, PubAck
from services.bus.messages import MSG_ID_HEADER, TYPE_HEADER, Delivery, Subscription
from services.bus.nats_cluster import NatsCluster, stream_replicas
from services.bus.nats_server import EmbeddedNats, NatsUser, find_nats_server
from services.bus.runs import RUN_OVER, announce, stop_when_run_over
from services.bus.subjects import (
    events_subject,
    events_wildcard,
    service_permissions,
    stream_name,
    traj_subject,
    validate_run_name,
    work_queue_stream,
    work_queue_subject,
)

__all__ = [
    "MSG_ID_HEADER",
    "REPLICAS_ENV",
    "RUN_OVER",
    "TYPE_HEADER",
    "Bus",
    "Delivery",
    "EmbeddedNats",
    "NatsCluster",
    "NatsUser",
    "PubAck",
    "Subscription",
    "announce",
    "events_subject",
    "events_wildcard",
    "find_nats_server",
    "service_permissions",
    "stop_when_run_over",
    "stream_name",
    "stream_replicas",
    "traj_subject",
    "validate_run_name",
    "work_queue_stream",
    "work_queue_subject",
]
