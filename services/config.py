"""Run configuration: one YAML file per run, validated completely before anything starts.

A mistake in a config must surface in the first second, as one line naming the file, the line
and the key (``run.yaml:12: services[1].settings.num_envs: Input should be greater than 0``),
not minutes later inside a subprocess log. So the YAML is parsed with its node tree (to map
every key path to its line), the run structure is validated by pydantic, and every service's
``settings`` are validated against the settings model its kind registers, with environment
overrides applied, all at load time.

Line tracking, error rendering, env overrides and job expansion stay together: they all serve
the one promise above and share the ``YamlSource``/``_Issue`` plumbing. The base model and the
service-reference field type are in services/settings.py, what each service needs before it
starts in services/start_order.py.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    field_validator,
)

from services.bus.nats_cluster import check_cluster_size
from services.errors import ConfigError, ConfigIssue, InvalidArgument
from services.registry import JOBS_GROUP, entry_point_registry, get_job, get_service
from services.settings import (
    Loc,
    ServiceRef,
    StrictModel,
    address_problem,
    address_refs,
    host_problem,
    service_refs,
)
from services.start_order import start_problems
from services.tracking import TrackingSection, missing_packages
from services.yaml_loading import (
    MAX_YAML_BYTES,
    BoundedLoader,
    YamlTooLarge,
    check_size,
)
from services.yaml_loading import safe_load as safe_load_yaml

__all__ = [
    "ENV_PREFIX",
    "NatsSection",
    "RunConfig",
    "RunSection",
    "ServiceEntry",
    "ServiceRef",
    "StrictModel",
    "Switch",
    "YamlSource",
    "address_refs",
    "error_at",
    "load_run_config",
    "load_service_settings",
    "parse_yaml",
    "read_run_config",
    "service_refs",
    "settings_from_env",
    "unknown_key",
    "validate_run_config",
]

ENV_PREFIX = "RLFLEET_"
_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]*$"
EnvPath = tuple[str, ...]  # a key path named by an environment variable (no list indices)
M = TypeVar("M", bound=BaseModel)


def _switch_word(value: Any) -> Any:
    """YAML 1.1 reads an unquoted on/off/yes/no as a boolean: back to the word it stood for."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


# A knob spelled with words such as "on"/"off"/"auto": Annotated[Literal[...], Switch], so that
# `double_buffer: off` means "off" and not False.
Switch = BeforeValidator(_switch_word)


class RunSection(StrictModel):
    """Which run this is: names the NATS stream and the run directory."""

    name: str = Field(
        pattern=r"^[a-z0-9][a-z0-9-]{0,62}$",  # as services.bus.subjects wants
        description="the run's name: lowercase letters, digits and hyphens; names its bus "
        "stream and its directory runs/<name>",
    )
    dir: Path | None = Field(
        default=None, description="where logs, checkpoints and the final policy go (runs/<name>)"
    )
    # Once every producer of training data is gone (actors and rollout drivers finished, the
    # last game unlinked) while the main service still waits: `rlfleet up` says so and ends
    # the run failed ("stop"), or says so and waits for one to come back ("wait").
    when_producers_gone: Literal["stop", "wait"] = Field(
        default="stop",
        description="once nothing can feed the learner any more: end the run failed (stop) or "
        "wait for a producer to come back (wait)",
    )
    tracking: TrackingSection = Field(
        default_factory=TrackingSection,
        description="experiment trackers the learner logs to beside TensorBoard "
        "(services/tracking.py): wandb, mlflow",
    )
    # A vLLM engine starting on a loaded CPU machine takes minutes (its processes import torch
    # and vLLM, then load and warm the model), and an LM sampler is healthy only once it has the
    # learner's first version (after the SFT warm start); a service that exits fails at once.
    health_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="how long `rlfleet up` waits for each service to report healthy before the "
        "run fails",
    )


