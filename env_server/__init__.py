"""env_server: pools of environments served over `rlfleet.env.v1.EnvService`.

- registry.py: which env ids exist (gymnasium ids and `rlfleet.envs` plugins) and how to make one;
- pool.py: N environments of one session stepped in lock step;
- servicer.py: the gRPC EnvService (one pool per Session stream);
- service.py: the `env_server` service kind (`rlfleet serve env_server`);
- game_link/: GameLinkService, for games that own their loop (docs/game_link.md).

Its clients (EnvSession, RemoteVectorEnv, the GameLink SDK) live in `clients.env` and
`clients.game_link`.
- play.py, commands.py: `rlfleet play` and `rlfleet envs`.
"""
