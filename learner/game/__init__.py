"""The game workload of the learner (PPO, A2C, APPO over rollout fragments from game actors):
its job kinds, settings, update, workload and the `learner` service kind."""
