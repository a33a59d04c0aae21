"""The Kubernetes manifests (deploy/kubernetes/), checked offline: no API server can run here.

- ``kubectl kustomize`` renders the base and both overlays;
- every rendered object validates strictly (unknown fields are errors) against the schemas of
  three current Kubernetes versions (PyPI kubernetes-validate);
- checkov's findings are exactly the ones deploy/README.md lists with a reason, so a new finding
  fails here until it is fixed or explained;
- what matters structurally: probes (gRPC where the service serves gRPC), resources, the
  restricted security context, service accounts, run files that validate and name only peers
  the manifests define, network policies that let each service reach exactly what it calls,
  GPUs only in the gpu overlay, a workload for every service the compose file runs.

The slow smoke test (every image the manifests name starts under Docker and passes its readiness
probe) is at the end, beside the offline checks: both read the same rendered manifests through
the same few helpers.
"""

from __future__ import annotations

import atexit
import base64
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.config import load_run_config
from services.registry import get_service
from services.settings import service_refs

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
README = ROOT / "deploy" / "README.md"
COMPOSE = ROOT / "deploy" / "compose.yaml"
OVERLAYS = ("cpu", "gpu", "hpa", "game", "lm", "laptop")
TREES = ("base", *(f"overlays/{name}" for name in OVERLAYS))
# Overlays without ReadWriteMany storage: one learner rank on its own volume.
SINGLE_RANK = ("game", "lm", "laptop")
KEDA_OVERLAYS = ("cpu", "gpu", "game", "lm")
SECRETS_SCRIPT = ROOT / "deploy" / "scripts" / "kube-secrets.sh"
KEDA_SCHEMA = Path(__file__).parent / "data" / "keda.sh_scaledobjects.v1alpha1.schema.yaml"
# Services that advertise their pod IP for the membership registry (services/membership.py).
ADVERTISED = {"env-server", "sampler", "reward-service"}
K8S_VERSIONS = ("1.31.0", "1.33.0", "1.35.0")
WORKLOADS = ("Deployment", "StatefulSet", "Job")
GPU = "nvidia.com/gpu"
GPU_WORKLOADS = {"sampler", "learner", "lm-learner"}
CHECKOV_PINS = KUBE / "checkov-requirements.txt"
# The game learner's ranks > 0 serve no gRPC (learner/ranks.py): all ranks are probed on
# /metrics, which every rank serves.
HTTP_PROBED_DESPITE_GRPC = {"learner"}

Doc = dict[str, Any]
Pod = tuple[str, dict[str, str]]  # (namespace, labels)


def render(root: Path, tree: str) -> subprocess.CompletedProcess[str]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) is needed: install kubectl >= 1.27"
    return subprocess.run(
        [kubectl, "kustomize", str(root / tree)], capture_output=True, text=True, timeout=60
    )


@functools.cache
def with_secrets() -> Path:
    """A copy of deploy/kubernetes with the secrets an operator makes first (the secrets script,
    as deploy/README.md says), so the checkout's own secret files are never written."""
    root = Path(tempfile.mkdtemp(prefix="rlfleet-kube-")) / "kubernetes"
    secrets = shutil.ignore_patterns("*.env")  # only the operator's, under secrets/
    shutil.copytree(KUBE, root, ignore=lambda d, n: secrets(d, n) if d.endswith("secrets") else [])
    atexit.register(shutil.rmtree, root.parent, True)
    done = subprocess.run(["bash", str(SECRETS_SCRIPT), str(root)], capture_output=True, text=True)
    assert done.returncode == 0, f"{SECRETS_SCRIPT} failed:\n{done.stderr}"
    return root


def kustomize(tree: str) -> list[Doc]:
    done = render(with_secrets(), tree)
    assert done.returncode == 0, f"kubectl kustomize {tree} failed:\n{done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    return {tree: kustomize(tree) for tree in TREES}


def overlay(rendered: dict[str, list[Doc]], name: str) -> list[Doc]:
    return rendered[f"overlays/{name}"]


