"""The contracts in protos/: generated code is fresh, every element is documented, naming holds.

The documentation checks read the comments protoc records with --include_source_info, so they see
exactly what buf's COMMENTS rules see (scripts/buf_lint.sh runs buf itself where it is installed).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "scripts" / "gen_protos.py"
FDP = descriptor_pb2.FieldDescriptorProto

# Field numbers of the descriptor.proto elements that make up SourceCodeInfo location paths.
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM, MESSAGE_ONEOF = 2, 3, 4, 8
ENUM_VALUE = 2
SERVICE_METHOD = 2


def _load_gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", GEN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def contracts() -> list[descriptor_pb2.FileDescriptorProto]:
    files = _load_gen_protos().descriptor_set(include_source_info=True).file
    ours = [f for f in files if f.name.startswith("rlfleet/")]
    assert len(ours) >= 10, [f.name for f in ours]
    return ours


def _run_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "gen_protos.py"), "--check"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- generated code ---------------------------------------------------------------------------


def test_generated_code_is_not_stale():
    result = _run_check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_fails_when_a_proto_changes(tmp_path):
    # A private copy of the sources and the generated code, so the real tree is never touched.
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copytree(
        ROOT / "rlfleet", tmp_path / "rlfleet", ignore=shutil.ignore_patterns("__pycache__")
    )
    (tmp_path / "scripts").mkdir()
    shutil.copy2(GEN, tmp_path / "scripts" / "gen_protos.py")
    assert _run_check(tmp_path).returncode == 0  # the copy starts fresh

    tensor_proto = tmp_path / "protos" / "rlfleet" / "common" / "v1" / "tensor.proto"
    text = tensor_proto.read_text()
    assert text.count("  bytes data = 3;") == 1
    tensor_proto.write_text(text.replace("  bytes data = 3;", "  bytes payload = 3;"))

    result = _run_check(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rlfleet/common/v1/tensor_pb2.py" in result.stdout
    assert "rlfleet/common/v1/tensor_pb2.pyi" in result.stdout


def test_every_generated_module_imports():
    names = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / "rlfleet").rglob("*_pb2*.py")
    )
    assert len(names) >= 20
    for name in names:
        importlib.import_module(name)


def _floor(requirement: str, dependencies: list[str]) -> tuple[int, ...]:
    for dep in dependencies:
        match = re.fullmatch(rf"{re.escape(requirement)}\s*(?:>=|==)\s*([\d.]+).*", dep)
        if match:
            return tuple(int(x) for x in match.group(1).split("."))
    raise AssertionError(f"{requirement} has no lower bound in pyproject.toml")


def test_pyproject_floors_satisfy_the_generated_code():
    import tomllib

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pb2 = (ROOT / "rlfleet" / "common" / "v1" / "tensor_pb2.py").read_text()
    runtime = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb2)
    assert runtime, "no ValidateProtobufRuntimeVersion call in tensor_pb2.py"
    grpc_gen = re.search(
        r"GRPC_GENERATED_VERSION = '([\d.]+)'",
        (ROOT / "rlfleet" / "env" / "v1" / "env_pb2_grpc.py").read_text(),
    )
    assert grpc_gen
    assert _floor("protobuf", dependencies) >= tuple(int(x) for x in runtime.groups())
    assert _floor("grpcio", dependencies) >= tuple(int(x) for x in grpc_gen.group(1).split("."))


# --- documentation and naming -----------------------------------------------------------------


def _elements(file: descriptor_pb2.FileDescriptorProto):
    """(kind, full name, source path) for every service, rpc, message, field, oneof, enum, value."""

    def enum(e, prefix, path):
        yield "enum", f"{prefix}.{e.name}", path
        for i, v in enumerate(e.value):
            yield "enum value", f"{prefix}.{e.name}.{v.name}", (*path, ENUM_VALUE, i)

    def message(m, prefix, path):
        if m.options.map_entry:  # synthesized for map<K, V> fields; the field carries the comment
            return
        name = f"{prefix}.{m.name}"
        yield "message", name, path
        for i, f in enumerate(m.field):
            yield "field", f"{name}.{f.name}", (*path, MESSAGE_FIELD, i)
        for i, o in enumerate(m.oneof_decl):
            members = [f for f in m.field if f.HasField("oneof_index") and f.oneof_index == i]
            if all(f.proto3_optional for f in members):  # synthetic oneof of a proto3 `optional`
                continue
            yield "oneof", f"{name}.{o.name}", (*path, MESSAGE_ONEOF, i)
        for i, n in enumerate(m.nested_type):
            yield from message(n, name, (*path, MESSAGE_NESTED, i))
        for i, e in enumerate(m.enum_type):
            yield from enum(e, name, (*path, MESSAGE_ENUM, i))

    for i, m in enumerate(file.message_type):
        yield from message(m, file.package, (FILE_MESSAGE, i))
    for i, e in enumerate(file.enum_type):
        yield from enum(e, file.package, (FILE_ENUM, i))
    for i, s in enumerate(file.service):
        name = f"{file.package}.{s.name}"
        yield "service", name, (FILE_SERVICE, i)
        for j, rpc in enumerate(s.method):
            yield "rpc", f"{name}.{rpc.name}", (FILE_SERVICE, i, SERVICE_METHOD, j)


def test_every_element_has_a_leading_comment(contracts):
    missing = []
    checked = 0
    for file in contracts:
        comments = {tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location}
        for kind, name, path in _elements(file):
            checked += 1
            if not comments.get(path, "").strip():
                missing.append(f"{file.name}: {kind} {name}")
    assert checked > 300, checked  # the walk really covered the files
    assert not missing, "elements without a leading comment:\n" + "\n".join(missing)


def test_comment_check_sees_a_missing_comment(tmp_path, contracts):
    # Guard against a walk that silently matches nothing: drop one comment and expect a miss.
    file = next(f for f in contracts if f.name == "rlfleet/common/v1/tensor.proto")
    stripped = descriptor_pb2.FileDescriptorProto()
    stripped.CopyFrom(file)
    target = (FILE_MESSAGE, 0, MESSAGE_FIELD, 2)  # Tensor.data
    for loc in stripped.source_code_info.location:
        if tuple(loc.path) == target:
            loc.leading_comments = ""
    comments = {tuple(x.path): x.leading_comments for x in stripped.source_code_info.location}
    bare = [name for _, name, path in _elements(stripped) if not comments.get(path, "").strip()]
    assert bare == ["rlfleet.common.v1.Tensor.data"]


def _enums(file):
    def walk(messages):
        for m in messages:
            yield from m.enum_type
            yield from walk(m.nested_type)

    yield from file.enum_type
    yield from walk(file.message_type)


def test_enum_zero_values_are_unspecified(contracts):
    enums = [e for f in contracts for e in _enums(f)]
    assert len(enums) >= 7
    for e in enums:
        zero = [v for v in e.value if v.number == 0]
        assert len(zero) == 1 and zero[0].name.endswith("_UNSPECIFIED"), (e.name, zero)
        prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", e.name).upper() + "_"
        assert all(v.name.startswith(prefix) for v in e.value), (e.name, prefix)


def test_packages_match_folders_and_no_repeated_floats(contracts):
    # DESIGN: packages rlfleet.<domain>.v1 in matching folders; tensors are never `repeated float`.
    for file in contracts:
        assert file.syntax == "proto3", file.name
        assert file.name.rsplit("/", 1)[0] == file.package.replace(".", "/"), file.name
        assert re.fullmatch(r"rlfleet\.[a-z]+\.v1", file.package), file.package

        def walk(messages, file=file):
            for m in messages:
                for f in m.field:
                    repeated_float = f.label == FDP.LABEL_REPEATED and f.type in (
                        FDP.TYPE_FLOAT,
                        FDP.TYPE_DOUBLE,
                    )
                    assert not repeated_float, f"{file.name}: {m.name}.{f.name}"
                walk(m.nested_type)

        walk(file.message_type)


@pytest.mark.skipif(
    not (ROOT / ".buf-tools" / "node_modules" / ".bin" / "buf").exists(),
    reason="buf not installed (run scripts/buf_lint.sh once; it installs it under .buf-tools/)",
)
def test_buf_lint_passes():
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "buf_lint.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
