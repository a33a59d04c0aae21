"""rlfleet's shared runtime: server bootstrap, running a service, config, bus, telemetry."""

import os

# Off unless the user set it: gRPC's fork support (on in grpcio's builds) restarts gRPC's
# poller thread in every child that `subprocess` forks, and a child forked to run a
# `preexec_fn` (the parent-death signal every rlfleet child gets) then closes that poller's
# epoll descriptor with `close_fds` before its exec: grpcio >= 1.80 aborts the child there
# while the parent has RPCs in flight, and the child is lost (grpc/grpc#43055;
# tests/integration/test_grpc_fork.py).
# rlfleet never forks without exec, the one case fork support is for. gRPC reads it when it is
# first imported, so it is set here, before any module of the runtime imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
