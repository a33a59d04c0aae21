"""The language-model sampler (kind `sampler`): SamplerService over a generation engine
(sampler/engines) whose weights follow the learner's versions (clients.learner.WeightFollower)."""