def by_kind(docs: list[Doc], *kinds: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in kinds}


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def serve_args(container: Doc) -> tuple[str, str]:
    """(service kind, instance name) of a container running ``rlfleet serve KIND --name NAME``
    (directly through the images' entry point, or as torchrun's command)."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if "serve" in argv:
        argv = argv[argv.index("serve") + 1 :]
    kind = argv[0]
    flags = dict(a.removeprefix("--").split("=", 1) for a in argv if a.startswith("--name="))
    if "--name" in argv:
        flags["name"] = argv[argv.index("--name") + 1]
    return kind, flags["name"]


def rlfleet_containers(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    """(workload, its main container) for every workload that runs an rlfleet service."""
    for workload in by_kind(docs, *WORKLOADS).values():
        container = pod_spec(workload)["containers"][0]
        if "nats-server" not in container.get("command", []):
            yield workload, container


def env_of(docs: list[Doc], container: Doc) -> dict[str, str]:
    """The container's plain environment: its envFrom ConfigMaps, then its own values."""
    maps = by_kind(docs, "ConfigMap")
    secrets = by_kind(docs, "Secret")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "secretRef" in source:
            data = secrets[source["secretRef"]["name"]]["data"]
            env.update({k: base64.b64decode(v).decode() for k, v in data.items()})
        else:
            env.update(maps[source["configMapRef"]["name"]]["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def run_file(docs: list[Doc], path: str, tmp: Path) -> Path:
    """The run file at ``path`` inside the pods, written out from its ConfigMap."""
    for cm in by_kind(docs, "ConfigMap").values():
        if cm["metadata"]["name"].startswith("rlfleet-runs") and Path(path).name in cm["data"]:
            out = tmp / Path(path).name
            out.write_text(cm["data"][Path(path).name])
            return out
    raise AssertionError(f"no ConfigMap holds the run file {path}")


# --------------------------------------------------------------------------- render, validate


@pytest.mark.parametrize("tree", TREES)
def test_kustomize_renders(tree: str) -> None:
    docs = kustomize(tree)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Job", "Service", "NetworkPolicy"} <= kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_strictly(rendered: dict[str, list[Doc]], version: str) -> None:
    # Each distinct object once: most are the same in both overlays (the library reads the
    # version's whole definitions file for every object it validates).
    unique = {
        json.dumps(d, sort_keys=True): d for name in OVERLAYS for d in overlay(rendered, name)
    }
    failures = []
    for doc in unique.values():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a custom resource: KEDA's own schema checks it (test_scaled_objects_...)
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = f"{doc['kind']}/{doc['metadata']['name']} (Kubernetes {version})"
            failures.append(f"{where}: {exc.message}")
    assert not failures, "\n".join(failures)


def test_strict_validation_catches_an_unknown_field(rendered: dict[str, list[Doc]]) -> None:
    deployment = dict(by_kind(overlay(rendered, "cpu"), "Deployment")["env-server"])
    deployment["spec"] = {**deployment["spec"], "replica": 2}  # a typo of `replicas`
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


# --------------------------------------------------------------------------- policy scan


def checkov_python() -> Path:
    """checkov's own venv (its pins clash with the project's), built once per pins file under
    $RLFLEET_CACHE_DIR (default ~/.cache/rlfleet); a file lock keeps concurrent runs to one
    build. About a minute the first time."""
    digest = hashlib.sha256(CHECKOV_PINS.read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("RLFLEET_CACHE_DIR") or Path.home() / ".cache" / "rlfleet")
    venv = cache / f"checkov-{digest}"
    python = venv / "bin" / "python"
    pins = str(CHECKOV_PINS)
    stamp = venv / ".installed"
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f"checkov-{digest}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.is_file():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
            install = subprocess.run(
                [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", pins],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert install.returncode == 0, f"installing checkov failed:\n{install.stderr[-3000:]}"
            stamp.touch()
    return python


# Offline: no guideline download, kubernetes checks only, JSON on stdout.
CHECKOV_ARGS = (
    "--framework",
    "kubernetes",
    "--skip-download",
    "--quiet",
    "--compact",
    "-o",
    "json",
)


def checkov_findings(manifests: dict[str, list[Doc]], tmp: Path) -> set[tuple[str, str]]:
    for name, docs in manifests.items():
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump_all(docs))
    done = subprocess.run(
        [checkov_python(), "-m", "checkov.main", "-d", str(tmp), *CHECKOV_ARGS],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE"},
    )
    assert done.returncode in (0, 1), f"checkov failed ({done.returncode}):\n{done.stderr}"
    report = json.loads(done.stdout) if done.stdout.strip() else {}
    reports = report if isinstance(report, list) else [report]
    assert all(r.get("summary", {}).get("parsing_errors", 0) == 0 for r in reports), done.stdout
    return {
        (f["check_id"], f["resource"].split(".", 1)[0] + "/" + f["resource"].rsplit(".", 1)[-1])
        for r in reports
        for f in r.get("results", {}).get("failed_checks", [])
    }


def listed_findings() -> set[tuple[str, str]]:
    """(check, Kind/name) for each row of the table under deploy/README.md's "Policy scan
    findings": ``| CKV_K8S_43 | Deployment/env-server, Job/learner | reason |``."""
    text = README.read_text()
    match = re.search(r"^## Policy scan findings\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"{README} has no '## Policy scan findings' section"
    listed = set()
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"CKV2?_K8S_\d+", cells[0]):
            assert cells[2], f"{cells[0]} is listed without a reason"
            listed |= {(cells[0], r.strip().strip("`")) for r in cells[1].split(",")}
    return listed


def test_policy_scan_findings_are_the_listed_ones(
    rendered: dict[str, list[Doc]], tmp_path: Path
) -> None:
    found = checkov_findings({name: overlay(rendered, name) for name in OVERLAYS}, tmp_path)
    listed = listed_findings()
    assert found, "checkov reported nothing: the scan did not run on the manifests"
    new, gone = sorted(found - listed), sorted(listed - found)
    assert not new, f"new checkov findings: fix them or list them in {README}: {new}"
    assert not gone, f"listed in {README} but no longer found (remove them): {gone}"


# --------------------------------------------------------------------------- structure


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_workload_is_probed_sized_and_locked_down(
    rendered: dict[str, list[Doc]], name: str
) -> None:
    docs = overlay(rendered, name)
    accounts = by_kind(docs, "ServiceAccount")
    problems = []
    for workload in by_kind(docs, *WORKLOADS).values():
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        spec = pod_spec(workload)
        pod_sc = spec.get("securityContext", {})
        if not (pod_sc.get("runAsNonRoot") and pod_sc.get("runAsUser", 0) > 0):
            problems.append(f"{where}: pod not forced non-root")
        if pod_sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            problems.append(f"{where}: seccomp profile is not RuntimeDefault")
        if spec.get("automountServiceAccountToken") is not False:
            problems.append(f"{where}: mounts a service account token")
        account = accounts.get(spec.get("serviceAccountName", "default"))
        if account is None or account.get("automountServiceAccountToken") is not False:
            problems.append(f"{where}: no own ServiceAccount with automountServiceAccountToken off")
        writable = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for container in spec.get("initContainers", []) + spec["containers"]:
            at = f"{where} container {container['name']}"
            sc = container.get("securityContext", {})
            if not sc.get("readOnlyRootFilesystem"):
                problems.append(f"{at}: root filesystem is writable")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{at}: privilege escalation allowed")
            if sc.get("capabilities", {}).get("drop") != ["ALL"]:
                problems.append(f"{at}: capabilities not all dropped")
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            if mounts.get("/tmp") not in writable:
                problems.append(f"{at}: no emptyDir at /tmp")
            for kind in ("requests", "limits"):
                missing = {"cpu", "memory"} - set(container.get("resources", {}).get(kind, {}))
                if missing:
                    problems.append(f"{at}: no {kind} for {sorted(missing)}")
        main = spec["containers"][0]
        for probe in ("readinessProbe", "livenessProbe"):
            if probe not in main:
                problems.append(f"{where}: no {probe}")
    assert not problems, "\n".join(problems)


def test_probes_use_grpc_health_where_the_service_serves_grpc(
    rendered: dict[str, list[Doc]],
) -> None:
    for _, container in rlfleet_containers(overlay(rendered, "cpu")):
        kind, name = serve_args(container)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        args = container.get("args", [])
        grpc_port = int(args[args.index("--port") + 1]) if "--port" in args else None
        for probe in ("readinessProbe", "livenessProbe"):
            action = container[probe]
            if get_service(kind).grpc and name not in HTTP_PROBED_DESPITE_GRPC:
                assert action.get("grpc", {}).get("port") == grpc_port == ports["grpc"], (
                    f"{name}: {probe} must be the gRPC health of port {ports['grpc']}: {action}"
                )
            else:  # no gRPC server: the /metrics endpoint (RLFLEET_METRICS_PORT) answers
                env = env_of(overlay(rendered, "cpu"), container)
                assert action["httpGet"]["path"] == "/metrics", f"{name}: {probe}: {action}"
                assert action["httpGet"]["port"] == "metrics", f"{name}: {probe}: {action}"
                assert str(ports["metrics"]) == env["RLFLEET_METRICS_PORT"], name


def test_run_files_validate_and_name_only_defined_peers(
    rendered: dict[str, list[Doc]], tmp_path: Path
) -> None:
    docs = overlay(rendered, "cpu")
    services = by_kind(docs, "Service")
    statefulsets = by_kind(docs, "StatefulSet")
    for workload, container in rlfleet_containers(docs):
        kind, name = serve_args(container)
        env = env_of(docs, container)
        # The run file is where the pod mounts the ConfigMap holding it.
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        mounted = {
            m["mountPath"]: volumes[m["name"]].get("configMap", {}).get("name", "")
            for m in container["volumeMounts"]
        }
        folder = str(Path(env["RLFLEET_RUN_CONFIG"]).parent)
        assert mounted.get(folder, "").startswith("rlfleet-runs"), (
            f"{name}: no run files at {folder}"
        )
        config = load_run_config(run_file(docs, env["RLFLEET_RUN_CONFIG"], tmp_path), {})
        assert config.run.name == env["RLFLEET_RUN_NAME"], f"{name}: run name differs"
        entry = config.service(name)
        assert entry.service == kind, f"{name}: runs {kind}, its run file says {entry.service}"
        for peer in peer_addresses(entry.settings.model_dump()):
            host, port = peer.rsplit(":", 1)
            parts = host.split(".")
            service = services.get(parts[-1])
            assert service, f"{name} calls {peer}: no Service {parts[-1]}"
            assert int(port) in {p["port"] for p in service["spec"]["ports"]}, peer
            if len(parts) == 2:  # pod-N.service: a StatefulSet pod behind a headless Service
                pod, index = parts[0].rsplit("-", 1)
                owner = statefulsets.get(pod)
                assert owner and owner["spec"]["serviceName"] == parts[1], peer
                assert service["spec"].get("clusterIP") == "None", peer
                hpa = by_kind(docs, "HorizontalPodAutoscaler").get(pod)
                scaled = by_kind(docs, "ScaledObject").get(pod)
                most = (
                    hpa["spec"]["maxReplicas"]
                    if hpa
                    else scaled["spec"]["maxReplicaCount"]
                    if scaled
                    else owner["spec"]["replicas"]
                )
                assert int(index) < most, f"{name} lists {peer}: beyond {pod}'s {most} replicas"


def peer_addresses(settings: Any) -> Iterator[str]:
    """Every ``host:port`` string inside a settings dump (the ServiceRefs of a run file)."""
    if isinstance(settings, dict):
        for value in settings.values():
            yield from peer_addresses(value)
    elif isinstance(settings, list):
        for value in settings:
            yield from peer_addresses(value)
    elif isinstance(settings, str) and re.fullmatch(r"[a-z0-9.-]+:\d+", settings):
        yield settings


def test_pods_run_as_the_images_user(rendered: dict[str, list[Doc]]) -> None:
    """runAsUser/runAsGroup are the UID/GID the images' files belong to (their USER line)."""
    users = {
        re.search(r"^USER (\S+)", f.read_text(), re.M).group(1)  # type: ignore[union-attr]
        for f in (ROOT / "deploy" / "docker").glob("*.Dockerfile")
    }
    assert len(users) == 1, f"the images disagree on their user: {users}"
    for name in OVERLAYS:
        for workload in by_kind(overlay(rendered, name), *WORKLOADS).values():
            sc = pod_spec(workload)["securityContext"]
            assert f"{sc['runAsUser']}:{sc['runAsGroup']}" in users, workload["metadata"]["name"]


def test_autoscalers_use_metrics_the_services_export(rendered: dict[str, list[Doc]]) -> None:
    """Each custom metric an HPA asks for has a Prometheus Adapter rule, and each rule reads a
    series a service really registers (the services' collectors, imported here)."""
    import prometheus_client

    import gateway.metrics  # noqa: F401  (registers the gateway's collectors)
    import learner.prometheus  # noqa: F401
    import reward_service.servicer  # noqa: F401
    import services.telemetry  # noqa: F401  (the gRPC server collectors of every service)

    adapter = yaml.safe_load((KUBE / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    rules = {r["name"]["as"]: r for r in adapter["rules"]["custom"]}
    external = {r["name"]["as"] for r in adapter["rules"]["external"]}
    exported = {
        sample.name for family in prometheus_client.REGISTRY.collect() for sample in family.samples
    } | {family.name for family in prometheus_client.REGISTRY.collect()}
    hpas = by_kind(overlay(rendered, "hpa"), "HorizontalPodAutoscaler").values()
    wanted = {
        m["pods"]["metric"]["name"] for h in hpas for m in h["spec"]["metrics"] if "pods" in m
    }
    assert wanted, "no autoscaler uses a custom metric"
    assert wanted <= set(rules), f"no adapter rule for {wanted - set(rules)}"
    outside = {
        m["external"]["metric"]["name"]
        for h in hpas
        for m in h["spec"]["metrics"]
        if "external" in m
    }
    assert outside and outside <= external, f"no adapter external rule for {outside - external}"
    for name, rule in rules.items():
        series = re.match(r"\w+", rule["seriesQuery"].strip("'")).group(0)  # type: ignore[union-attr]
        assert series in exported or series.removesuffix("_sum") in exported, (
            f"adapter rule {name} reads {series}, which no service exports"
        )


def test_gpus_only_in_the_gpu_overlay(rendered: dict[str, list[Doc]]) -> None:
    def with_gpus(docs: list[Doc]) -> set[str]:
        return {
            w["metadata"]["name"]
            for w in by_kind(docs, *WORKLOADS).values()
            for c in pod_spec(w)["containers"]
            if GPU in c["resources"].get("limits", {})
        }

    assert with_gpus(rendered["base"]) == set()
    for name in OVERLAYS:
        assert with_gpus(overlay(rendered, name)) == (GPU_WORKLOADS if name == "gpu" else set())


def test_every_compose_service_has_a_workload(rendered: dict[str, list[Doc]]) -> None:
    """What the compose file's game and lm profiles run (rlfleet service kinds, NATS, the
    one-off init-model) Kubernetes runs too."""
    compose = yaml.safe_load(COMPOSE.read_text())
    in_compose = {}
    for name, service in compose["services"].items():
        if set(service.get("profiles", ["game"])).isdisjoint({"game", "lm"}):
            continue  # observability: Prometheus, the collector, the trace viewer
        argv = [*words(service.get("entrypoint")), *words(service.get("command"))]
        runs = next((w for w in argv if w in SERVICE_KINDS or w in ("init-model",)), None)
        runs = "nats" if any("nats-server" in w for w in argv) else runs
        assert runs, f"{COMPOSE}: cannot tell what service '{name}' runs ({argv})"
        in_compose[runs] = name
    docs = overlay(rendered, "cpu")
    here = {serve_args(c)[0] for _, c in rlfleet_containers(docs)}
    here |= {"nats"} if "nats" in by_kind(docs, "StatefulSet") else set()
    for workload in by_kind(docs, *WORKLOADS).values():
        for init in pod_spec(workload).get("initContainers", []):
            here |= {w for w in init.get("command", []) if w == "init-model"}
    missing = {in_compose[k]: k for k in set(in_compose) - here}
    assert not missing, f"compose services without a Kubernetes workload: {missing}"


def words(value: str | list[Any] | None) -> list[str]:
    if value is None:
        return []
    return value.split() if isinstance(value, str) else [str(v) for v in value]


SERVICE_KINDS = {
    "env_server",
    "game_actor",
    "learner",
    "lm_learner",
    "sampler",
    "rollout",
    "reward_service",
    "gateway",
}


# --------------------------------------------------------------------------- network policies


class Policies:
    """Allowed connections under the rendered NetworkPolicies (matchLabels selectors, ports by
    number; what these manifests use). A pod is (namespace, labels); the manifests' namespace
    is ``home``."""

    def __init__(self, docs: list[Doc], home: str) -> None:
        self.policies = list(by_kind(docs, "NetworkPolicy").values())
        self.home = home

    @staticmethod
    def _selects(selector: Doc, labels: dict[str, str]) -> bool:
        wanted: dict[str, str] = selector.get("matchLabels", {})
        return all(labels.get(k) == v for k, v in wanted.items())

    def _peer_matches(self, peer: Doc, ns: str, labels: dict[str, str]) -> bool:
        if "namespaceSelector" in peer:
            ns_labels = {"kubernetes.io/metadata.name": ns}
            if not self._selects(peer["namespaceSelector"], ns_labels):
                return False
        elif ns != self.home:
            return False
        return self._selects(peer.get("podSelector", {}), labels)

    def _allows(self, direction: str, pod: Pod, other: Pod, port: int) -> bool:
        key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
        if pod[0] != self.home:
            return True  # not ours: assume other namespaces allow their side
        selecting = [
            p
            for p in self.policies
            if direction in p["spec"]["policyTypes"]
            and self._selects(p["spec"]["podSelector"], pod[1])
        ]
        if not selecting:
            return True  # no policy isolates this pod in this direction
        for policy in selecting:
            for rule in policy["spec"].get(key, []):
                ports = rule.get("ports")
                if ports is not None and port not in {p["port"] for p in ports}:
                    continue
                if peers not in rule or any(self._peer_matches(x, *other) for x in rule[peers]):
                    return True
        return False

    def can_connect(self, src: Pod, dst: Pod, port: int) -> bool:
        return self._allows("Egress", src, dst, port) and self._allows("Ingress", dst, src, port)


def test_network_policies_allow_exactly_the_calls_the_services_make(
    rendered: dict[str, list[Doc]], tmp_path: Path
) -> None:
    docs = overlay(rendered, "cpu")
    home = docs[0]["metadata"].get("namespace") or "rlfleet"
    policies = Policies(docs, home)
    services = by_kind(docs, "Service")
    pods = {
        w["metadata"]["name"]: (home, pod_labels(w)) for w in by_kind(docs, *WORKLOADS).values()
    }

    def backing(service: str) -> str:
        """The workload whose pods a Service selects (by app name: the learner's Service also
        picks rank 0 by the completion-index label Kubernetes adds to the Job's pods)."""
        app = services[service]["spec"]["selector"]["app.kubernetes.io/name"]
        return next(w for w, (_, labels) in pods.items() if labels["app.kubernetes.io/name"] == app)

    calls: set[tuple[str, str, int]] = set()
    for workload, container in rlfleet_containers(docs):
        _, name = serve_args(container)
        env = env_of(docs, container)
        config = load_run_config(run_file(docs, env["RLFLEET_RUN_CONFIG"], tmp_path), {})
        # Peers named by instance reach its replicas, and its Service before they register.
        endpoints = json.loads(env.get("RLFLEET_ENDPOINTS", "{}"))
        refs = [ref for _, ref in service_refs(config.service(name).settings, ())]
        for peer in {endpoints.get(ref, ref) for ref in refs}:
            assert ":" in peer, f"{name}: peer {peer!r} has no address in RLFLEET_ENDPOINTS"
            host, port = peer.rsplit(":", 1)
            calls.add((workload["metadata"]["name"], backing(host.split(".")[-1]), int(port)))
        calls.add((workload["metadata"]["name"], "nats", 4222))
    # Every call a run file implies is allowed...
    for src, dst, port in sorted(calls):
        assert policies.can_connect(pods[src], pods[dst], port), f"{src} -> {dst}:{port} blocked"
    # ...and no other call between rlfleet pods on the gRPC port.
    for src in pods:
        for dst in pods:
            if src != dst and (src, dst, 50051) not in calls:
                assert not policies.can_connect(pods[src], pods[dst], 50051), f"{src} -> {dst}"
    # The learner's ranks meet on the rendezvous port and then on ports gloo/NCCL pick.
    assert policies.can_connect(pods["learner"], pods["learner"], 29500)
    assert not policies.can_connect(pods["env-server"], pods["learner"], 29500)
    outside = ("ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"})
    assert policies.can_connect(outside, pods["gateway"], 8000)
    for name in pods:
        if name != "gateway":
            for port in (50051, 9100, 8000, 4222):
                assert not policies.can_connect(outside, pods[name], port), f"outside -> {name}"
    prometheus = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
    assert all(policies.can_connect(prometheus, pods[n], 9100) for n in pods if n != "nats")


# --------------------------------------------------------------------------- operability


def test_rendering_without_the_secrets_names_the_file_to_make(tmp_path: Path) -> None:
    """The gateway key and the bus password are not in git: until an operator makes them
    (deploy/scripts/kube-secrets.sh), kustomize stops naming the file, not with an empty key."""
    root = tmp_path / "kubernetes"
    shutil.copytree(with_secrets(), root)
    for name, missing in (("game", "core/secrets/nats.env"), ("lm", "lm/secrets/gateway.env")):
        secret = root / "base" / missing
        text = secret.read_text()
        secret.unlink()
        done = render(root, f"overlays/{name}")
        assert done.returncode != 0 and f"base/{missing}" in done.stderr, done.stderr
        secret.write_text(text)
    (root / "base/lm/secrets/gateway.env").unlink()
    # The script makes both again, and keeps a file it finds (a password under running pods).
    kept = "RLFLEET_NATS_USER=me\nRLFLEET_NATS_PASSWORD=mine\n"
    (root / "base/core/secrets/nats.env").write_text(kept)
    subprocess.run(["bash", str(SECRETS_SCRIPT), str(root)], check=True, capture_output=True)
    assert (root / "base/core/secrets/nats.env").read_text() == kept
    key = (root / "base/lm/secrets/gateway.env").read_text()
    assert re.fullmatch(r"RLFLEET_API_KEY=sk-[0-9a-f]{64}\n", key), key
    assert render(root, "overlays/cpu").returncode == 0


def closed(schema: Any) -> Any:
    """``schema`` with every object closed to properties it does not declare: what the API
    server's strict field validation does for a CRD (kubectl apply --validate=strict)."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        open_ = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in out and not open_:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def keda_validator() -> Any:
    import jsonschema  # type: ignore[import-untyped]

    schema = closed(yaml.safe_load(KEDA_SCHEMA.read_text()))
    return jsonschema.Draft7Validator(schema)


def test_scaled_objects_validate_against_kedas_crd(
    rendered: dict[str, list[Doc]], keda_validator: Any
) -> None:
    for name in KEDA_OVERLAYS:
        objects = by_kind(overlay(rendered, name), "ScaledObject")
        assert objects, f"overlays/{name}: no ScaledObject"
        for scaled in objects.values():
            errors = [e.message for e in keda_validator.iter_errors(scaled)]
            assert not errors, (
                f"overlays/{name} ScaledObject/{scaled['metadata']['name']}: {errors}"
            )
    for name in set(OVERLAYS) - set(KEDA_OVERLAYS):
        assert not by_kind(overlay(rendered, name), "ScaledObject"), name
    typo = dict(by_kind(overlay(rendered, "cpu"), "ScaledObject")["env-server"])
    typo["spec"] = {**typo["spec"], "maxReplicas": 8}  # an HPA's name for maxReplicaCount
    assert any("maxReplicas" in e.message for e in keda_validator.iter_errors(typo))


def test_scaled_objects_scale_what_they_say_on_rl_signals(
    rendered: dict[str, list[Doc]], tmp_path: Path
) -> None:
    """Each ScaledObject targets a workload of its overlay that no HPA also scales; the
    nats-jetstream triggers read the LM run's prompt queue (stream and durable as the bus
    names them) from the NATS headless Service's monitoring port."""
    from services.bus.subjects import QUEUE_DURABLE, work_queue_stream

    docs = overlay(rendered, "cpu")
    (home,) = by_kind(docs, "Namespace")
    workloads = {(w["kind"], w["metadata"]["name"]) for w in by_kind(docs, *WORKLOADS).values()}
    scaled = by_kind(docs, "ScaledObject")
    assert not by_kind(docs, "HorizontalPodAutoscaler"), "an HPA beside KEDA fights it"
    triggers: dict[str, set[str]] = {}
    for name, obj in scaled.items():
        ref = obj["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) in workloads, f"{name} scales nothing: {ref}"
        triggers[ref["name"]] = {t["type"] for t in obj["spec"]["triggers"]}
    assert triggers["rollout-driver"] == triggers["sampler"] == {"nats-jetstream"}
    assert triggers["env-server"] == triggers["reward-service"] == {"prometheus"}
    rollout = by_kind(docs, "Job")["rollout"]
    env = env_of(docs, pod_spec(rollout)["containers"][0])
    config = load_run_config(run_file(docs, env["RLFLEET_RUN_CONFIG"], tmp_path), {})
    queue = config.service("rollout").settings.queue
    headless = by_kind(docs, "Service")["nats-headless"]["spec"]
    for obj in scaled.values():
        for trigger in obj["spec"]["triggers"]:
            meta = trigger["metadata"]
            if trigger["type"] == "nats-jetstream":
                assert meta["stream"] == work_queue_stream(env["RLFLEET_RUN_NAME"], queue)
                assert meta["consumer"] == QUEUE_DURABLE
                host, port = meta["natsServerMonitoringEndpoint"].rsplit(":", 1)
                assert host == f"nats-headless.{home}.svc.cluster.local", host
                assert int(port) in {p["port"] for p in headless["ports"]}
            elif trigger["type"] == "prometheus":
                assert f'namespace="{home}"' in meta["query"], meta["query"]
    # The extra drivers exist only for a backlog; the feeder is the Job.
    assert scaled["rollout-driver"]["spec"]["minReplicaCount"] == 0
    driver = pod_spec(by_kind(docs, "Deployment")["rollout-driver"])["containers"][0]
    assert env_of(docs, driver)["RLFLEET_ROLLOUT__FEED"] == "false"
    assert config.service("rollout").settings.feed


# What a run's workers do when the run is over (services/bus/runs.py stop_when_run_over, the
# learners' own end): exit 0. Those must be Jobs, or they are restarted against a finished run.
ENDS_WITH_THE_RUN = {"game_actor", "learner", "lm_learner"}


@pytest.mark.parametrize("name", OVERLAYS)
def test_workloads_that_end_with_the_run_are_jobs(
    rendered: dict[str, list[Doc]], name: str
) -> None:
    docs = overlay(rendered, name)
    for workload, container in rlfleet_containers(docs):
        kind, _ = serve_args(container)
        where = f"overlays/{name} {workload['kind']}/{workload['metadata']['name']}"
        feeds = (
            kind == "rollout" and env_of(docs, container).get("RLFLEET_ROLLOUT__FEED") != "false"
        )
        if kind in ENDS_WITH_THE_RUN or feeds:
            assert workload["kind"] == "Job", f"{where} ends with the run: a Job, not restarted"
            assert pod_spec(workload)["restartPolicy"] == "OnFailure", where


@pytest.mark.parametrize("name", OVERLAYS)
def test_replicas_spread_learners_go_first_and_servers_advertise_their_ip(
    rendered: dict[str, list[Doc]], name: str
) -> None:
    docs = overlay(rendered, name)
    classes = by_kind(docs, "PriorityClass")
    for workload in by_kind(docs, *WORKLOADS).values():
        spec, app = pod_spec(workload), workload["metadata"]["name"]
        where = f"overlays/{name} {workload['kind']}/{app}"
        if workload["kind"] != "Job" or workload["spec"].get("parallelism", 1) > 1:
            keys = {c["topologyKey"] for c in spec.get("topologySpreadConstraints", [])}
            assert "kubernetes.io/hostname" in keys, f"{where}: replicas not spread over nodes"
            for c in spec["topologySpreadConstraints"]:
                assert c["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": app}
        if app in ("learner", "lm-learner"):
            assert spec.get("priorityClassName") in classes, f"{where}: no PriorityClass"
        if app in ADVERTISED:
            env = {e["name"]: e for e in spec["containers"][0]["env"]}
            field = env["RLFLEET_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert field == "status.podIP", where


@pytest.mark.parametrize("name", OVERLAYS)
def test_nats_is_a_cluster_with_auth_and_replicated_streams(
    rendered: dict[str, list[Doc]], name: str
) -> None:
    """3 JetStream nodes whose routes name every node, streams of as many replicas, a PDB that
    keeps the quorum, every service and the server reading one user from Secret nats-auth; the
    laptop overlay's single server with single-replica streams."""
    docs = overlay(rendered, name)
    nats = by_kind(docs, "StatefulSet")["nats"]
    nodes = nats["spec"]["replicas"]
    assert nodes == (1 if name == "laptop" else 3)
    conf = next(c for c in by_kind(docs, "ConfigMap").values() if "nats.conf" in c["data"])
    text = conf["data"]["nats.conf"]
    routes = re.findall(r"nats://([\w.-]+):6222", text)
    expected = [f"nats-{i}.{nats['spec']['serviceName']}" for i in range(nodes)]
    assert routes == (expected if nodes > 1 else []), routes
    assert re.search(
        r"authorization \{\s*user: \$RLFLEET_NATS_USER\s*password: \$RLFLEET_NATS_PASSWORD", text
    )
    secret = by_kind(docs, "Secret")
    auth = next(n for n in secret if n.startswith("nats-auth"))
    assert {"RLFLEET_NATS_USER", "RLFLEET_NATS_PASSWORD"} <= set(secret[auth]["data"])
    containers = [pod_spec(nats)["containers"][0]] + [c for _, c in rlfleet_containers(docs)]
    for container in containers:
        env = env_of(docs, container)
        assert env["RLFLEET_NATS_PASSWORD"] and env["RLFLEET_NATS_USER"], container["name"]
        if container["name"] != "nats":
            assert env["RLFLEET_NATS_REPLICAS"] == str(nodes), container["name"]
    pdb = by_kind(docs, "PodDisruptionBudget")["nats"]["spec"]
    if nodes > 1:
        assert pdb["maxUnavailable"] == (nodes - 1) // 2, "a drain must keep the quorum"
    exporter = {c["name"]: c for c in pod_spec(nats)["containers"]}["exporter"]
    assert "http://localhost:8222" in exporter["args"] and "-jsz=all" in exporter["args"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_read_write_many_only_with_several_learner_ranks(
    rendered: dict[str, list[Doc]], name: str
) -> None:
    docs = overlay(rendered, name)
    claims = by_kind(docs, "PersistentVolumeClaim")
    learner = by_kind(docs, "Job").get("learner")
    for claim_name, claim in claims.items():
        shared = "ReadWriteMany" in claim["spec"]["accessModes"]
        ranks = learner["spec"]["completions"] if learner else 1
        assert shared == (claim_name == "learner-run" and ranks > 1), f"{name}: {claim_name}"
    if learner is not None:
        ranks = learner["spec"]["completions"]
        assert ranks == learner["spec"]["parallelism"]
        assert f"--nnodes={ranks}" in pod_spec(learner)["containers"][0]["args"]
        assert (ranks == 1) == (name in SINGLE_RANK), f"{name}: {ranks} ranks"


# --------------------------------------------------------------------------- image smoke test

# The pods the smoke test starts: both images, the bus, and the multi-rank learner. The LM
# workloads (sampler, LM learner, rollout, gateway) use the same two images but need a vLLM
# engine and a DeepSpeed LM engine up before they are ready: minutes of CPU each here.
# All three bus nodes: JetStream answers only once a majority of the cluster is up.
SMOKE = {"nats": 3, "env-server": 1, "reward-service": 1, "learner": 2, "game-actor": 1}
SMOKE_READY_S = 240.0


class Pods:
    """Starts pods of the rendered manifests as containers on one Docker network, the way the
    kubelet would: the pod's command, args ($(VAR) expanded), environment (ConfigMaps and the
    downward API), user, read-only root, dropped capabilities, memory limit, emptyDirs as
    tmpfs, ConfigMaps and volumes as host folders, and each Service name the pod is behind as
    a network alias."""

    def __init__(self, docs: list[Doc], env: dict[str, str], images: dict[str, str], tmp: Path):
        self.docs, self.tmp, self.env = docs, tmp, env
        self.images = images  # rlfleet/slim -> rlfleet/slim:TAG, the build under test
        self.tag = f"rlfleet-k8s-smoke-{os.getpid()}"
        self.containers: list[str] = []
        self.docker("network", "create", self.tag)

    def docker(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(
            ["docker", *args], env=self.env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0 or not check, f"docker {args[0]}: {done.stderr}"
        return done.stdout.strip()

    def start(self, workload: Doc, index: int) -> tuple[str, Doc, dict[int, int]]:
        """Start pod ``index`` of ``workload``; returns (container, its probe, host ports)."""
        name, spec = workload["metadata"]["name"], pod_spec(workload)
        assert not spec.get("initContainers"), f"{name}: init containers are not run here"
        container = spec["containers"][0]
        pod = f"{name}-{index}" if workload["kind"] != "Deployment" else f"{name}-smoke"
        env = env_of(self.docs, container)
        downward = {
            "metadata.name": pod,
            "status.podIP": pod,  # Docker's DNS answers the container's name
            "metadata.labels['apps.kubernetes.io/pod-index']": str(index),
            "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(index),
        }
        for var in container.get("env", []):
            if "fieldRef" in var.get("valueFrom", {}):
                env[var["name"]] = downward[var["valueFrom"]["fieldRef"]["fieldPath"]]
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
        pod_sc, sc = spec["securityContext"], container["securityContext"]
        run = ["run", "-d", "--name", f"{self.tag}-{pod}", "--network", self.tag]
        run += ["--hostname", pod, "--user", f"{pod_sc['runAsUser']}:{pod_sc['runAsGroup']}"]
        run += ["--read-only"] if sc["readOnlyRootFilesystem"] else []
        run += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
        run += ["--memory", docker_size(container["resources"]["limits"]["memory"])]
        for alias in self.aliases(workload, pod, index):
            run += ["--network-alias", alias]
        for key, value in env.items():
            run += ["-e", f"{key}={value}"]
        run += self.mounts(spec, container, pod)
        probe = container["readinessProbe"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        port = probe["grpc"]["port"] if "grpc" in probe else probe["httpGet"]["port"]
        port = ports.get(port, port)
        run += ["-p", f"127.0.0.1::{port}"]
        image = self.images[container["image"].rsplit(":", 1)[0]]
        if "command" in container:
            run += ["--entrypoint", container["command"][0], image, *container["command"][1:]]
        else:
            run += [image]
        run += argv
        cid = self.docker(*run)
        self.containers.append(cid)
        published = self.docker("port", cid, f"{port}/tcp").splitlines()[0].rsplit(":", 1)[1]
        return cid, probe, {int(port): int(published)}

    def aliases(self, workload: Doc, pod: str, index: int) -> list[str]:
        labels = pod_labels(workload)
        labels = {**labels, "batch.kubernetes.io/job-completion-index": str(index)}
        found = [
            s["metadata"]["name"]
            for s in by_kind(self.docs, "Service").values()
            if all(labels.get(k) == v for k, v in s["spec"]["selector"].items())
        ]
        subdomain = pod_spec(workload).get("subdomain") or workload["spec"].get("serviceName")
        return found + ([f"{pod}.{subdomain}"] if subdomain else [])

    def mounts(self, spec: Doc, container: Doc, pod: str) -> list[str]:
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        out = []
        for mount in container.get("volumeMounts", []):
            volume, path = volumes.get(mount["name"], {}), mount["mountPath"]
            if "emptyDir" in volume and path == "/dev/shm":
                out += ["--shm-size", docker_size(volume["emptyDir"].get("sizeLimit", "64Mi"))]
            elif "emptyDir" in volume:  # exec, as an emptyDir is (Docker's tmpfs default: not)
                size = docker_size(volume["emptyDir"].get("sizeLimit", "1Gi"))
                out += ["--tmpfs", f"{path}:rw,exec,mode=1777,size={size}"]
            elif "configMap" in volume:
                cm = next(
                    c
                    for c in by_kind(self.docs, "ConfigMap").values()
                    if c["metadata"]["name"].startswith(volume["configMap"]["name"])
                )
                folder = self.folder(f"cm-{mount['name']}")
                for key, text in cm["data"].items():
                    (folder / key).write_text(text)
                out += ["-v", f"{folder}:{path}:ro"]
            else:  # a PersistentVolumeClaim (shared by the pods that name it) or a template's
                claim = volume.get("persistentVolumeClaim", {}).get("claimName", f"{pod}-data")
                out += ["-v", f"{self.folder(f'pvc-{claim}')}:{path}"]
        return out

    def folder(self, name: str) -> Path:
        folder = self.tmp / name
        folder.mkdir(exist_ok=True)
        folder.chmod(0o777)  # the pods' UID owns nothing on the host
        return folder

    def logs(self, cid: str) -> str:
        done = subprocess.run(
            ["docker", "logs", "--tail", "40", cid], env=self.env, capture_output=True, text=True
        )
        return done.stdout + done.stderr

    def running(self, cid: str) -> bool:
        return self.docker("inspect", "-f", "{{.State.Running}}", cid, check=False) == "true"

    def close(self) -> None:
        for cid in self.containers:
            self.docker("rm", "-f", cid, check=False)
        self.docker("network", "rm", self.tag, check=False)


def docker_size(quantity: str) -> str:
    """A Kubernetes quantity (512Mi, 2Gi) as Docker writes sizes (512m, 2g)."""
    return quantity.replace("Gi", "g").replace("Mi", "m")


def probe_passes(probe: Doc, ports: dict[int, int]) -> bool:
    """One readiness check as the kubelet makes it, through the container's published port."""
    import urllib.request

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    (port,) = ports.values()
    if "grpc" in probe:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")),
                    timeout=2,
                )
            except grpc.RpcError:
                return False
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    try:
        url = f"http://127.0.0.1:{port}{probe['httpGet']['path']}"
        with urllib.request.urlopen(url, timeout=2) as reply:
            return 200 <= reply.status < 400
    except OSError:
        return False


@pytest.mark.slow
def test_every_image_starts_and_passes_its_readiness_probe(
    docker_engine: Any, images: dict[str, str], tmp_path: Path
) -> None:
    """Each image the cpu overlay names, built by tests/deploy/conftest.py (tag `test`, where
    the overlay says `dev`), run as the manifests run it, until its readiness probe passes."""
    import time

    docs = kustomize("overlays/cpu")
    workloads = by_kind(docs, *WORKLOADS)
    named = {c["image"] for w in workloads.values() for c in pod_spec(w)["containers"]}
    named |= {c["image"] for w in workloads.values() for c in pod_spec(w).get("initContainers", [])}
    named = {i for i in named if i.startswith("rlfleet/")}  # not the NATS exporter's
    smoked = {pod_spec(workloads[n])["containers"][0]["image"] for n in SMOKE}
    assert smoked == named, f"the smoke test leaves images out: {named - smoked}"
    built = {f"rlfleet/{k}": v for k, v in images.items() if k != "tag"}
    assert {i.rsplit(":", 1)[0] for i in named} <= set(built), f"not built: {named}"
    pods = Pods(docs, docker_engine.env, built, tmp_path)
    try:
        started = {
            f"{name}-{i}": pods.start(workloads[name], i)
            for name, count in SMOKE.items()
            for i in range(count)
        }
        deadline = time.monotonic() + SMOKE_READY_S
        waiting = dict(started)
        while waiting and time.monotonic() < deadline:
            for pod, (cid, probe, ports) in list(waiting.items()):
                assert pods.running(cid), f"{pod} exited:\n{pods.logs(cid)}"
                if probe_passes(probe, ports):
                    del waiting[pod]
            time.sleep(1.0)
        logs = "\n".join(f"--- {pod}:\n{pods.logs(cid)}" for pod, (cid, _, _) in waiting.items())
        assert not waiting, f"not ready after {SMOKE_READY_S:g}s: {sorted(waiting)}\n{logs}"
    finally:
        pods.close()
