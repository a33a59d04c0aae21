"""The env server's client module: remote environments that look local (`EnvService`).

Other services import only this package (and the types in ``clients.env.types``), never
the server's pool, registry or servicer.

- `EnvSession`: async, one Session stream, numpy in and out (arrays are read-only views over the
  received bytes: no copy on the hot path). `colocate()` moves a session's steps to a
  shared-memory ring when the server is on this host (docs/colocated.md).
- `SyncEnvSession`: the same calls, blocking, on a private event loop (gymnasium's API is sync).
- `RemoteVectorEnv`: a `gymnasium.vector.VectorEnv` over one session; behaves like
  `SyncVectorEnv` step for step (NEXT_STEP by default; SAME_STEP's `final_obs`/`final_info`
  infos by option; list seeds; float64 rewards), so gymnasium's vector wrappers run on it.
  `record_episode_statistics=True` adds the server's episode statistics to infos as per-env
  `RecordEpisodeStatistics` wrappers under SyncVectorEnv do (CleanRL's loops read them);
  `colocated=True` steps through the co-located ring when the server is on this host.
- `RemoteEnv`: a `gymnasium.Env` over a session of one env (autoreset DISABLED, as an Env has);
  passes gymnasium's check_env, `spec` included.
- `list_envs(address)`: what a server offers (`rlfleet envs --server`).
- `env_spaces(address, env_id)`: the spaces of one env, from a session created and closed at
  once (the learner builds its policy from them).

Errors from the server come back as the services.errors class they were raised as
(`InvalidArgument`, `NotFound`, ...), with the field they name; where gymnasium has an exception
for the case, as a subclass of both: `InvalidActionError` (rejected actions; also
gymnasium.error.InvalidAction and ValueError), `ResetNeededError` (step before reset, or past an
episode's end with autoreset DISABLED; gymnasium.error.ResetNeeded), `ClosedEnvError` (a closed
session; gymnasium.error.ClosedEnvironmentError), `UnknownEnvError` (no env of that id;
gymnasium.error.NameNotFound), `InvalidSeedError` (a negative or non-integer seed;
gymnasium.error.Error). `RemoteAttributeError` (an AttributeError) is what
get_attr/call/set_attr raise for what the wire cannot reach.
"""

from clients.env.session import (
    SERVICE_NAME,
    ClosedEnvError,
    EnvSession,
    InvalidActionError,
    InvalidSeedError,
    RemoteAttributeError,
    ResetNeededError,
    SessionInfo,
    SyncEnvSession,
    UnknownEnvError,
    env_spaces,
    list_envs,
)
from clients.env.types import EnvEntry, EpisodeStats, StepResult
from clients.env.vector import RemoteEnv, RemoteVectorEnv

__all__ = [
    "SERVICE_NAME",
    "ClosedEnvError",
    "EnvEntry",
    "EnvSession",
    "EpisodeStats",
    "InvalidActionError",
    "InvalidSeedError",
    "RemoteAttributeError",
    "RemoteEnv",
    "RemoteVectorEnv",
    "ResetNeededError",
    "SessionInfo",
    "StepResult",
    "SyncEnvSession",
    "UnknownEnvError",
    "env_spaces",
    "list_envs",
]
