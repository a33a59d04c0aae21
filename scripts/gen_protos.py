"""Generate the Python protobuf/gRPC code in `rlfleet/` from `protos/`.

    python scripts/gen_protos.py            # regenerate in place (what `make protos` runs)
    python scripts/gen_protos.py --check    # exit 1 if the committed code is stale

Output is reproducible: the same grpcio-tools version (pinned in pyproject's dev extra) yields
byte-identical files, which is what the staleness check relies on.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import shutil
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
GOOGLEAPIS = PROTO_ROOT / "third_party" / "googleapis"  # vendored google/rpc/*.proto
PACKAGE = "rlfleet"
HEADER = "# Generated from protos/ by scripts/gen_protos.py. Do not edit.\n"


def _include_dirs() -> list[Path]:
    # protos/ alone: the google/rpc files it imports are vendored under
    # protos/third_party/googleapis (the same as googleapis-common-protos ships, whose
    # status_pb2 the generated code imports); grpcio-tools brings the well-known types.
    grpc_tools_protos = Path(str(importlib.resources.files("grpc_tools") / "_proto"))
    return [PROTO_ROOT, GOOGLEAPIS, grpc_tools_protos]


def proto_sources() -> list[str]:
    """Every contract file, as import paths relative to protos/ ("rlfleet/env/v1/env.proto")."""
    sources = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))
    return [s for s in sources if s.startswith(f"{PACKAGE}/")]


def descriptor_set(*, include_source_info: bool = True) -> descriptor_pb2.FileDescriptorSet:
    """Compile every contract into a FileDescriptorSet (with comments when include_source_info).

    Imported files (google/rpc/status.proto, well-known types) are included too; filter on
    `file.name.startswith("rlfleet/")` for the contracts alone.
    """
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "descriptors.binpb"
        args = ["grpc_tools.protoc", *(f"-I{d}" for d in _include_dirs())]
        args += [f"--descriptor_set_out={out}", "--include_imports"]
        if include_source_info:
            args.append("--include_source_info")
        if protoc.main([*args, *proto_sources()]) != 0:
            raise SystemExit("protoc failed")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every proto under protos/rlfleet into out_dir; return the files written."""
    from grpc_tools import protoc

    sources = proto_sources()
    args = ["grpc_tools.protoc", *(f"-I{d}" for d in _include_dirs())]
    args += [f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main([*args, *sources]) != 0:
        raise SystemExit("protoc failed")
    written = []
    for path in sorted((out_dir / PACKAGE).rglob("*.py*")):
        path.write_text(HEADER + path.read_text())
        written.append(path)
    for directory in sorted({p.parent for p in written} | {out_dir / PACKAGE}):
        while directory != out_dir:
            init = directory / "__init__.py"
            if not init.exists():
                init.write_text(HEADER)
            directory = directory.parent
    return written


def _tree(root: Path) -> dict[str, Path]:
    return {
        p.relative_to(root).as_posix(): p
        for p in (root / PACKAGE).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if rlfleet/ is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        generate(fresh_root)
        fresh, current = _tree(fresh_root), _tree(ROOT)
        stale = sorted(
            name
            for name in fresh.keys() | current.keys()
            if name not in fresh
            or name not in current
            or not filecmp.cmp(fresh[name], current[name], shallow=False)
        )
        if args.check:
            if stale:
                fix = "run `python scripts/gen_protos.py` (make protos)"
                print(f"generated code is stale; {fix}:", *stale, sep="\n  ")
                return 1
            print(f"generated code is up to date ({len(fresh)} files)")
            return 0
        shutil.rmtree(ROOT / PACKAGE, ignore_errors=True)
        shutil.copytree(fresh_root / PACKAGE, ROOT / PACKAGE)
        print(f"wrote {len(fresh)} files under {PACKAGE}/ ({len(stale)} changed)")
        return 0


if __name__ == "__main__":
    sys.exit(main())
