"""Property-based fuzzing of the gateway's OpenAI routes (/v1/completions, /v1/chat/completions).

Bodies are JSON text built fragment by fragment, so they can hold what a JSON library would not
write: valid requests with one field replaced by an odd value (huge or fractional numbers,
``NaN``, ``Infinity``, numbers that overflow a double, lone surrogates, deep nesting, wrong
types), extra fields, and raw or truncated bodies that are not JSON at all. The property: the
gateway answers every one with a 2xx or an OpenAI-shaped 4xx, never a 5xx (a bug on its side),
and a valid request still gets a valid answer after each one.

The gateway runs in a thread over a fake replica (tests/unit/test_gateway_fakes.py), so this
needs no sampler and runs in seconds; hypothesis is derandomized, so every run tries the same
bodies.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.settings import GatewaySettings
from tests.unit.test_gateway_fakes import FakeReplica, ThreadedGateway

MODEL = "fake-model"
FUZZ = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TRIED: Counter[str] = Counter()  # "<route> <status>" -> count

COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "stream", "stream_options",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs",
    "echo", "best_of", "logit_bias", "user", "ignore_eos", "chat_template_kwargs",
    "continue_final_message", "add_generation_prompt", "response_format", "tools", "suffix",
]  # fmt: skip

# --------------------------------------------------------------------------- JSON fragments

odd_text = st.text(st.characters(codec=None, categories=["Cs", "Lu", "Ll", "Nd", "So", "Cc"]))
plain_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | odd_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(odd_text, inner, max_size=4),
    max_leaves=12,
).map(lambda v: json.dumps(v, ensure_ascii=True))  # lone surrogates become \ud800 escapes
raw_number = st.sampled_from(
    ["1e30", "-1e30", "1e400", "-1e400", "1e-400", "NaN", "Infinity", "-Infinity", "0.5",
     "-0", "4294967296", "2147483648", "-2147483649", "18446744073709551616", "9" * 5000,
     "1" + "0" * 300, "1E+2", "-1"]
)  # fmt: skip
nested = st.integers(1, 3000).map(lambda d: "[" * d + "]" * d) | st.integers(1, 300).map(
    lambda d: '{"a":' * d + "1" + "}" * d
)
surrogate = st.sampled_from(['"\\ud800"', '"a\\udfffb"', '"\\udc00\\ud800"', '["\\ud83d"]'])
fragment = plain_json | raw_number | nested | surrogate | st.sampled_from(['""', "[]", "{}"])


def field_text(value: object) -> str:
    return json.dumps(value, ensure_ascii=True)


@st.composite
def object_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid request with fields replaced, added or removed."""
    route = draw(st.sampled_from(sorted(ROUTES)))
    fields = {k: field_text(v) for k, v in ROUTES[route].items()}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        fields[name] = draw(fragment)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=1)):
        fields.pop(name, None)
    for _ in range(draw(st.integers(0, 1))):
        fields[draw(odd_text)] = draw(fragment)
    if draw(st.booleans()):  # odd values inside a valid message or prompt list
        inner = draw(fragment)
        if route == "/v1/chat/completions":
            fields["messages"] = f'[{{"role": "user", "content": {inner}}}]'
        else:
            fields["prompt"] = f"[{inner}]"
    text = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in fields.items()) + "}"
    return route, text.encode("utf-8", "surrogatepass")


@st.composite
def raw_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """Anything at all: random bytes, a truncated valid body, a non-object JSON value."""
    route = draw(st.sampled_from(sorted(ROUTES)))
    valid = json.dumps(ROUTES[route]).encode()
    body = draw(
        st.binary(max_size=200)
        | st.integers(0, len(valid) - 1).map(lambda n: valid[:n])
        | fragment.map(lambda t: t.encode("utf-8", "surrogatepass"))
    )
    return route, body


# --------------------------------------------------------------------------- the gateway


@pytest.fixture(scope="module")
def gateway() -> Iterator[ThreadedGateway]:
    s = GatewaySettings.model_validate(
        {"samplers": ["fake:1"], "http_port": 0, "health_interval_s": 0.05}
    )
    g = ThreadedGateway(s, [FakeReplica()])
    yield g
    g.close()
    lines = [f"fuzz: {sum(TRIED.values())} odd or malformed bodies tried"]
    lines += [f"  {key}: {n}" for key, n in sorted(TRIED.items())]
    print("\n".join(lines))


@pytest.fixture(scope="module")
def client(gateway: ThreadedGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=30.0) as c:
        yield c


def post(client: httpx.Client, route: str, body: bytes) -> None:
    r = client.post(route, content=body, headers={"content-type": "application/json"})
    TRIED[f"{route} {r.status_code}"] += 1
    assert r.status_code < 500, f"{r.status_code} for {body[:300]!r}: {r.text[:500]}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, r.text
    still_serving(client, route)


def still_serving(client: httpx.Client, route: str) -> None:
    r = client.post(route, json=ROUTES[route])
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice.get("text") or choice["message"]["content"]) == "ab"


@FUZZ
@given(case=object_bodies())
def test_odd_fields_never_5xx(client: httpx.Client, case: tuple[str, bytes]) -> None:
    post(client, *case)


@FUZZ
@given(case=raw_bodies())
def test_raw_bodies_never_5xx(client: httpx.Client, case: tuple[str, bytes]) -> None:
    post(client, *case)