class NatsSection(StrictModel):
    """Where the bus is; ``url: null`` starts an embedded nats-server for the run.

    ``cluster``: how many nodes the bus has, 1 or an odd number from 3. With ``url: null`` the
    launcher starts that many nats-servers as one JetStream cluster on loopback; with ``url``
    (one URL or several, comma-separated) it is the size of the cluster the URLs point at. Either
    way streams and buckets are kept in ``min(3, cluster)`` copies (services/bus/nats_cluster.py).
    """

    url: str | None = None
    cluster: int = 1
    # Restarts of each embedded server (same ports and store) before its death fails the run.
    restarts: int = Field(default=5, ge=0)

    @field_validator("url")
    @classmethod
    def _server(cls, url: str | None) -> str | None:
        if url is None:
            return url
        for one in url.split(","):
            if not re.fullmatch(r"(nats|tls|ws|wss)://\S+", one):
                raise ValueError(f"{one!r} is not a nats://, tls://, ws:// or wss:// URL")
            # scheme://[user[:password]@]host[:port][/path]; the port is optional (NATS's default)
            where = one.partition("://")[2].partition("/")[0].rpartition("@")[2]
            if where.rfind(":") > where.rfind("]"):
                problem = address_problem(where)
            else:
                problem = host_problem(where[1:-1] if where.startswith("[") else where)
            if problem is not None:
                raise ValueError(problem)
        return url

    @field_validator("cluster")
    @classmethod
    def _cluster(cls, size: int) -> int:
        try:
            return check_cluster_size(size)
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None


class SecuritySection(StrictModel):
    """Transport security the launcher sets up for an embedded run (services/security.py).

    ``tls``: mutual TLS on every gRPC hop and TLS on NATS, with certificates from
    ``certs_dir`` (default ``<run dir>/certs``; a local CA and one certificate per service are
    made there when missing, valid for loopback plus ``hosts``). ``nats_auth``: every service
    connects to the embedded NATS with its own user and password and may touch only the run's
    subjects (services/bus/subjects.py `service_permissions`)."""

    tls: bool = False
    nats_auth: bool = False
    certs_dir: Path | None = None
    hosts: list[str] = Field(default_factory=list, max_length=64)

    @field_validator("hosts")
    @classmethod
    def _host_names(cls, hosts: list[str]) -> list[str]:
        # Each becomes a name in every certificate (launch/certs.py): an IP or a DNS name.
        for i, host in enumerate(hosts):
            problem = host_problem(host, wildcard=True)
            if problem is not None:
                raise _AtLoc(problem, (i,))
        return hosts


class _AtLoc(ValueError):
    """A validator error that points below the field it was raised for (e.g. one list item)."""

    def __init__(self, message: str, loc: Loc) -> None:
        super().__init__(message)
        self.loc = loc


class ServiceEntry(StrictModel):
    """One service instance of the run."""

    name: str = Field(pattern=_NAME_PATTERN)
    service: str
    restarts: int = Field(default=3, ge=0)
    main: bool = False
    # The services that must be up before this one starts (services/start_order.py); None:
    # what its kind declares, else every service listed before it. [] starts it at once.
    after: list[str] | None = None
    # The CPUs (Linux CPU ids) its processes may run on, set by `rlfleet up` with
    # sched_setaffinity; None: wherever the OS schedules them. Checked against the CPUs the
    # launcher itself may use when the run starts.
    cpus: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)
    # The threads its computation uses (OMP_NUM_THREADS of its process, which torch's intra-op
    # pool follows); None: the launcher's own OMP_NUM_THREADS, else 1 (several processes share
    # few cores). More for the one process a run waits for, when the others leave CPU idle.
    threads: int | None = Field(default=None, ge=1, le=1024)
    # Raw mapping as written; after validate_run_config/load_run_config it is an instance of
    # the kind's settings model (Any, not a union, keeps pydantic's error paths clean).
    settings: Any = Field(default_factory=dict)

    @field_validator("cpus")
    @classmethod
    def _distinct(cls, cpus: list[int] | None) -> list[int] | None:
        if cpus is not None and len(set(cpus)) != len(cpus):
            raise ValueError(f"CPU ids repeated in {cpus}")
        return cpus

    @field_validator("settings", mode="before")
    @classmethod
    def _mapping(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, Mapping | BaseModel):
            raise ValueError("settings must be a mapping")
        return value


