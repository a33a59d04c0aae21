"""Environments that ship with rlfleet, registered as gymnasium ids on import.

env_server.registry imports this package with the third-party gymnasium plugins
(GYMNASIUM_PLUGIN_MODULES), so these ids are listed by `rlfleet envs` and created by env servers
and `rlfleet play` like any other gymnasium id.
"""

from __future__ import annotations

import gymnasium

__all__ = ["BUILTIN_IDS"]

# id -> entry point; registered once (a second import, or a test importing the module, is fine).
BUILTIN_IDS = {"Snake-v0": "env_server.envs.snake:SnakeEnv"}

for _env_id, _entry_point in BUILTIN_IDS.items():
    if _env_id not in gymnasium.registry:
        gymnasium.register(_env_id, entry_point=_entry_point)
