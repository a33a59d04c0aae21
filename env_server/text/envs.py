"""Built-in text environments, each with a held-out eval split (``split="eval"``).

- ``Calculator-v0``: multi-digit arithmetic with a calculator tool; reward 1 for the right final
  answer. A tiny model cannot multiply 3-digit numbers in its head; it can learn to call the tool.
- ``GuessNumber-v0``: find a secret integer in a range from "higher" / "lower" feedback, within
  the turns a binary search needs; reward 1 when found. Guessing without using the feedback
  rarely finds it in time.
- ``Innkeeper-v0``: a game NPC's dialogue with memory: a traveller tells the innkeeper a fact
  (their name, the nights booked), chats for a few turns, then asks for it back; reward 1 when
  the answer holds the fact.
- ``GymnasiumText-v0``: any gymnasium env with a text rendering (``env_id`` kwarg), see
  env_server/text/gym_text.py.
- ``OpenEnvText-v0``: an environment written for OpenEnv (``env`` kwarg), see
  env_server/text/openenv_text.py.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from env_server.text.base import Message, TextEnv, TextStep, check_split, split_of
from env_server.text.gym_text import GymnasiumText
from env_server.text.openenv_text import OpenEnvText
from env_server.text.tools import MAX_CALLS_PER_TURN, run_tool, tool_calls, tool_message

__all__ = [
    "BUILTIN_TEXT_ENVS",
    "CalculatorEnv",
    "GuessNumberEnv",
    "InnkeeperEnv",
    "answer_of",
    "calculate",
]

_INTEGER = re.compile(r"-?\d+")
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def _draw(split: str, draw: Callable[[], Any]) -> Any:
    """A task of ``split`` drawn with ``draw`` (tasks of the other split are drawn again)."""
    while True:
        task = draw()
        if split_of(task) == split:
            return task


def answer_of(text: str) -> int | None:
    """The answer a reply gives: an ``<answer>N</answer>`` tag, else its last integer."""
    tagged = _ANSWER.findall(text)
    found = tagged or _INTEGER.findall(text)
    return int(found[-1]) if found else None


# --- Calculator-v0 ---------------------------------------------------------------------------

_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_MAX_EXPRESSION_CHARS = 200
_MAX_MAGNITUDE = 10**30  # beyond it a result is refused, so `9**9**9` cannot eat the server


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); ValueError
    naming what is not allowed. Results are bounded: no expression can run for long."""
    if not isinstance(expression, str):
        raise ValueError("expression must be a string")
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value  # type: ignore[return-value]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            operand = value(node.operand)
            return -operand if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
                raise ValueError("exponent or base too large")
            result = _OPERATORS[type(node.op)](left, right)
            if isinstance(result, complex) or abs(result) > _MAX_MAGNITUDE:
                raise ValueError("result out of range")
            return result  # type: ignore[no-any-return]
        raise ValueError(f"not allowed in an arithmetic expression: {ast.dump(node)[:60]}")

    try:
        result = value(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(result, float):
        if not math.isfinite(result):
            raise ValueError("result is not finite")
        if result.is_integer():
            return int(result)
    return result


class CalculatorEnv(TextEnv):
    """Multi-digit arithmetic with a ``calculator`` tool (see the module docstring)."""

    tools: list[dict[str, Any]] = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression exactly.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "expression": {"type": "string", "description": "e.g. 123 * 456"}
                    },
                    "required": ["expression"],
                },
            },
        }
    ]
    SYSTEM = (
        "You are a careful assistant. Use the calculator tool for arithmetic, then give the "
        "final answer as <answer>NUMBER</answer>."
    )
    SYSTEM_WITHOUT_TOOL = "You are a careful assistant. Give the answer as <answer>NUMBER</answer>."

    def __init__(
        self,
        split: str = "train",
        digits: int = 3,
        terms: int = 2,
        max_turns: int = 4,
        tool_timeout_s: float = 5.0,
        tool: bool = True,
    ) -> None:
        """``tool=False`` is the baseline without the tool: one turn, the answer from the head."""
        super().__init__()
        self.split = check_split(split)
        if not 1 <= digits <= 9:
            raise ValueError(f"digits must be 1 to 9, got {digits}")
        if not 2 <= terms <= 4:
            raise ValueError(f"terms must be 2 to 4, got {terms}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if not tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {tool_timeout_s}")
        self.digits, self.terms = digits, terms
        self.max_turns, self.tool_timeout_s = max_turns, tool_timeout_s
        self.tool_functions: dict[str, Callable[..., Any]] = {"calculator": calculate}
        if not tool:
            self.tools, self.tool_functions = [], {}
        self.turns = 0
        self.answer = 0

    def _task(self) -> str:
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        numbers = [self.rng.randint(low, high) for _ in range(self.terms)]
        ops = [self.rng.choice("+-*") for _ in range(self.terms - 1)]
        if "*" not in ops:  # at least one product: what a tiny model cannot do in its head
            ops[self.rng.randrange(len(ops))] = "*"
        return " ".join(
            str(part) for pair in zip(numbers, [*ops, ""], strict=True) for part in pair
        ).strip()

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        self.task = task = _draw(self.split, self._task)
        self.answer = int(calculate(task))
        self.turns = 0
        system = self.SYSTEM if self.tools else self.SYSTEM_WITHOUT_TOOL
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"What is {task}?"},
        ]
        return messages, {"task": task, "answer": self.answer}

    def step(self, message: Message) -> TextStep:
        self.turns += 1
        calls = tool_calls(message) if self.tools else []
        if calls:
            replies = [self._answer(call, i) for i, call in enumerate(calls)]
            truncated = self.turns >= self.max_turns
            info: dict[str, Any] = {"tool_calls": len(calls)}
            if truncated:
                info["outcome"] = "max_turns"
            return replies, 0.0, False, truncated, info
        given = answer_of(message.get("content") or "")
        correct = given == self.answer
        outcome = "correct" if correct else ("no_answer" if given is None else "wrong")
        return [], 1.0 if correct else 0.0, True, False, {"outcome": outcome, "given": given}

    def expert_reply(self) -> Message:
        """One calculator call for the whole expression, then the answer it gave."""
        if self.turns == 0 and self.tools:
            call = {"name": "calculator", "arguments": {"expression": self.task}}
            return {
                "role": "assistant",
                "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>",
            }
        return {"role": "assistant", "content": f"<answer>{self.answer}</answer>"}

    def _answer(self, call: Any, index: int) -> Message:
        if index >= MAX_CALLS_PER_TURN:
            return tool_message(call, {"error": f"at most {MAX_CALLS_PER_TURN} calls a turn"})
        if call.error is not None:
            return tool_message(call, {"error": call.error})
        function = self.tool_functions.get(call.name)
        if function is None:
            known = ", ".join(sorted(self.tool_functions))
            return tool_message(call, {"error": f"no tool {call.name!r} (tools: {known})"})
        return tool_message(call, run_tool(function, call.arguments, self.tool_timeout_s))


