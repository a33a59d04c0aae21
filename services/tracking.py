"""The run file's ``run.tracking``: experiment trackers the learner logs to beside TensorBoard.

Each tracker is off unless its key is given: ``run: {tracking: {wandb: {project: demo}}}`` (or
``wandb: true`` for its defaults). The learner (the kinds built on learner/loop.py, ``learner``
and ``lm_learner``; ``dpo_learner`` writes TensorBoard alone) logs the TensorBoard scalars to
every tracker that is on, under the same names and steps, with the run's resolved config, and at
the end of the run its final policy as an artifact (learner/tracking.py). Pure pydantic: every
process that reads the run file validates this section, and none of them imports a tracker's
package for it; only ``rlfleet validate``/``rlfleet up`` and the learner check that the package
is installed (``missing_packages``), so an env server's image need not carry one.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from services.settings import Loc, StrictModel

__all__ = [
    "TRACKING_EXTRA",
    "MlflowSettings",
    "TrackingSection",
    "WandbSettings",
    "missing_packages",
]

# The optional dependency set (pyproject.toml) that installs every tracker.
TRACKING_EXTRA = "tracking"

# What W&B refuses in a project or entity name.
_WANDB_NAME = r"^[^/\\#?%:]{1,128}$"


class WandbSettings(StrictModel):
    """Weights & Biases (``wandb.init``): offline by default, so a run never needs the network
    or an account; ``wandb sync <dir>/wandb/offline-run-*`` uploads it later."""

    mode: Literal["offline", "online", "disabled"] = Field(
        default="offline",
        description="wandb.init's mode: offline (write the run locally for `wandb sync`), "
        "online (stream it to the W&B server; needs an API key) or disabled (log nothing)",
    )
    project: str = Field(
        default="rlfleet", pattern=_WANDB_NAME, description="the W&B project the run goes to"
    )
    entity: str | None = Field(
        default=None,
        pattern=_WANDB_NAME,
        description="the W&B user or team that owns the project (none: the API key's default)",
    )
    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="the W&B run's display name (none: the run name)",
    )
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=64, description="W&B tags of the run"
    )
    dir: Path | None = Field(
        default=None,
        description="wandb.init's dir: its files go to <dir>/wandb/ (none: the run directory, "
        "so runs/<name>/wandb/)",
    )
    log_final: bool = Field(
        default=True,
        description="log the final policy (final/) as a `model` artifact at the end of the run; "
        "its files are referenced in place, not copied",
    )


class MlflowSettings(StrictModel):
    """MLflow (``MlflowClient``): a local file store by default, browsable with ``mlflow ui``."""

    tracking_uri: str | None = Field(
        default=None,
        min_length=1,
        description="where runs are recorded: a file: URI, a path, sqlite:///..., or an "
        "http(s):// tracking server (none: file: runs/<name>/mlruns)",
    )
    experiment: str | None = Field(
        default=None,
        min_length=1,
        max_length=500,
        description="the MLflow experiment, made when missing (none: the run name)",
    )
    log_final: bool = Field(
        default=True,
        description="log the final policy (final/) as the run's `final` artifact directory at "
        "the end of the run (a file store copies it)",
    )


def _on_off(value: Any) -> Any:
    """``true`` turns a tracker on with its defaults, ``false`` leaves it off."""
    if value is True:
        return {}
    if value is False:
        return None
    return value


class TrackingSection(StrictModel):
    """``run.tracking``: the trackers the learner logs to; each is off unless given. The field
    names are the tracker kinds of learner/tracking.py's registry."""

    wandb: Annotated[WandbSettings | None, BeforeValidator(_on_off)] = Field(
        default=None,
        description="Weights & Biases: a mapping of its settings, or true for the defaults "
        "(offline, into runs/<name>/wandb/)",
    )
    mlflow: Annotated[MlflowSettings | None, BeforeValidator(_on_off)] = Field(
        default=None,
        description="MLflow: a mapping of its settings, or true for the defaults (a file store "
        "in runs/<name>/mlruns)",
    )

    def enabled(self) -> dict[str, StrictModel]:
        """The settings of every tracker that is on, by kind."""
        return {
            kind: getattr(self, kind) for kind in type(self).model_fields if getattr(self, kind)
        }


# The module each tracker kind imports, and the package that provides it.
_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}


def missing_packages(section: TrackingSection) -> list[tuple[Loc, str]]:
    """``(key path below run.tracking, problem)`` for every tracker that is on but whose package
    this Python cannot import, naming the pip command that installs it."""
    problems: list[tuple[Loc, str]] = []
    for kind in section.enabled():
        module, package = _PACKAGES[kind]
        if importlib.util.find_spec(module) is None:
            problems.append(
                (
                    (kind,),
                    f"{kind} is on but the '{module}' package is not installed: pip install "
                    f"'rlfleet[{TRACKING_EXTRA}]' (or pip install {package})",
                )
            )
    return problems
