"""What an attacker's probe of run files found: alias bombs that hung `rlfleet validate`, and
impossible values it accepted (inf/nan floats, addresses such as ``999.1.1.1:99999``, certificate
host names with spaces). Each is a ConfigError in one line naming the file, line and key.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.config import StrictModel, load_run_config, settings_from_env
from services.errors import ConfigError
from services.settings import address_problem, host_problem
from services.yaml_loading import MAX_YAML_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES

REPO = Path(__file__).resolve().parents[2]

# 8 levels of 10 aliases each: about 10^8 values from a few hundred bytes.
SEQUENCE_BOMB = "".join(
    f"{chr(97 + i)}: &{chr(97 + i)} [{', '.join([f'*{chr(96 + i)}'] * 10) if i else '0'}]\n"
    for i in range(9)
)
# The same through merge keys: each level merges its parent ten times.
MERGE_BOMB = "m0: &m0 {k: 1}\n" + "".join(
    f"m{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * 10)}], k{i}: 1}}\n" for i in range(1, 9)
)
SERVICES = "services:\n  - name: hb\n    service: heartbeat\n"
HEARTBEAT = "run: {name: r}\n" + SERVICES


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path: Path, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_run_config(path, environ or {})
    return str(info.value)


# --- YAML bounds -------------------------------------------------------------------------------


@pytest.mark.timeout(60)  # the unbounded loader took minutes and gigabytes
@pytest.mark.parametrize("bomb", [SEQUENCE_BOMB, MERGE_BOMB], ids=["aliases", "merge-keys"])
def test_an_alias_bomb_fails_fast_in_one_line(tmp_path: Path, bomb: str) -> None:
    path = write(tmp_path, bomb + HEARTBEAT)
    assert path.stat().st_size < 1000
    started = time.monotonic()
    message = error_of(path)
    assert time.monotonic() - started < 1.0
    assert "\n" not in message
    assert message.startswith(f"{path}:")
    assert f"invalid YAML: more than {MAX_YAML_NODES} values with aliases expanded" in message


def test_a_recursive_alias_and_deep_nesting_are_refused_at_their_line(tmp_path: Path) -> None:
    path = write(tmp_path, HEARTBEAT + "x: &a [1, *a]\n")
    assert error_of(path) == (
        f"{path}:5: invalid YAML: alias *a is inside its own anchor (a recursive structure)"
    )
    depth = MAX_YAML_DEPTH + 1
    path = write(tmp_path, HEARTBEAT + "x: " + "[" * depth + "]" * depth + "\n")
    assert error_of(path).startswith(
        f"{path}:5: invalid YAML: nested deeper than {MAX_YAML_DEPTH} levels"
    )


def test_a_file_over_the_size_limit_is_refused_unparsed(tmp_path: Path) -> None:
    path = write(tmp_path, HEARTBEAT + "#" * MAX_YAML_BYTES + "\n")
    size = path.stat().st_size
    assert error_of(path) == f"{path}: {size} bytes of YAML, over the limit of {MAX_YAML_BYTES}"


def test_many_plain_aliases_within_the_limit_still_load(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        HEARTBEAT
        + "    settings: &d {interval_s: 0.5}\n"
        + "  - {name: hb2, service: heartbeat, settings: *d}\n",
    )
    config = load_run_config(path, {})
    assert [e.settings.interval_s for e in config.services] == [0.5, 0.5]


@pytest.mark.timeout(60)
def test_an_alias_bomb_in_an_env_override_names_the_variable(tmp_path: Path) -> None:
    path = write(tmp_path, HEARTBEAT)
    bomb = "{" + SEQUENCE_BOMB.strip().replace("\n", ", ") + "}"
    message = error_of(path, {"RLFLEET_HEARTBEAT__PEERS": bomb})
    assert message.startswith("RLFLEET_HEARTBEAT__PEERS: value is not valid YAML: ")
    assert f"more than {MAX_YAML_NODES} values" in message


@pytest.mark.timeout(120)
def test_validate_reports_a_bomb_in_one_line_without_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, SEQUENCE_BOMB + HEARTBEAT)
    result = subprocess.run(
        [sys.executable, "-m", "launch.cli", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=REPO,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rlfleet: error: {path}:"), result.stderr


# --- finite floats -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1.0e+400", "-.inf", ".inf", ".nan"])
def test_non_finite_floats_are_refused_at_their_key(tmp_path: Path, value: str) -> None:
    path = write(tmp_path, HEARTBEAT + f"    settings:\n      healthy_after_s: {value}\n")
    assert error_of(path) == (
        f"{path}:6: services[0].settings.healthy_after_s: Input should be a finite number"
    )


def test_non_finite_floats_are_refused_in_job_knobs_and_env_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        run: {name: r}
        job:
          kind: ppo
          env_id: CartPole-v1
          learning_rate: 1.0e+400
        """,
    )
    assert error_of(path) == f"{path}:5: job.learning_rate: Input should be a finite number"
    path = write(tmp_path, HEARTBEAT)
    message = error_of(path, {"RLFLEET_HEARTBEAT__INTERVAL_S": ".nan"})
    assert message == (
        "RLFLEET_HEARTBEAT__INTERVAL_S: services[0].settings.interval_s: "
        "Input should be a finite number"
    )


