"""Language models: the sampler, LM weight sync, GRPO steps and GRPO against TRL, rewards."""
