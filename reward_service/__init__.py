"""The `reward_service` service: batched scoring of completions with named reward functions.

- `rewards/`: built-in rule rewards (pure functions) and the registry that adds plugins from the
  `rlfleet.rewards` entry-point group;
- `models.py`: reward models (Hugging Face sequence classifiers);
- `servicer.py` (+ `validation.py`, `runner.py`): `rlfleet.reward.v1.RewardService`;
"""
