"""Game actors (kind `game_actor`): step remote environments with a policy, publish rollout
fragments and episode statistics on the bus. See docs/internals.md, "Game RL"."""
