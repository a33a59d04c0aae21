"""Checkpoints load with torch.load(weights_only=True) and an allowlist (learner/safe_load.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from learner.safe_load import safe_load, verify_checkpoint
from services.errors import ConfigError


class Payload:
    def __reduce__(self):  # unpickling would run a shell command
        return (os.system, ("true",))


def test_plain_checkpoints_load(tmp_path: Path) -> None:
    torch.save({"module": {"w": torch.ones(2)}, "rng": np.arange(3)}, tmp_path / "ok.pt")
    assert safe_load(tmp_path / "ok.pt")["rng"].tolist() == [0, 1, 2]
    verify_checkpoint(tmp_path)


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path: Path) -> None:
    torch.save({"module": {}, "x": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(ConfigError) as err:
        safe_load(tmp_path / "evil.pt")
    # One line naming the file and the class: a permanent failure `rlfleet serve` reports as is.
    assert str(err.value) == f"{tmp_path / 'evil.pt'}: refusing to load, it pickles posix.system"
    with pytest.raises(ConfigError, match=r"refusing to load, it pickles posix\.system"):
        verify_checkpoint(tmp_path)


def test_a_file_that_is_no_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    import pickle

    (tmp_path / "odd.pt").write_bytes(pickle.dumps(Payload(), protocol=2))  # no torch archive
    with pytest.raises(ConfigError, match=r"odd\.pt: refusing to load, not loadable") as err:
        safe_load(tmp_path / "odd.pt")
    assert "\n" not in str(err.value)