class RunConfig(StrictModel):
    """The whole run: see docs/internals.md for the YAML layout."""

    run: RunSection
    nats: NatsSection = NatsSection()
    security: SecuritySection = SecuritySection()
    # A job's knobs as written (kind + settings); already expanded into `services` on load.
    job: dict[str, Any] | None = None
    services: list[ServiceEntry] = Field(min_length=1)

    @field_validator("services")
    @classmethod
    def _unique(cls, services: list[ServiceEntry]) -> list[ServiceEntry]:
        first: dict[str, int] = {}
        main_at: int | None = None
        for i, entry in enumerate(services):
            if entry.name in first:
                raise _AtLoc(
                    f"duplicate service name '{entry.name}' (also services[{first[entry.name]}])",
                    (i, "name"),
                )
            first[entry.name] = i
            if entry.main and main_at is not None:
                raise _AtLoc(
                    f"more than one main service (services[{main_at}] is main already)",
                    (i, "main"),
                )
            if entry.main:
                main_at = i
        return services

    @property
    def run_dir(self) -> Path:
        """Where logs, checkpoints and tensorboard files go (default ``runs/<name>``)."""
        return self.run.dir if self.run.dir is not None else Path("runs") / self.run.name

    def service(self, name: str) -> ServiceEntry:
        """The service entry with instance name ``name``."""
        for entry in self.services:
            if entry.name == name:
                return entry
        known = ", ".join(e.name for e in self.services)
        raise ConfigError(f"no service named '{name}' in run '{self.run.name}' (have: {known})")


# --- YAML with line numbers -------------------------------------------------------------------


@dataclass(frozen=True)
class YamlSource:
    """A parsed YAML document and the line of every key path in it, for error messages."""

    name: str
    data: Any
    lines: dict[Loc, int] = field(default_factory=dict)

    def line_of(self, loc: Loc) -> int:
        """Line of the deepest part of ``loc`` the file has (a missing key points at its parent)."""
        for n in range(len(loc), -1, -1):
            if loc[:n] in self.lines:
                return self.lines[loc[:n]]
        return 1


def parse_yaml(text: str, name: str = "<string>") -> YamlSource:
    """Parse one YAML document, recording the line of every mapping key and sequence item."""
    try:
        check_size(len(text.encode("utf-8", "surrogatepass")))
    except YamlTooLarge as exc:
        raise ConfigError(f"{name}: {exc}") from None
    loader = BoundedLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else {}
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise ConfigError(f"{name}:{line}: invalid YAML: {exc.problem or exc}") from None
    finally:
        loader.dispose()
    lines: dict[Loc, int] = {(): 1}
    if node is not None:
        _walk(node, (), lines, name)
    return YamlSource(name, data, lines)


def _walk(node: yaml.Node, path: Loc, lines: dict[Loc, int], name: str) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            sub = (*path, str(key_node.value))
            if sub in lines:
                # PyYAML silently keeps the last of two equal keys; a config must not.
                raise ConfigError(
                    f"{name}:{key_node.start_mark.line + 1}: {_loc_str(sub)}: duplicate key"
                )
            lines[sub] = key_node.start_mark.line + 1
            _walk(value_node, sub, lines, name)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[(*path, i)] = item.start_mark.line + 1
            _walk(item, (*path, i), lines, name)


# --- error rendering ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Issue:
    loc: Loc
    msg: str
    env_var: str | None = None


class _Invalid(Exception):
    """Issues found below some location; rendered into a ConfigError by the caller."""

    def __init__(self, issues: list[_Issue]) -> None:
        super().__init__(issues)
        self.issues = issues


