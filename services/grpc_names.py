"""gRPC service names and method paths, read from the generated descriptors.

A service's full name ("rlfleet.sampler.v1.SamplerService") names it for health checks,
reflection and ``GrpcServer.add_service``; a method path ("/rlfleet.learner.v1.WeightService/
FetchWeights") is what a hand-made stub (``channel.unary_stream(path, ...)``) calls. Both come
from the ``*_pb2`` module of the proto, so a renamed package or service fails at import instead of
health-checking or calling a name nobody serves::

    from rlfleet.sampler.v1 import sampler_pb2

    SERVICE_NAME = service_name(sampler_pb2, "SamplerService")
    FETCH = method_path(weights_pb2, "WeightService", "FetchWeights")
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

__all__ = ["method_path", "service_name"]


def _service(proto: ModuleType | Any, service: str) -> Any:
    """The ServiceDescriptor of ``service`` in ``proto`` (a ``*_pb2`` module or its
    FileDescriptor); KeyError naming the services the file defines when it has no such one."""
    file = getattr(proto, "DESCRIPTOR", proto)
    services = getattr(file, "services_by_name", None)
    if services is None:
        raise TypeError(f"expected a *_pb2 module or a FileDescriptor, got {proto!r}")
    try:
        return services[service]
    except KeyError:
        known = ", ".join(sorted(services)) or "none"
        raise KeyError(f"{file.name} has no service {service!r} (it has: {known})") from None


def service_name(proto: ModuleType | Any, service: str) -> str:
    """Full name of ``service`` in ``proto``: ``service_name(env_pb2, "EnvService")`` is
    ``"rlfleet.env.v1.EnvService"``."""
    return str(_service(proto, service).full_name)


def method_path(proto: ModuleType | Any, service: str, method: str) -> str:
    """The path gRPC calls ``method`` of ``service`` by:
    ``method_path(weights_pb2, "WeightService", "FetchWeights")`` is
    ``"/rlfleet.learner.v1.WeightService/FetchWeights"``."""
    descriptor = _service(proto, service)
    if method not in descriptor.methods_by_name:
        known = ", ".join(sorted(descriptor.methods_by_name)) or "none"
        raise KeyError(f"{descriptor.full_name} has no method {method!r} (it has: {known})")
    return f"/{descriptor.full_name}/{method}"
