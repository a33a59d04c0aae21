"""rlfleet learner: optimisation, algorithms (``learner.algos``), checkpoints, weight versions."""