def test_every_settings_model_refuses_non_finite_floats_nested_too() -> None:
    class Inner(StrictModel):
        weights: list[float] = []
        cap: float | None = None

    class Outer(StrictModel):
        inner: Inner = Inner()
        table: dict[str, float] = {}

    for bad in (
        {"inner": {"weights": [1.0, float("inf")]}},
        {"inner": {"cap": float("nan")}},
        {"table": {"x": float("-inf")}},
    ):
        with pytest.raises(ConfigError, match="Input should be a finite number"):
            settings_from_env(Outer, "outer", bad, {})
    assert settings_from_env(Outer, "outer", {"inner": {"cap": 1e300}}, {}).inner.cap == 1e300


def test_algorithm_preset_overrides_refuse_non_finite_floats() -> None:
    from learner.algos.presets import resolve_preset

    with pytest.raises(ValidationError, match="finite number"):
        resolve_preset("grpo", kl_beta=float("inf"))


# --- addresses and host names ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("999.1.1.1:99999", "'999.1.1.1' is not an IPv4 address"),
        ("10.0.0.1:0", "port '0' of '10.0.0.1:0' is not a number in 1-65535"),
        ("envs:65536", "port '65536'"),
        ("envs:", "port ''"),
        (":50051", "empty host name"),
        ("bad host:50051", "'bad host' is not a valid host name"),
        ("-envs:50051", "'-envs' is not a valid host name"),
        ("::1:50051", "an IPv6 address goes in brackets"),
        ("[nope]:50051", "'nope' in '[nope]:50051' is not an IPv6 address"),
    ],
)
def test_impossible_addresses_are_refused_at_their_key(
    tmp_path: Path, address: str, problem: str
) -> None:
    path = write(tmp_path, HEARTBEAT + f"    settings:\n      peers: [hb, '{address}']\n")
    message = error_of(path)
    assert message.startswith(f"{path}:6: services[0].settings.peers[1]: "), message
    assert problem in message and "\n" not in message


def test_possible_addresses_pass() -> None:
    for address in ("10.0.0.1:50051", "envs:1", "env-0.svc.cluster.local:65535", "[::1]:50051"):
        assert address_problem(address) is None, address


def test_impossible_addresses_are_refused_in_job_knobs_nats_and_placeholders(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path,
        """\
        run: {name: r}
        job:
          kind: a2c
          env_id: CartPole-v1
          env_servers: ['10.0.0.5:50051', '999.1.1.1:99999']
        """,
    )
    assert error_of(path).startswith(
        f"{path}:5: job.env_servers[1]: '999.1.1.1' is not an IPv4 address"
    )
    path = write(tmp_path, "run: {name: r}\nnats: {url: 'nats://u:p@nats:99999'}\n" + SERVICES)
    assert error_of(path) == (
        f"{path}:2: nats.url: port '99999' of 'nats:99999' is not a number in 1-65535"
    )
    path = write(tmp_path, "run: {name: r}\nnats: {url: 'tls://999.0.0.1'}\n" + SERVICES)
    assert error_of(path).startswith(f"{path}:2: nats.url: '999.0.0.1' is not an IPv4 address")
    for url in ("nats://nats", "nats://10.0.0.1:4222", "tls://[::1]:4222", "ws://h:80/path"):
        path = write(tmp_path, f"run: {{name: r}}\nnats: {{url: '{url}'}}\n" + SERVICES)
        assert load_run_config(path, {}).nats.url == url
    path = write(
        tmp_path,
        """\
        run: {name: r}
        services:
          - name: game
            service: process
            settings:
              command: [sh, -c, 'echo {address:999.1.1.1:99999}']
        """,
    )
    assert error_of(path).startswith(
        f"{path}:6: services[0].settings.command[2]: '999.1.1.1' is not an IPv4 address"
    )


@pytest.mark.parametrize(
    ("host", "problem"),
    [
        ("bad host", "'bad host' is not a valid host name"),
        ("", "empty host name"),
        ("a..example.com", "an empty label"),
        ("-a.example.com", "label '-a'"),
        ("x" * 64 + ".example.com", "label 'xxx"),
        ("300.1.1.1", "'300.1.1.1' is not an IPv4 address"),
    ],
)
def test_bad_certificate_host_names_are_refused_at_their_item(
    tmp_path: Path, host: str, problem: str
) -> None:
    path = write(
        tmp_path,
        f"run: {{name: r}}\nsecurity:\n  tls: true\n  hosts:\n    - ok.example.com\n"
        f"    - '{host}'\n" + SERVICES,
    )
    message = error_of(path)
    assert message.startswith(f"{path}:6: security.hosts[1]: "), message
    assert problem in message and "\n" not in message


def test_good_certificate_host_names_pass(tmp_path: Path) -> None:
    hosts = ["10.0.0.7", "fd00::7", "learner.example.com", "*.svc.example.com", "env_0"]
    for host in hosts:
        assert host_problem(host, wildcard=True) is None, host
    path = write(
        tmp_path, f"run: {{name: r}}\nsecurity: {{tls: true, hosts: {hosts}}}\n" + SERVICES
    )
    assert load_run_config(path, {}).security.hosts == hosts
