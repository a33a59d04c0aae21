"""A text environment's episodes as tokenizer training text (``rlfleet init-model --env``).

A tokenizer trained only on task text splits a chat template's tool preamble and an env's tool
schema into many short tokens: a tool-using episode can then outgrow a small model's context.
Rendering episodes the env's expert plays (or, without an expert, its openings) through the chat
template, with the env's tools, teaches the tokenizer that text. Reached through the
``rlfleet.tokenizer_corpora`` entry point, so ``common.models`` needs no import of the env server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from common.models import chat_text
from env_server.registry import is_reference, make_text_env, register
from env_server.text.base import play_expert
from services.errors import FailedPrecondition

__all__ = ["text_env_corpus"]


def text_env_corpus(
    *, env_id: str, kwargs: dict[str, Any] | None = None, episodes: int = 400, seed: int = 0
) -> Iterator[str]:
    """``episodes`` train-split episodes of ``env_id`` rendered as the model will see them."""
    if is_reference(env_id):  # a TextEnv in a user's file: an id once registered, as a server does
        register(env_id)
    env = make_text_env(env_id, kwargs=kwargs)
    try:
        for index in range(episodes):
            opening, _ = env.reset(seed=seed * 1_000_003 + index)
            try:
                said, _ = play_expert(env)
            except FailedPrecondition:  # no expert: the openings still carry the tool text
                said = []
            yield chat_text([*opening, *said], env.tools)
    finally:
        env.close()
