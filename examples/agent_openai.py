"""An agent written against the official `openai` client only: it answers arithmetic questions with
a calculator tool, over as many model calls as it needs (examples/agent_openai.yaml trains it).

Under `rlfleet up`, each runner gets OPENAI_BASE_URL and OPENAI_API_KEY in its environment and
loops: start a session (POST /rlfleet/v1/sessions: the task comes with it), let the model call the
tool until it answers, report the session's reward (1 for the right answer). The session id goes
with every call in the X-Rlfleet-Session header, so the gateway records the calls for training.

By hand, against any OpenAI-compatible server (a served rlfleet model, with tools):
    python examples/agent_openai.py --eval 50 --base-url http://127.0.0.1:8000/v1
answers 50 held-out questions of the arith generator and prints the accuracy.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import re
from typing import Any

import openai

SYSTEM = (
    "You are a careful assistant. Use the calculator tool for arithmetic, then give the final "
    "answer as <answer>NUMBER</answer>."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 123 * 456"}},
                "required": ["expression"],
            },
        },
    }
]
MAX_CALLS = 3
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> int:
    """+, - and * of integers, nothing else."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not arithmetic: {expression!r}")

    return value(ast.parse(expression, mode="eval").body)


def question(task: dict[str, Any]) -> str:
    """The arith generator's "Q: 964*494=?\\nA:" as a question: "What is 964 * 494?"."""
    found = re.search(r"Q:\s*(\d+)\s*([-+*])\s*(\d+)\s*=\?", task.get("prompt") or "")
    return f"What is {' '.join(found.groups())}?" if found else str(task.get("prompt"))


def answer_of(text: str) -> int | None:
    tagged = re.findall(r"<answer>\s*(-?\d+)\s*</answer>", text) or re.findall(r"-?\d+", text)
    return int(tagged[-1]) if tagged else None


def solve(client: openai.OpenAI, model: str, ask: str, headers: dict[str, str]) -> str:
    """The model's final answer, after the tool calls it makes."""
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ask},
    ]
    for _ in range(MAX_CALLS):
        reply = (
            client.chat.completions.create(
                model=model,
                messages=messages,
                tools=TOOLS,
                max_tokens=48,
                temperature=1.0,
                extra_headers=headers,
            )
            .choices[0]
            .message
        )
        if not reply.tool_calls:
            return reply.content or ""
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            try:
                expression = json.loads(call.function.arguments)["expression"]
                result: Any = {"result": calculate(expression)}
            except (ValueError, KeyError, TypeError, SyntaxError) as exc:
                result = {"error": str(exc)}
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}
            )
    return ""


def train(client: openai.OpenAI) -> None:
    """Sessions until the run ends (the gateway goes away)."""
    root = client.with_options(base_url=str(client.base_url).rstrip("/").removesuffix("/v1"))
    model = client.models.list().data[0].id
    # Who starts the sessions: after a crash, the restarted runner's sessions replace these.
    me = {"runner": os.environ.get("RLFLEET_AGENT_RUNNER", ""), "incarnation": str(os.getpid())}
    while True:
        try:
            session = root.post("/rlfleet/v1/sessions", cast_to=object, body=me)
        except openai.APIConnectionError:
            return  # the run is over
        except openai.APIStatusError as exc:
            if exc.status_code == 503:
                continue  # no task yet: the learner is behind
            raise
        headers = {"X-Rlfleet-Session": session["session_id"]}
        try:
            said = solve(client, model, question(session["task"]), headers)
        except openai.APIStatusError as exc:
            if exc.status_code != 410:  # 410: the session may call no more (a cap, a timeout)
                raise
            said = ""
        right = answer_of(said) == int(session["task"]["extra"]["answer"])
        try:
            root.post(
                f"/rlfleet/v1/sessions/{session['session_id']}/reward",
                cast_to=object,
                body={"reward": 1.0 if right else 0.0},
            )
        except openai.APIStatusError as exc:
            if exc.status_code != 410:  # dropped meanwhile (its deadline passed)
                raise


def evaluate(client: openai.OpenAI, count: int) -> float:
    """Accuracy on ``count`` held-out questions (the arith generator's eval split)."""
    from common.datasets import iter_tasks, take

    tasks = take(iter_tasks({"generator": "arith", "digits": 3, "ops": ["*"]}, split="eval"), count)
    model = client.models.list().data[0].id
    right = 0
    for task in tasks:
        said = solve(client, model, question({"prompt": task.prompt}), {})
        right += answer_of(said) == int(task.extra["answer"])
    return right / max(len(tasks), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval", type=int, default=0, help="evaluate on this many questions")
    parser.add_argument("--base-url", default=None, help="default: OPENAI_BASE_URL")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url) if args.base_url else openai.OpenAI()
    if args.eval:
        print(f"accuracy {evaluate(client, args.eval):.3f} on {args.eval} held-out questions")
    else:
        train(client)


if __name__ == "__main__":
    main()
