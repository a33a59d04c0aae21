"""The env server's client module: remote environments that look local (`EnvService`).

Other services import only this package (and the types in ``env_server.client.types``), never
the server's pool, registry or servicer.

- `EnvSession`: async, one Session stream, numpy in and out (arrays are read-only views over the
  received bytes: no copy on the hot path).
- `SyncEnvSession`: the same calls, blocking, on a private event loop (gymnasium's API is sync).
- `RemoteVectorEnv`: a `gymnasium.vector.VectorEnv` over one session; behaves like
  `SyncVectorEnv` step for step, including SAME_STEP's `final_obs`/`final_info` infos.
- `RemoteEnv`: a `gymnasium.Env` over a session of one env (autoreset DISABLED, as an Env has).
- `list_envs(address)`: what a server offers (`rlfleet envs --server`).

Errors from the server come back as the services.errors class they were raised as
(`InvalidArgument`, `NotFound`, ...), with the field they name.
"""

from env_server.client.session import EnvSession, SessionInfo, SyncEnvSession, list_envs
from env_server.client.types import EnvEntry, EpisodeStats, StepResult
from env_server.client.vector import RemoteEnv, RemoteVectorEnv

__all__ = [
    "EnvEntry",
    "EnvSession",
    "EpisodeStats",
    "RemoteEnv",
    "RemoteVectorEnv",
    "SessionInfo",
    "StepResult",
    "SyncEnvSession",
    "list_envs",
]
