"""End to end: a training-mode run through ``rlfleet up`` trains an agent program that speaks the
OpenAI API, and the ledger stays exact while its runners misbehave.

The run file is examples/agent_openai.yaml's shape on its tiny model and the arithmetic prompts
(the gateway in training mode in front of a vLLM sampler, two runner processes of an agent
script, the learner). The script is examples/agent_openai.py's loop with three faults: runner 0
SIGKILLs itself mid-session (after its calls, before the reward) the first time it runs, runner
1 leaves one session without a reward (it is dropped at the session timeout) and posts another
session's reward twice (the second is a 409). The run must finish every update; no group is
applied twice; the gateway counts the dropped sessions; the killed runner is restarted.
"""

from __future__ import annotations

import collections
import json
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.fixtures.launch import Up, assert_nothing_left
from tests.fixtures.runs import ledger_entries

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("reward", "learner", "sampler-0", "gateway", "agent-0", "agent-1")
UPDATES = 6
TIMEOUT_S = 8.0  # a session never rewarded is dropped this long after it started

AGENT = """\
import os, pathlib, signal, sys
import openai
sys.path.insert(0, {examples!r})
from agent_openai import answer_of, question, solve

client = openai.OpenAI()
root = client.with_options(base_url=str(client.base_url).rstrip("/").removesuffix("/v1"))
model = client.models.list().data[0].id
runner = os.environ["RLFLEET_AGENT_RUNNER"]
me = {{"runner": runner, "incarnation": str(os.getpid())}}
killed = pathlib.Path(f"killed-{{runner}}")
n = 0
while True:
    try:
        session = root.post("/rlfleet/v1/sessions", cast_to=object, body=me)
    except openai.APIConnectionError:
        break  # the run is over
    except openai.APIStatusError as exc:
        if exc.status_code == 503:
            continue
        raise
    n += 1
    sid = session["session_id"]
    try:
        said = solve(client, model, question(session["task"]), {{"X-Rlfleet-Session": sid}})
    except openai.APIStatusError as exc:
        if exc.status_code != 410:
            raise
        said = ""
    if runner.endswith("0") and n == 2 and not killed.exists():
        killed.write_text(sid)
        os.kill(os.getpid(), signal.SIGKILL)  # mid-session: called, not rewarded
    if runner.endswith("1") and n == 1:  # early: its timeout passes while the run trains
        pathlib.Path("unrewarded").write_text(sid)
        continue  # never rewarded, never given up: the timeout drops it
    right = answer_of(said) == int(session["task"]["extra"]["answer"])
    url = f"/rlfleet/v1/sessions/{{sid}}/reward"
    try:
        root.post(url, cast_to=object, body={{"reward": 1.0 if right else 0.0}})
    except openai.APIStatusError as exc:
        if exc.status_code != 410:
            raise
        continue
    if runner.endswith("1") and n == 3:
        try:
            root.post(url, cast_to=object, body={{"reward": 1.0}})
        except openai.APIStatusError as exc:
            pathlib.Path("twice").write_text(f"{{exc.status_code}} {{sid}}")
"""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="scans /proc"),
]


def gateway_metrics(run_dir: Path) -> dict[str, float]:
    """The gateway's last `agent/...` numbers (counts since the gateway started)."""
    latest: dict[str, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("service") == "gateway":
            latest.update({k: v for k, v in record["values"].items() if k.startswith("agent/")})
    return latest


@pytest.mark.timeout(900)
def test_an_agent_program_trains_through_the_gateway_and_faults_leave_the_ledger_exact(
    tmp_path: Path,
) -> None:
    from common.models import init_model

    # The example's model: a tokenizer trained with Calculator-v0's episodes, so the tool
    # prompt and a few turns fit the tiny model's context.
    model = init_model(
        tmp_path / "model", size="tiny", corpus_size=2_000, env={"env_id": "Calculator-v0"}
    )
    (tmp_path / "agent.py").write_text(AGENT.format(examples=str(REPO / "examples")))
    run_dir = tmp_path / "run"
    config = {
        "run": {"name": f"e2e-agentgw-{uuid.uuid4().hex[:8]}", "dir": str(run_dir)},
        "job": {
            "kind": "grpo",
            "model_path": str(model),
            "dataset": {"generator": "arith", "digits": 1, "seed": 3},
            "agent": {
                "command": ["python", "agent.py"],
                "runners": 2,
                "session_timeout_s": TIMEOUT_S,
                "max_calls_per_session": 2,
            },
            "group_size": 2,
            "groups_per_update": 2,
            "total_updates": UPDATES,
            "max_policy_lag": 4,
            "max_tokens": 16,
            "sft_steps": 0,
            "eval_count": 0,
            "engine": "vllm",
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    up = Up(path, run_dir, services=SERVICES, budget_s=780)
    try:
        assert up.wait() == 0, "the run failed"
        assert "main service learner finished" in up.output
    except BaseException:
        print(up.diagnostics())
        raise
    finally:
        up.stop()
    assert (tmp_path / "killed-agent-0").exists()
    assert "agent-0 crashed" in up.output  # and was restarted: the run went on
    assert (tmp_path / "unrewarded").exists()
    status, _ = (tmp_path / "twice").read_text().split()
    assert status == "409"
    ledger = [e for e in ledger_entries(run_dir) if e["status"] == "applied"]
    counts = collections.Counter(e["id"] for e in ledger)
    assert not [i for i, n in counts.items() if n > 1]  # no group applied twice
    assert max(e["update"] for e in ledger) == UPDATES
    agent = gateway_metrics(run_dir)
    assert agent["agent/sessions_rewarded"] >= UPDATES * 2 * 2, agent
    dropped = {k: v for k, v in agent.items() if k.startswith("agent/sessions_dropped_")}
    assert dropped.get("agent/sessions_dropped_timeout", 0) >= 1, agent  # the unrewarded one
    assert sum(dropped.values()) >= 2, agent  # and the killed runner's
    assert agent["agent/groups_published"] >= UPDATES * 2, agent
    assert_nothing_left(run_dir)
