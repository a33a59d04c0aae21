# Shared fixtures live in tests/fixtures/; list each module here so every test directory sees them.
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest_plugins = ["tests.fixtures.nats", "tests.fixtures.models", "tests.fixtures.lm"]

_COMPILE_CACHES = {"VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


@pytest.fixture(scope="session", autouse=True)
def _session_compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One vLLM/inductor compile cache for the whole session, in its temp folder: samplers the
    tests start (in process, or through `rlfleet up`, whose services inherit the environment)
    reuse each other's kernels instead of each compiling them, and nothing is written to the
    user's shared cache (sampler `compile_cache: shared`, ~/.cache/rlfleet/compile). Either
    variable exported already wins (point it at a lasting folder to keep the kernels across
    sessions). TMPDIR too (samplers put inductor's precompiled header there): one short folder
    of the session's, so the header is built once per session, not in the user's cache."""
    root = tmp_path_factory.mktemp("compile-cache")
    added = [name for name in (*_COMPILE_CACHES, "TMPDIR") if name not in os.environ]
    for name in added:
        os.environ[name] = str(root / _COMPILE_CACHES.get(name, "tmp"))
    (root / "tmp").mkdir()
    yield
    for name in added:
        os.environ.pop(name, None)
