"""Names in a run directory that the services, the launcher and the studio all rely on (one
declaration each; what writes and reads each file documents its content)."""

from __future__ import annotations

__all__ = [
    "CHECKPOINTS_DIR",
    "EVAL_SAMPLES_FILE",
    "FINAL_DIR",
    "LEARNER_DIR",
    "RUN_CONFIG_FILE",
]

RUN_CONFIG_FILE = "config.yaml"  # the launcher's copy of the run file
CHECKPOINTS_DIR = "checkpoints"  # the learner's DeepSpeed checkpoints
FINAL_DIR = "final"  # what a finished (or stopped game) run leaves to play or export
LEARNER_DIR = "learner"  # the learner's ledger, state and records
EVAL_SAMPLES_FILE = "eval_samples.jsonl"  # under LEARNER_DIR: an LM run's evaluation answers