def _loc_str(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def _render(issues: Sequence[_Issue], source: YamlSource | None) -> ConfigError:
    lines, found = [], []
    if source is not None:
        issues = sorted(issues, key=lambda i: (i.env_var is None, source.line_of(i.loc)))
    for issue in issues:
        where = _loc_str(issue.loc)
        line = source.line_of(issue.loc) if source is not None and not issue.env_var else None
        found.append(ConfigIssue(where, line, issue.msg))
        if issue.env_var:
            lines.append(f"{issue.env_var}: {where}: {issue.msg}")
        elif source is not None:
            lines.append(f"{source.name}:{line}: {where}: {issue.msg}")
        else:
            lines.append(f"{where}: {issue.msg}")
    return ConfigError("\n".join(lines), issues=found)


def _suggest(word: str, choices: Sequence[str] | None) -> str:
    close = difflib.get_close_matches(word, choices or (), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def error_at(message: str, *loc: str | int) -> ValueError:
    """The error a model validator raises about one of its fields (``error_at("...",
    "env_id")``): reported at that key's path and line, not at the model's."""
    return _AtLoc(message, loc)


def _aliases(model: type[BaseModel] | None) -> Mapping[str, str]:
    found = getattr(model, "aliases", None) if model is not None else None
    return found if isinstance(found, Mapping) else {}


def _unknown_key_msg(
    key: str, choices: Sequence[str] | None, aliases: Mapping[str, str] | None = None
) -> str:
    """``unknown key 'k'`` plus the alias table's pointer for ``k`` (a knob name or a line of
    explanation), else the closest spelling."""
    hint = (aliases or {}).get(key)
    if hint is None:
        return f"unknown key '{key}'" + _suggest(key, choices)
    if hint in (choices or ()):
        return f"unknown key '{key}' (rlfleet calls it '{hint}')"
    return f"unknown key '{key}': {hint}"


def unknown_key(
    key: str, choices: Sequence[str], aliases: Mapping[str, str] | None = None
) -> ValueError:
    """The error a validator of a free-form mapping field (``algo: {...}``) raises for an unknown
    key: reported at that key's own path and line, with the alias pointer or a suggestion."""
    return _AtLoc(_unknown_key_msg(key, choices, aliases), (key,))


def _model_at(model: Any, loc: Loc) -> type[BaseModel] | None:
    """The pydantic model found at ``loc`` inside ``model``'s annotations, if any."""
    ann = model
    for part in loc:
        ann = _unwrap_model(ann) or ann
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            if not isinstance(part, str) or part not in ann.model_fields:
                return None
            ann = ann.model_fields[part].annotation
            continue
        args = typing.get_args(ann)
        origin = typing.get_origin(ann)
        if isinstance(part, int) and origin in (list, tuple, Sequence) and args:
            ann = args[0]
        elif isinstance(part, str) and origin in (dict, Mapping) and len(args) == 2:
            ann = args[1]
        else:
            return None
    return _unwrap_model(ann)


def _unwrap_model(ann: Any) -> type[BaseModel] | None:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        for arg in typing.get_args(ann):
            found = _unwrap_model(arg)
            if found is not None:
                return found
    return None


def _issues_of(
    exc: ValidationError, model: type[BaseModel], prefix: Loc, env_paths: Mapping[EnvPath, str]
) -> list[_Issue]:
    issues = []
    for err in exc.errors(include_url=False):
        loc: Loc = tuple(err["loc"])
        msg = err["msg"]
        extra = getattr((err.get("ctx") or {}).get("error"), "loc", None)
        if extra:
            loc = (*loc, *extra)
        if err["type"] == "extra_forbidden":
            parent = _model_at(model, loc[:-1])
            names = list(parent.model_fields) if parent else None
            msg = _unknown_key_msg(str(loc[-1]), names, _aliases(parent))
        elif err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        env_var = next((v for p, v in env_paths.items() if loc[: len(p)] == p), None)
        issues.append(_Issue((*prefix, *loc), msg, env_var))
    return issues


# --- settings and environment overrides -------------------------------------------------------


def _env_overrides(
    model: type[BaseModel], service_kind: str, environ: Mapping[str, str]
) -> dict[EnvPath, tuple[str, Any]]:
    """``RLFLEET_<KIND>__<KEY>[__<SUB>]`` variables as {key path: (variable, YAML value)}."""
    prefix = f"{ENV_PREFIX}{service_kind.upper().replace('-', '_')}__"
    found: dict[EnvPath, tuple[str, Any]] = {}
    for var in sorted(environ):
        if not var.startswith(prefix):
            continue
        path = tuple(part.lower() for part in var[len(prefix) :].split("__"))
        for depth, key in enumerate(path):
            parent = _model_at(model, path[:depth])
            if not key or (parent is not None and key not in parent.model_fields):
                names = list(parent.model_fields) if parent else None
                if key in _aliases(parent):
                    msg = _unknown_key_msg(key, names, _aliases(parent))
                    raise ConfigError(f"{var}: {msg} (service kind '{service_kind}')")
                raise ConfigError(
                    f"{var}: unknown key '{key}' for service kind '{service_kind}'"
                    + _suggest(key, names)
                )
            if parent is None:
                break  # a free-form mapping below here: any key goes
        try:
            found[path] = (var, safe_load_yaml(environ[var]))
        except (yaml.YAMLError, YamlTooLarge) as exc:
            raise ConfigError(f"{var}: value is not valid YAML: {exc}") from None
    return found


def _settings(
    model: type[M],
    service_kind: str,
    base: Mapping[str, Any] | BaseModel,
    environ: Mapping[str, str],
    prefix: Loc,
) -> M:
    """Validate ``base`` plus env overrides against ``model``; raises _Invalid or ConfigError."""
    data = base.model_dump() if isinstance(base, BaseModel) else copy.deepcopy(dict(base))
    overrides = _env_overrides(model, service_kind, environ)
    for path, (var, value) in overrides.items():
        node = data
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{var}: {_loc_str(prefix + path)} is not a mapping")
        node[path[-1]] = value
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        env_paths = {path: var for path, (var, _) in overrides.items()}
        raise _Invalid(_issues_of(exc, model, prefix, env_paths)) from None


def settings_from_env(
    model: type[M],
    service_kind: str,
    base: Mapping[str, Any] | BaseModel | None = None,
    environ: Mapping[str, str] | None = None,
) -> M:
    """Validate ``base`` with ``RLFLEET_<KIND>__<KEY>[__<SUB>]=<yaml value>`` overrides applied.

    Overrides exist so a container or a shell can change one setting without editing the run
    file; an unknown key is an error naming the variable, like an unknown key in the file."""
    environ = os.environ if environ is None else environ
    try:
        return _settings(model, service_kind, base or {}, environ, ("settings",))
    except _Invalid as exc:
        raise _render(exc.issues, None) from None


# --- the run config ----------------------------------------------------------------------------


def validate_run_config(
    config: RunConfig,
    *,
    environ: Mapping[str, str] | None = None,
    source: YamlSource | None = None,
    only: Collection[str] | None = None,
    config_dir: Path | None = None,
) -> RunConfig:
    """Validate every service's settings against its kind; returns a config whose
    ``services[i].settings`` are settings-model instances. ``source`` adds file:line to errors.
    ``only`` limits this to the named instances: a container image holds the dependencies of
    its own service kind, not necessarily those of every kind in the run. ``config_dir`` (the
    run file's folder) also runs each kind's ``check`` of this machine (programs on PATH) and
    checks that the packages of the trackers ``run.tracking`` turns on are installed."""
    environ = os.environ if environ is None else environ
    names = {entry.name for entry in config.services}
    kinds = {entry.name: entry.service for entry in config.services}
    issues: list[_Issue] = []
    entries = []
    for i, entry in enumerate(config.services):
        if only is not None and entry.name not in only:
            entries.append(entry)
            continue
        try:
            spec = get_service(entry.service)
        except ConfigError as exc:
            issues.append(_Issue(("services", i, "service"), exc.message))
            continue
        where: Loc = ("services", i, "settings")
        settings = entry.settings
        if not isinstance(settings, spec.settings):  # else validated before, overrides included
            try:
                settings = _settings(spec.settings, spec.kind, settings, environ, where)
            except _Invalid as exc:
                issues.extend(exc.issues)
                continue
        for loc, ref in service_refs(settings, where):
            if ":" not in ref and ref not in names:
                msg = f"unknown service '{ref}'{_suggest(ref, sorted(names))}"
                issues.append(_Issue(loc, msg))
        for loc, ref in address_refs(settings, where):
            if ":" in ref:
                problem = address_problem(ref)
                if problem is not None:
                    issues.append(_Issue(loc, problem))
                continue
            if ref not in names:
                msg = f"unknown service '{ref}'{_suggest(ref, sorted(names))}"
                issues.append(_Issue(loc, msg))
            elif not _serves_grpc(kinds[ref]):
                issues.append(_Issue(loc, f"service '{ref}' ({kinds[ref]}) has no address"))
        if config_dir is not None and spec.check is not None:
            issues.extend(
                _Issue((*where, *sub), msg) for sub, msg in spec.check(settings, config_dir)
            )
        entries.append(entry.model_copy(update={"settings": settings}))
    if config_dir is not None:  # a tracker's package, where `rlfleet up` runs the learner
        issues.extend(
            _Issue(("run", "tracking", *loc), msg)
            for loc, msg in missing_packages(config.run.tracking)
        )
    if issues:
        raise _render(issues, source)
    validated = config.model_copy(update={"services": entries})
    if only is None:  # every service's settings are models now: what each needs is known
        issues = [_Issue(loc, msg) for loc, msg in start_problems(validated)]
        if issues:
            raise _render(issues, source)
    return validated


def load_run_config(
    path: str | os.PathLike[str],
    environ: Mapping[str, str] | None = None,
    *,
    check_machine: bool = False,
) -> RunConfig:
    """Read, parse and fully validate a run file (structure, every service's settings and
    env overrides), raising ConfigError naming file:line and key on the first problems.
    ``check_machine`` (`rlfleet validate`, `rlfleet up`) also runs the kinds' checks of this
    machine relative to the file's folder (a `process` program on PATH); off for readers of a
    run's copy in its run dir (play, export), where relative paths do not hold."""
    config, source = _load_structure(path)
    config_dir = Path(path).resolve().parent if check_machine else None
    return validate_run_config(config, environ=environ, source=source, config_dir=config_dir)


def _serves_grpc(kind: str) -> bool:
    """Whether services of ``kind`` listen on their address (an unknown kind is reported
    elsewhere; here it counts as serving)."""
    try:
        return get_service(kind).grpc
    except ConfigError:
        return True


def read_yaml_mapping(path: str | os.PathLike[str], what: str = "a run config") -> YamlSource:
    """Read and parse a YAML file whose top level must be a mapping (ConfigError otherwise)."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_YAML_BYTES + 1)  # a larger file is refused unread
        check_size(path.stat().st_size if len(raw) > MAX_YAML_BYTES else len(raw))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    except YamlTooLarge as exc:
        raise ConfigError(f"{path}: {exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
            f"({exc.reason}); save the file as UTF-8"
        ) from None
    source = parse_yaml(text, str(path))
    if not isinstance(source.data, dict):
        raise ConfigError(f"{path}:1: the top level of {what} must be a mapping")
    return source


def validate_model(model: type[BaseModel], data: Any, source: YamlSource) -> Any:
    """``model.model_validate(data)``; a ValidationError becomes a ConfigError naming the file,
    line and key of each problem (the rendering every rlfleet config error uses)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _render(_issues_of(exc, model, (), {}), source) from None


def read_run_config(path: str | os.PathLike[str]) -> RunConfig:
    """The run file validated up to (not including) each service's settings, which stay the
    mappings the file or its job gives: what a service reads of the run beyond its own settings
    (``run.tracking``) without importing the settings models, and so the dependencies, of the
    other kinds."""
    return _load_structure(path)[0]


def _load_structure(path: str | os.PathLike[str]) -> tuple[RunConfig, YamlSource]:
    """The run file validated up to (not including) each service's settings."""
    source = read_yaml_mapping(path)
    data = _expand_job(source)
    try:
        return RunConfig.model_validate(data), source
    except ValidationError as exc:
        issues = _top_level_issues(data, _issues_of(exc, RunConfig, (), {}))
        raise _render(issues, source) from None


def _job_models() -> dict[str, type[BaseModel]]:
    """Every installed job kind's settings model; a kind that fails to load is left out (this
    only explains a misplaced knob, it must not fail for an unrelated plugin)."""
    models: dict[str, type[BaseModel]] = {}
    for kind in entry_point_registry(JOBS_GROUP):
        try:
            models[kind] = get_job(kind).settings
        except ConfigError:
            continue
    return models


def _knob_hint(key: str, model: type[BaseModel]) -> str | None:
    """Why ``key`` at the top level belongs under ``job:``, if ``model`` has it (or an alias)."""
    if key in model.model_fields:
        return f"unknown key '{key}': a job knob at the top level; put it under `job:` (job.{key})"
    hint = _aliases(model).get(key)
    if hint is None:
        return None
    if hint in model.model_fields:
        return f"unknown key '{key}': job knobs go under `job:`, and rlfleet calls it job.{hint}"
    return f"unknown key '{key}': job knobs go under `job:`; {hint}"


def _top_level_issues(data: Mapping[str, Any], issues: list[_Issue]) -> list[_Issue]:
    """Unknown top-level keys that are job knobs, explained: a job written without ``job:``
    (one issue instead of "services: Field required" and one per knob), or a knob of the run's
    job written beside it (``device`` -> ``job.device``, not "did you mean 'services'")."""
    unknown = [k for k in data if isinstance(k, str) and k not in RunConfig.model_fields]
    if not unknown:
        return issues
    job = data.get("job")
    if isinstance(job, Mapping):  # _expand_job accepted it: its kind is installed
        model = get_job(str(job["kind"])).settings
        hints = {k: h for k in unknown if (h := _knob_hint(k, model)) is not None}
        return [
            _Issue(i.loc, hints[str(i.loc[0])]) if len(i.loc) == 1 and i.loc[0] in hints else i
            for i in issues
        ]
    models = _job_models()
    knobs = [
        k
        for k in unknown
        if k == "kind" or any(_knob_hint(k, m) is not None for m in models.values())
    ]
    if not knobs or ("kind" not in knobs and "services" in data):
        return issues
    kind = data.get("kind")
    kind = kind if isinstance(kind, str) and kind in models else "..."
    first = next((k for k in knobs if k != "kind"), None)
    example = f"kind: {kind}" + (f", {first}: ..." if first else "")
    flat = _Issue(
        (knobs[0],),
        f"this looks like a job's knobs at the top level ({', '.join(knobs)}); "
        f"put them under `job:` (job: {{{example}}})",
    )
    rest = [
        i for i in issues if not (len(i.loc) == 1 and (i.loc[0] in knobs or i.loc[0] == "services"))
    ]
    return [flat, *rest]


def _expand_job(source: YamlSource) -> dict[str, Any]:
    """The run mapping with its ``job:`` (if any) expanded into leading ``services`` entries.

    The job's knobs are validated against the job kind's model first, so a bad knob is reported
    at its own line; generated entries point at the ``job:`` line in later messages."""
    data = dict(source.data)
    job = data.get("job")
    if job is None:
        return data
    if not isinstance(job, Mapping) or "kind" not in job:
        raise _render([_Issue(("job",), "job must be a mapping with a 'kind' key")], source)
    try:
        spec = get_job(str(job["kind"]))
    except ConfigError as exc:
        raise _render([_Issue(("job", "kind"), exc.message)], source) from None
    run = data.get("run")
    run_name = str(run.get("name", "run")) if isinstance(run, Mapping) else "run"
    knobs = {k: v for k, v in job.items() if k != "kind"}
    try:
        settings = spec.settings.model_validate(knobs)
    except ValidationError as exc:
        raise _render(_issues_of(exc, spec.settings, ("job",), {}), source) from None
    generated = spec.expand(settings, run_name)
    written = list(data.get("services") or [])
    shift = len(generated)
    moved: dict[Loc, int] = {}
    for loc, line in list(source.lines.items()):
        index = loc[1] if loc[:1] == ("services",) and len(loc) > 1 else None
        if isinstance(index, int):
            del source.lines[loc]
            moved[("services", index + shift, *loc[2:])] = line
    source.lines.update(moved)
    for i in range(shift):
        source.lines[("services", i)] = source.lines.get(("job",), 1)
    data["services"] = [*generated, *written]
    return data


def load_service_settings(
    kind: str,
    config_path: str | os.PathLike[str] | None,
    instance_name: str | None,
    environ: Mapping[str, str] | None = None,
) -> StrictModel:
    """Settings for ``rlfleet serve KIND``: the config file's entry for this instance (by name,
    or the only entry of that kind) when a file is given, else the kind's defaults; env
    overrides apply either way."""
    spec = get_service(kind)
    if config_path is None:
        defaults: StrictModel = settings_from_env(spec.settings, spec.kind, {}, environ)
        return defaults
    config, source = _load_structure(config_path)
    if instance_name is not None:
        entry = config.service(instance_name)
        if entry.service != kind:
            raise ConfigError(
                f"{config_path}: service '{instance_name}' is a '{entry.service}', not '{kind}'"
            )
    else:
        entries = [e for e in config.services if e.service == kind]
        if len(entries) != 1:
            raise ConfigError(
                f"{config_path}: {len(entries)} services of kind '{kind}'; pass --name to pick one"
            )
        entry = entries[0]
    config = validate_run_config(config, environ=environ, source=source, only={entry.name})
    settings: StrictModel = config.service(entry.name).settings
    return settings
