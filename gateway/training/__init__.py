"""The gateway's training mode: agent sessions recorded token in, token out, grouped by task and
published to the learner (gateway/training/sessions.py)."""
