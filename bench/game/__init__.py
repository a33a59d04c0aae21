"""Game RL: PPO on CartPole against single-process baselines, the learner update, actors,
finished game runs."""
