"""Environments that ship with rlfleet, registered as gymnasium ids on import.

env_server.registry imports this package with the third-party gymnasium plugins
(GYMNASIUM_PLUGIN_MODULES), so these ids are listed by `rlfleet envs` and created by env servers
and `rlfleet play` like any other gymnasium id. The Atari ids (env_server/envs/atari.py) are
registered only where ale-py is installed (the `atari` extra).
"""

from __future__ import annotations

import importlib.util

import gymnasium

__all__ = ["BUILTIN_IDS"]

# id -> (entry point, kwargs); registered once (a second import, or a test importing the module,
# is fine).
BUILTIN_IDS: dict[str, tuple[str, dict[str, str]]] = {
    "Snake-v0": ("env_server.envs.snake:SnakeEnv", {}),
}
if importlib.util.find_spec("ale_py") is not None:
    from env_server.envs.atari import ATARI_GAMES

    BUILTIN_IDS |= {
        f"Atari{game}-v0": ("env_server.envs.atari:make_atari", {"game": game})
        for game in ATARI_GAMES
    }

for _env_id, (_entry_point, _kwargs) in BUILTIN_IDS.items():
    if _env_id not in gymnasium.registry:
        gymnasium.register(_env_id, entry_point=_entry_point, kwargs=_kwargs)