# --- GuessNumber-v0 --------------------------------------------------------------------------


class GuessNumberEnv(TextEnv):
    """Find a secret integer from "higher" / "lower" feedback (see the module docstring)."""

    def __init__(self, split: str = "train", max_range: int = 200, slack_turns: int = 1) -> None:
        super().__init__()
        self.split = check_split(split)
        if max_range < 8:
            raise ValueError(f"max_range must be >= 8, got {max_range}")
        if slack_turns < 0:
            raise ValueError(f"slack_turns must be >= 0, got {slack_turns}")
        self.max_range, self.slack_turns = max_range, slack_turns
        self.low = self.high = self.secret = 0
        self.lowest = self.highest = 0
        self.turns = self.max_turns = 0

    def _task(self) -> tuple[int, int, int]:
        width = self.rng.randint(8, self.max_range)
        low = self.rng.randint(1, 100)
        high = low + width - 1
        return low, high, self.rng.randint(low, high)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        self.task = _draw(self.split, self._task)
        self.low, self.high, self.secret = self.task
        self.lowest, self.highest = self.low, self.high  # where the secret can still be
        # The turns a binary search needs, plus slack: enough when the feedback is used.
        self.max_turns = math.ceil(math.log2(self.high - self.low + 1)) + self.slack_turns
        self.turns = 0
        messages = [
            {
                "role": "system",
                "content": "Guess the secret integer. Reply with one number each turn; you are "
                "told whether the secret is higher or lower.",
            },
            {
                "role": "user",
                "content": f"I am thinking of an integer from {self.low} to {self.high}. You "
                f"have {self.max_turns} guesses. Your guess?",
            },
        ]
        return messages, {"low": self.low, "high": self.high, "max_turns": self.max_turns}

    def step(self, message: Message) -> TextStep:
        self.turns += 1
        guess = answer_of(message.get("content") or "")
        left = self.max_turns - self.turns
        if guess == self.secret:
            return [], 1.0, True, False, {"outcome": "found", "turns": self.turns}
        if left <= 0:
            return [], 0.0, False, True, {"outcome": "max_turns", "turns": self.turns}
        if guess is None:
            reply = "Please answer with one integer."
        elif not self.low <= guess <= self.high:
            reply = f"{guess} is out of range: the secret is from {self.low} to {self.high}."
        else:
            reply = "Higher." if self.secret > guess else "Lower."
        content = f"{reply} {left} guess{'es' if left > 1 else ''} left."
        if guess is not None and self.low <= guess <= self.high:  # what the feedback narrowed
            self.lowest, self.highest = (
                (max(self.lowest, guess + 1), self.highest)
                if self.secret > guess
                else (self.lowest, min(self.highest, guess - 1))
            )
        return [{"role": "user", "content": content}], 0.0, False, False, {"turns": self.turns}

    def expert_reply(self) -> Message:
        """A binary search: the middle of what the feedback so far leaves."""
        return {"role": "assistant", "content": str((self.lowest + self.highest) // 2)}


# --- Innkeeper-v0 ----------------------------------------------------------------------------

_NAMES = (
    "Aldric", "Brenna", "Cedric", "Dagny", "Elowen", "Fenris", "Gwyn", "Halvard", "Isolde",
    "Joran", "Kestrel", "Liora", "Magnus", "Nerys", "Osric", "Perrin", "Quilla", "Rowan",
    "Sigrid", "Torvald", "Ulla", "Varek", "Wren", "Yselda", "Zoran",
)  # fmt: skip
_SMALL_TALK = (
    "The road from the capital was muddy today.",
    "Is the stew any good here?",
    "I heard wolves on the hills last night.",
    "How long have you kept this inn?",
    "Are there many travellers this season?",
    "The blacksmith down the road seems busy.",
    "Will it rain tomorrow, do you think?",
)


class InnkeeperEnv(TextEnv):
    """An NPC dialogue with memory (see the module docstring)."""

    SYSTEM = "You are the innkeeper of the Crooked Lantern. Answer travellers briefly."

    def __init__(self, split: str = "train", min_chat: int = 1, max_chat: int = 3) -> None:
        super().__init__()
        self.split = check_split(split)
        if not 0 <= min_chat <= max_chat <= len(_SMALL_TALK):
            raise ValueError(
                f"need 0 <= min_chat <= max_chat <= {len(_SMALL_TALK)}, got {min_chat}, {max_chat}"
            )
        self.min_chat, self.max_chat = min_chat, max_chat
        self.chat: list[str] = []
        self.question, self.expected = "", ""

    def _task(self) -> tuple[str, int, str, tuple[str, ...]]:
        name = self.rng.choice(_NAMES)
        nights = self.rng.randint(2, 9)
        asks = self.rng.choice(("name", "nights"))
        chat = tuple(self.rng.sample(_SMALL_TALK, self.rng.randint(self.min_chat, self.max_chat)))
        return name, nights, asks, chat

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        self.task = _draw(self.split, self._task)
        name, nights, asks, chat = self.task
        self.chat = list(chat)
        if asks == "name":
            self.question, self.expected = "Remind me, what name did I give you?", name
        else:
            self.question = "Remind me, how many nights did I book?"
            self.expected = str(nights)
        opening = f"Good evening! I am {name}, and I would like a room for {nights} nights."
        messages = [
            {"role": "system", "content": self.SYSTEM},
            {"role": "user", "content": opening},
        ]
        return messages, {"asks": asks, "chat_turns": len(self.chat)}

    def step(self, message: Message) -> TextStep:
        if self.chat:
            return [{"role": "user", "content": self.chat.pop(0)}], 0.0, False, False, {}
        if self.question:
            question, self.question = self.question, ""
            return [{"role": "user", "content": question}], 0.0, False, False, {}
        words = re.findall(r"[A-Za-z]+|\d+", message.get("content") or "")
        remembered = self.expected in words
        outcome = "remembered" if remembered else "forgot"
        return [], 1.0 if remembered else 0.0, True, False, {"outcome": outcome}

    def expert_reply(self) -> Message:
        """A brief answer to small talk; the fact itself when asked for it."""
        if self.chat or self.question:
            return {"role": "assistant", "content": "Indeed. Welcome to the Crooked Lantern."}
        return {"role": "assistant", "content": self.expected}


BUILTIN_TEXT_ENVS: dict[str, type[TextEnv]] = {
    "Calculator-v0": CalculatorEnv,
    "GuessNumber-v0": GuessNumberEnv,
    "Innkeeper-v0": InnkeeperEnv,
    "GymnasiumText-v0": GymnasiumText,  # kwargs: env_id (a gymnasium id rendering "ansi")
    "OpenEnvText-v0": OpenEnvText,  # kwargs: env (an openenv Environment class by reference)
}
