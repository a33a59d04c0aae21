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


# docs/internals.md names settings instead of restating their values; the few values that are a
# contract stay in it, and these tests keep them equal to the code.
INTERNALS = ROOT / "docs" / "internals.md"


def _internals() -> str:
    return INTERNALS.read_text()


def test_internals_restates_no_default_timeout_or_size() -> None:
    # `grace_s=10.0`, `max_message_bytes=64 << 20`: a default written out drifts from the code.
    restated = re.findall(r"\b\w+_(?:s|bytes|attempts)=\d[\w.<> ]*", _internals())
    assert not restated, f"docs/internals.md restates defaults (write `=...`): {restated}"


def test_internals_exit_codes_match_the_code() -> None:
    from services.errors import EXIT_PERMANENT

    text = _internals()
    assert f"`EXIT_PERMANENT` ({EXIT_PERMANENT}," in text
    assert f"{EXIT_PERMANENT} (`serve` only) permanent failure" in text


def test_internals_weight_chunk_limit_matches_the_code() -> None:
    from common.weights.format import MAX_CHUNK_BYTES

    match = re.search(r"`iter_chunk_bytes`: <= (\d+) MiB", _internals())
    assert match, "docs/internals.md no longer states the chunk limit: drop this test"
    assert int(match[1]) << 20 == MAX_CHUNK_BYTES


def test_internals_run_name_pattern_matches_the_code() -> None:
    from services.bus import subjects

    patterns = set(re.findall(r"\[a-z0-9\]\[a-z0-9-\]\{\d+,\d+\}", _internals()))
    assert patterns == {subjects._RUN_RE.pattern}


def _doc_default(text: str) -> object:
    """A settings table's default cell as a value: `auto`, 0 (off), 10000, 1 GiB."""
    text = text.strip().strip("`")
    if match := re.fullmatch(r"(\d+) GiB", text):
        return int(match[1]) << 30
    if match := re.fullmatch(r"(\d+)( \(off\))?", text):
        return int(match[1])
    return text


def test_colocated_settings_table_matches_the_settings_models() -> None:
    from env_server.service import EnvServerSettings
    from sampler.actors.settings import GameActorSettings

    models = {"env_server": EnvServerSettings, "game_actor": GameActorSettings}
    text = (ROOT / "docs" / "colocated.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| ([^|]+) \|", text, flags=re.M)
    assert len(rows) >= 6, "docs/colocated.md's settings table moved: update this test"
    for kind, key, default in rows:
        assert _doc_default(default) == models[kind].model_fields[key].default, (kind, key)
