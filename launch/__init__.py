"""rlfleet's local tooling: the ``rlfleet`` command (launch/cli.py) and what ``rlfleet up`` runs a
whole config with on one machine: the launcher (supervised processes), the console (progress
line, event lines), the live dashboard, and the run's certificates and NATS users.

Built on the runtime (``services``); nothing outside this package imports it, so a service
image or a service package never depends on the tooling.
"""

import services  # noqa: F401  # first: it sets gRPC's environment before anything imports grpc
