"""Request bodies: JSON text to a dict the protocol models may validate.

Python's ``json`` accepts more than the gateway can pass on: nesting as deep as the interpreter's
recursion limit (and a RecursionError past it), ``NaN``, ``Infinity`` and numbers that overflow
to them, integers of thousands of digits, and ``\\ud800`` escapes that decode to lone surrogates,
which no UTF-8 encoder (protobuf's included) takes. ``parse_body`` turns each into a 400 that
names the field it was found under, so no request reaches a route or a sampler with one.
"""

from __future__ import annotations

import json
import math
from typing import Any

from gateway.errors import BadRequest

__all__ = ["INT_RANGE", "parse_body"]

# Any JSON integer the gateway keeps must fit a protobuf int64 or uint64 (and a float).
INT_RANGE = (-(2**63), 2**64 - 1)
_SCALARS = frozenset({int, bool, type(None)})


def parse_body(body: bytes, *, max_depth: int) -> dict[str, Any]:
    """The JSON object in ``body``; BadRequest for anything else."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise BadRequest("the body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    check_tree(data, max_depth=max_depth)
    return data


def check_tree(data: dict[str, Any] | list[Any], *, max_depth: int) -> None:
    """BadRequest for the first thing in a parsed JSON document the gateway cannot carry:
    nesting deeper than ``max_depth``, a string (or key) that is not valid Unicode, a float
    that is not finite, an integer outside ``INT_RANGE``. Walks without recursion."""
    low, high = INT_RANGE
    stack: list[tuple[dict[str, Any] | list[Any], tuple[str | int, ...]]] = [(data, ())]
    while stack:
        node, path = stack.pop()
        if len(path) >= max_depth:
            field = path[:1]  # the request field, not a path as deep as the nesting
            raise BadRequest(
                _at(field, f"nested deeper than {max_depth} levels"), param=_param(field)
            )
        items: Any
        if isinstance(node, dict):
            items = node.items()
        else:
            kinds = set(map(type, node))
            if kinds <= _SCALARS:  # token ids: checked in C, not item by item
                ints: list[int] = node
                if type(None) in kinds:
                    ints = [x for x in node if x is not None]
                if not ints or (min(ints) >= low and max(ints) <= high):
                    continue
            items = enumerate(node)
        for key, value in items:
            if type(key) is str and not _is_unicode(key):
                raise BadRequest(
                    _at(path, "a key is not valid Unicode (a lone surrogate)"),
                    param=_param(path),
                )
            kind = type(value)
            if kind is str:
                if not _is_unicode(value):
                    where = (*path, key)
                    raise BadRequest(
                        _at(where, "not valid Unicode (a lone surrogate)"), param=_param(where)
                    )
            elif kind is float:
                if not math.isfinite(value):
                    where = (*path, key)
                    raise BadRequest(
                        _at(where, f"{value} is not a finite number"), param=_param(where)
                    )
            elif kind is int:
                if not low <= value <= high:
                    where = (*path, key)
                    raise BadRequest(_at(where, "the number is out of range"), param=_param(where))
            elif kind is dict or kind is list:
                stack.append((value, (*path, key)))


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _param(path: tuple[str | int, ...]) -> str | None:
    """("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out or None


def _at(path: tuple[str | int, ...], problem: str) -> str:
    param = _param(path)
    return f"{param}: {problem}" if param else f"the body: {problem}"
