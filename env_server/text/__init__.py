"""Text environments: multi-turn episodes of chat messages, served by env servers beside tensor
envs over the same `EnvService` contract (docs/text_envs.md).

- `TextEnv`: the interface a user's environment implements (reset / step on messages).
- `BUILTIN_TEXT_ENVS`: Calculator-v0, GuessNumber-v0, Innkeeper-v0, each with an eval split.
- `TextPool`: the server side of one session's text envs (limits, timeouts, outcomes).
- `tool_calls` / `tool_message` / `run_tool`: reading a model's tool calls and answering them.
"""

from env_server.text.base import SPLITS, TextEnv, TextStep, check_split, split_of
from env_server.text.envs import BUILTIN_TEXT_ENVS, calculate
from env_server.text.pool import TextPool
from env_server.text.tools import ToolCall, run_tool, tool_calls, tool_message

__all__ = [
    "BUILTIN_TEXT_ENVS",
    "SPLITS",
    "TextEnv",
    "TextPool",
    "TextStep",
    "ToolCall",
    "calculate",
    "check_split",
    "run_tool",
    "split_of",
    "tool_calls",
    "tool_message",
]
