"""A settings model's knobs, read off the pydantic model: the table ``rlfleet jobs KIND`` prints
and the field tree the studio's new-run form is built from, so both always say the same.

A knob holding a model (``limits``, ``api_keys: [...]``) is followed (table) or holds (tree) that
model's knobs. Names other tools use for a knob (``StrictModel.aliases``: TRL's ``beta``,
CleanRL's ``env_id`` spellings) are attached to the knob they point at, or kept as notes.
"""

from __future__ import annotations

import json
import math
import re
import types
import typing
from pathlib import PurePath
from typing import Any

from pydantic import BaseModel

__all__ = ["knob_fields", "knob_rows", "summary"]

_BOUND_OPS = {
    "ge": ">=",
    "gt": ">",
    "le": "<=",
    "lt": "<",
    "min_length": "len>=",
    "max_length": "len<=",
}


def summary(doc: str | None, first_sentence: bool = True) -> str:
    """A docstring's first paragraph on one line (its first sentence when ``first_sentence``)."""
    text = " ".join((doc or "").strip().split("\n\n")[0].split())
    if first_sentence:
        text = re.split(r"(?<=\.)\s+(?=[A-Z`])", text)[0]
    return text


def knob_rows(model: type[BaseModel], indent: str = "") -> list[dict[str, str]]:
    """One row per knob of ``model`` (knob, type, default, bounds, description); a knob holding
    a model is followed by that model's knobs, indented."""
    rows = []
    for name, info in model.model_fields.items():
        default = (
            "(required)"
            if info.is_required()
            else _yaml_text(info.get_default(call_default_factory=True))
        )
        rows.append({
            "knob": indent + name,
            "type": _type_name(info.annotation),
            "default": default,
            "bounds": ", ".join(f"{op}{v}" for op, v in _bounds(info.metadata).items()),
            "description": info.description or "",
        })  # fmt: skip
        inner = _inner_model(info.annotation)
        if inner is not None:
            rows.extend(knob_rows(inner, indent + "  "))
    return rows


def knob_fields(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s knobs as a JSON-ready tree: ``{"fields": [...], "notes": {alias: text}}``.

    Each field: ``name``; ``type`` (its annotation as ``rlfleet jobs`` prints it); ``input``
    (what a form asks with: bool, int, float, str, choice, list, object, model, models);
    ``choices`` (a Literal's values); ``nullable``; ``required``; ``default`` (JSON, or None
    when required); ``bounds`` ({">=": 1, ...}); ``description``; ``aliases`` (other tools'
    names for it); ``fields`` (a knob holding one model, ``model``, or a list of them,
    ``models``: that model's tree)."""
    aliases = dict(getattr(model, "aliases", {}) or {})
    fields = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        inner = _inner_model(ann)
        default = None if info.is_required() else _json(info.get_default(call_default_factory=True))
        field: dict[str, Any] = {
            "name": name,
            "type": _type_name(ann),
            "input": _input_kind(ann, inner),
            "choices": _choices(ann),
            "nullable": _nullable(ann),
            "required": info.is_required(),
            "default": default,
            "bounds": _bounds(info.metadata),
            "description": info.description or "",
            "aliases": sorted(a for a, target in aliases.items() if target == name),
        }
        if inner is not None:
            field["fields"] = knob_fields(inner)["fields"]
        fields.append(field)
    names = set(model.model_fields)
    notes = {a: text for a, text in sorted(aliases.items()) if text not in names}
    return {"fields": fields, "notes": notes}


# --- reading annotations --------------------------------------------------------------------


def _args(ann: Any) -> list[Any]:
    out = []
    for arg in typing.get_args(ann):
        out.extend([arg, *_args(arg)])
    return out


def _inner_model(ann: Any) -> type[BaseModel] | None:
    """The model a knob holds, alone or in a list/optional (``limits``, ``api_keys``)."""
    nested = [a for a in (ann, *_args(ann)) if isinstance(a, type)]
    return next((a for a in nested if issubclass(a, BaseModel)), None)


def _is_union(ann: Any) -> bool:
    return typing.get_origin(ann) in (typing.Union, types.UnionType)


def _nullable(ann: Any) -> bool:
    return _is_union(ann) and type(None) in typing.get_args(ann)


def _plain(ann: Any) -> Any:
    """``ann`` without ``| None`` (the only other arm of a two-arm optional), and unwrapped
    from ``Annotated``."""
    if typing.get_origin(ann) is typing.Annotated:
        return _plain(typing.get_args(ann)[0])
    if _is_union(ann):
        arms = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(arms) == 1:
            return _plain(arms[0])
    return ann


def _choices(ann: Any) -> list[Any] | None:
    plain = _plain(ann)
    if typing.get_origin(plain) is typing.Literal:
        return [_json(a) for a in typing.get_args(plain)]
    return None


def _input_kind(ann: Any, inner: type[BaseModel] | None) -> str:
    plain = _plain(ann)
    origin = typing.get_origin(plain)
    if inner is not None:
        return "model" if plain is inner else "models" if origin in (list, tuple) else "object"
    if origin is typing.Literal:
        return "choice"
    if origin in (list, tuple, set, frozenset):
        return "list"
    if origin is dict or plain is dict:
        return "object"
    if plain is bool:
        return "bool"
    if plain is int:
        return "int"
    if plain is float:
        return "float"
    if plain is str or (isinstance(plain, type) and issubclass(plain, PurePath)):
        return "str"
    return "any"  # a union of several kinds: written as YAML


def _type_name(ann: Any) -> str:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if ann is type(None):
        return "null"
    return getattr(ann, "__name__", str(ann).replace("typing.", ""))


def _bounds(metadata: Any) -> dict[str, Any]:
    """``{">=": 1, "<=": 1024}`` from a field's annotated-types constraints."""
    out = {}
    for item in metadata:
        for attr, op in _BOUND_OPS.items():
            bound = getattr(item, attr, None)
            if bound is not None:
                out[op] = bound
    return out


def _json(value: Any) -> Any:
    """A default as JSON data: models as dicts, paths as strings, non-finite floats as None."""
    if isinstance(value, BaseModel):
        return _json(value.model_dump())
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)  # paths, enums


def _yaml_text(value: Any, limit: int = 30) -> str:
    """A default as it would be written in YAML (flow style), cut at ``limit`` characters."""
    if isinstance(value, BaseModel):
        return "{...}"  # its fields follow, indented
    v = _json(value)
    text = v if isinstance(v, str) else json.dumps(v).replace('"', "")
    return text if len(text) <= limit else text[: limit - 3] + "..."
