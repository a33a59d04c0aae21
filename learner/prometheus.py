"""The learners' training metrics as Prometheus gauges, on the ``/metrics`` endpoint every service
serves (services/telemetry.py): in containers and Kubernetes there is no metrics.jsonl console
and TensorBoard files sit on a volume, so Prometheus (and the Grafana dashboard and alert rules
in deploy/) reads the curves here.

`EXPORTED` is the one mapping from a metric key (as metrics.jsonl and TensorBoard name it) to
its Prometheus gauge; keys of different learners that mean the same thing (the DPO trainer's
plain ``loss``, the LM learner's ``charts/entropy``) share one gauge. Every gauge carries the
run's name as label ``run``. Non-finite values are not exported (TensorBoard skips them too):
a NaN gauge poisons every sum and average a dashboard takes, and the skipped update is counted
in ``rlfleet_learner_nonfinite_updates``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from prometheus_client import Gauge

from services.telemetry import metrics

__all__ = ["EXPORTED", "POLICY_VERSION", "UPDATES", "export_training_metrics"]

# Prometheus name (``rlfleet_`` is prepended) -> (help text, the metric keys it takes).
EXPORTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "learner_episodic_return": (
        "Mean return of the recent episodes (game learner, its episode_window).",
        ("charts/episodic_return",),
    ),
    "learner_episodic_length": (
        "Mean length in steps of the recent episodes (game learner).",
        ("charts/episodic_length",),
    ),
    "learner_env_steps_per_second": (
        "Env steps trained per second since this learner process started (game learner).",
        ("charts/SPS",),
    ),
    "learner_tokens_per_second": (
        "Tokens trained per second since this learner process started (LM and DPO learners).",
        ("charts/train_tokens_per_s", "tokens/s"),
    ),
    "learner_policy_loss": (
        "Policy-gradient term of the last update's loss.",
        ("losses/policy_loss",),
    ),
    "learner_value_loss": (
        "Value-function term of the last update's loss.",
        ("losses/value_loss",),
    ),
    "learner_loss": ("Total loss minimised by the last update.", ("losses/loss", "loss")),
    "learner_entropy": (
        "Mean policy entropy over the last update's samples.",
        ("losses/entropy", "charts/entropy"),
    ),
    "learner_approx_kl": (
        "Approximate KL(old || new) of the last update (k3 estimator).",
        ("losses/approx_kl",),
    ),
    "learner_reference_kl": (
        "KL penalty term against the reference model of the last update (LM learner).",
        ("losses/kl",),
    ),
    "learner_policy_lag": (
        "Mean versions between the policy that sampled the last update's data and the one trained.",
        ("charts/policy_lag",),
    ),
    "learner_reward": (
        "Mean total reward of the last update's completions (LM learner).",
        ("reward/total",),
    ),
    "learner_eval_accuracy": (
        "Held-out greedy accuracy of the last evaluation (LM learner).",
        ("eval/accuracy",),
    ),
    "learner_dpo_reward_accuracy": (
        "Fraction of preference pairs whose chosen answer the policy prefers (DPO learner).",
        ("rewards/accuracies",),
    ),
    "learner_dpo_reward_margin": (
        "Mean implicit reward margin, chosen minus rejected (DPO learner).",
        ("rewards/margins",),
    ),
    "learner_nonfinite_updates": (
        "Updates skipped because their loss or gradients were NaN/inf, since the process started.",
        ("losses/nonfinite_updates",),
    ),
    "learner_update_seconds": (
        "Wall time of the last update's training step.",
        ("charts/update_s",),
    ),
}

UPDATES = metrics.gauge(
    "learner_updates",
    "Updates (DPO: optimizer steps) the run has done, restored ones included.",
    ("run",),
)
POLICY_VERSION = metrics.gauge(
    "learner_policy_version", "Policy version the learner last published.", ("run",)
)

_BY_KEY: dict[str, Gauge] = {
    key: metrics.gauge(name, doc, ("run",))
    for name, (doc, keys) in EXPORTED.items()
    for key in keys
}


def export_training_metrics(
    run: str, scalars: Mapping[str, float], *, updates: int, version: int | None = None
) -> None:
    """Set the gauges of the ``scalars`` whose keys `EXPORTED` maps (the finite ones), and the
    run's update count and policy version (None: no versions, offline DPO)."""
    for key, value in scalars.items():
        gauge = _BY_KEY.get(key)
        if gauge is not None and math.isfinite(value):
            gauge.labels(run).set(value)
    UPDATES.labels(run).set(updates)
    if version is not None:
        POLICY_VERSION.labels(run).set(version)
