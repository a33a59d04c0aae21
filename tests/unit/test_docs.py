"""The docs stay true: every path the design page's layout names exists (or is marked planned),
and no project file points at notes users do not have."""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
# A path-like word: a folder ("sampler/", "bus/") or a file with an extension ("server.py").
PATH_WORD = re.compile(r"^[\w.{},*-]+(/[\w.{},*-]*)*$")


def _layout_lines() -> list[str]:
    text = DESIGN.read_text()
    section = text.split("## Layout", 1)[1]
    block = section.split("```", 2)[1]
    return [line for line in block.splitlines()[1:] if line.strip()]


def _expand(word: str) -> list[str]:
    """``a/{b,c}/d`` -> ``a/b/d``, ``a/c/d``."""
    match = re.search(r"\{([^}]*)\}", word)
    if not match:
        return [word]
    head, tail = word[: match.start()], word[match.end() :]
    return list(
        itertools.chain.from_iterable(_expand(head + part + tail) for part in match[1].split(","))
    )


def _named_paths(line: str) -> list[str]:
    """The line's own path (first word) and the files or folders its description names,
    relative to it. Nothing after "(planned" is checked; a description that starts with it
    marks the whole entry as planned."""
    first, _, rest = line.strip().partition(" ")
    if rest.strip().startswith("(planned"):
        return []
    rest = rest.split("(planned", 1)[0]
    base = first if first.endswith("/") else ""
    paths = _expand(first)
    for word in re.findall(r"[\w./{},*-]+", rest):
        word = word.strip(",.")
        if PATH_WORD.match(word) and (word.endswith("/") or re.search(r"\.\w+$", word)):
            paths.extend(base + p for p in _expand(word))
    return paths


def test_every_path_in_the_design_layout_exists() -> None:
    missing = []
    for line in _layout_lines():
        for path in _named_paths(line):
            if not list(ROOT.glob(path.rstrip("/"))):
                missing.append(f"{path}  (from: {line.strip()})")
    assert not missing, "docs/design.md names paths that do not exist:\n" + "\n".join(missing)


def test_the_layout_check_sees_paths() -> None:
    names = [p for line in _layout_lines() for p in _named_paths(line)]
    assert "services/server.py" in names and "learner/algos/losses/" in names
    assert _named_paths("gateway/   (planned) app.py") == []
    assert _named_paths("sdk/  typescript/ (planned: cpp/)") == ["sdk/", "sdk/typescript/"]


def test_no_file_cites_notes_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = [
        name
        for name in tracked
        if not name.startswith("tests/unit/test_docs.py")
        and (ROOT / name).is_file()
        and re.search(
            r"PLATFORM\.md|DESIGN\.md|\.\./shared/", (ROOT / name).read_text(errors="ignore")
        )
    ]
    assert not offenders, f"files citing notes users do not have: {offenders}"
