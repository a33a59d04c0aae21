"""What `rlfleet up` prints once a gateway is healthy: the OpenAI base URL and the key's source."""

from __future__ import annotations

from pathlib import Path

from gateway.service import SPEC, announce
from gateway.settings import GatewaySettings
from services.config import load_run_config

ROOT = Path(__file__).resolve().parents[2]


def _settings(**kwargs: object) -> GatewaySettings:
    return GatewaySettings.model_validate({"samplers": ["sampler-0"], **kwargs})


def test_the_line_names_the_base_url_and_the_key_variable() -> None:
    settings = _settings(http_port=8123, api_keys=[{"key_env": "RLFLEET_API_KEY", "rpm": 60}])
    assert SPEC.announce(settings) == (
        "OpenAI API at http://127.0.0.1:8123/v1 (api key: $RLFLEET_API_KEY)"
    )


def test_wildcard_binds_are_reached_on_loopback() -> None:
    assert "http://127.0.0.1:8000/v1" in announce(_settings(http_host="0.0.0.0"))
    assert "http://[::1]:8000/v1" in announce(_settings(http_host="::"))
    assert "http://10.1.2.3:8000/v1" in announce(_settings(http_host="10.1.2.3"))


def test_inline_keys_and_no_keys_say_so() -> None:
    inline = announce(_settings(api_keys=[{"key": "sk-1"}, {"key_env": "TEAM_KEY"}]))
    assert "api key: api_keys[0].key of the run file or $TEAM_KEY" in inline
    assert "sk-1" not in inline  # the secret itself is never printed
    assert "api key: none needed" in announce(_settings())


def test_port_zero_points_at_the_log() -> None:
    line = announce(_settings(http_port=0))
    assert "http://127.0.0.1:<port>/v1" in line and "gateway's log" in line


def test_the_serve_example_announces_its_url_and_key() -> None:
    config = load_run_config(ROOT / "examples" / "serve.yaml", {"RLFLEET_API_KEY": "sk-x"})
    gateway = config.service("gateway")
    assert SPEC.announce(gateway.settings) == (
        "OpenAI API at http://127.0.0.1:8000/v1 (api key: $RLFLEET_API_KEY)"
    )


def test_the_serve_example_header_passes_the_key() -> None:
    # The header's Python one-liner must send the key the run sets (else "Missing credentials").
    header = (ROOT / "examples" / "serve.yaml").read_text().split("\nrun:")[0]
    text = "\n".join(line.removeprefix("#") for line in header.splitlines())
    start = text.index('python -c "') + len('python -c "')
    code = text[start : text.index('"', start)]
    assert "api_key=os.environ['RLFLEET_API_KEY']" in code, code
    compile(code, "serve.yaml header", "exec")  # copied as it stands, it runs
