"""The producer side of a run's trajectory bus, shared by everything that makes LM training
groups (rollout drivers, the gateway's training mode): the prompt work queue (`prompts`), the
learner's pacing credit (`pacing`) and TrajectoryGroups with their exactly-once ids (`groups`)."""
