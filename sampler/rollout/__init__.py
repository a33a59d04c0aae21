"""Rollout drivers for language-model RL: prompts -> SamplerService -> RewardService ->
TrajectoryGroups on the run's trajectory stream (the `rollout` service kind)."""
