"""Where rlfleet keeps what outlives a run on this machine (JIT-built DeepSpeed ops, compile
caches): ``$RLFLEET_CACHE_DIR``, else ``$XDG_CACHE_HOME/rlfleet``, else ``~/.cache/rlfleet``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["user_cache_dir"]


def user_cache_dir() -> Path:
    """The machine-wide rlfleet cache folder (not created here)."""
    if os.environ.get("RLFLEET_CACHE_DIR"):
        return Path(os.environ["RLFLEET_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "rlfleet"
