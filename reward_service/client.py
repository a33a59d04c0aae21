"""Client side of `RewardService`, for samplers and rollout drivers.

    async with RewardClient("127.0.0.1:50051") as rewards:
        results = await rewards.score(
            [{"prompt": p, "completion": c, "completion_ids": ids, "extra": {"answer": "42"}}],
            [("accuracy", 1.0), ("soft_overlong", 0.5, {"max_completion_len": 4096})],
        )
        results[0].total, results[0].scores["accuracy"].score

Call errors come back as the services.errors class the server raised (InvalidArgument naming
the field, ResourceExhausted, Unavailable, ...); per-item failures of one function are in
`FunctionResult.error`, rebuilt the same way (its ``code`` is DEADLINE_EXCEEDED or INTERNAL).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from common import tensor
from rlfleet.reward.v1 import reward_pb2, reward_pb2_grpc
from services.errors import InvalidArgument, RlfleetError, from_rpc_error, from_status
from services.server import DEFAULT_MAX_MESSAGE_BYTES, channel

__all__ = ["FunctionResult", "ItemResult", "RewardClient", "RewardInfo"]

_ITEM_KEYS = {"prompt", "completion", "prompt_ids", "completion_ids", "extra"}
_STATUS = {
    reward_pb2.SCORE_STATUS_OK: "ok",
    reward_pb2.SCORE_STATUS_ABSTAINED: "abstained",
    reward_pb2.SCORE_STATUS_ERROR: "error",
}
_KIND = {
    reward_pb2.REWARD_KIND_RULE: "rule",
    reward_pb2.REWARD_KIND_PLUGIN: "plugin",
    reward_pb2.REWARD_KIND_MODEL: "model",
}


@dataclass(frozen=True)
class FunctionResult:
    """One function's outcome on one item; ``score`` is None unless status is "ok"."""

    name: str
    status: str  # "ok" | "abstained" | "error"
    score: float | None
    error: RlfleetError | None = None


@dataclass(frozen=True)
class ItemResult:
    """Scores of one item: the weighted total (None when no function scored it) and each
    function's result by name, in the order the functions ran."""

    total: float | None
    scores: dict[str, FunctionResult]

    @property
    def complete(self) -> bool:
        """Every function returned a score (a trainer that must not use partial totals checks)."""
        return all(s.status == "ok" for s in self.scores.values())


@dataclass(frozen=True)
class RewardInfo:
    """One entry of ListRewards."""

    name: str
    kind: str  # "rule" | "plugin" | "model"
    description: str
    extra_keys: tuple[str, ...]
    default_timeout_s: float
    default_weight: float | None


def _ids(value: Any, field: str) -> Any:
    array = np.asarray(value)
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise InvalidArgument(f"{field}: expected a 1-D sequence of ints", field=field)
    return tensor.encode(array.astype(np.int32, copy=False))


def _item(i: int, item: Mapping[str, Any]) -> reward_pb2.ScoreItem:
    unknown = set(item) - _ITEM_KEYS
    if unknown:
        keys = ", ".join(sorted(unknown))
        raise InvalidArgument(f"items[{i}]: unknown keys {keys} (known: {sorted(_ITEM_KEYS)})")
    out = reward_pb2.ScoreItem(prompt=item.get("prompt", ""), completion=item["completion"])
    if item.get("prompt_ids") is not None:
        out.prompt_token_ids.CopyFrom(_ids(item["prompt_ids"], f"items[{i}].prompt_ids"))
    if item.get("completion_ids") is not None:
        out.completion_token_ids.CopyFrom(
            _ids(item["completion_ids"], f"items[{i}].completion_ids")
        )
    if item.get("extra"):
        out.extra.update(dict(item["extra"]))
    return out


def _reward(i: int, spec: Sequence[Any]) -> reward_pb2.RewardWeight:
    """(name, weight[, kwargs[, timeout_s]]) -> RewardWeight."""
    if isinstance(spec, str) or not 2 <= len(spec) <= 4:
        raise InvalidArgument(
            f"rewards[{i}]: expected (name, weight[, kwargs[, timeout_s]]), got {spec!r}"
        )
    name, weight, kwargs, timeout_s = (*spec, None, None)[:4]
    out = reward_pb2.RewardWeight(name=name, weight=float(weight))
    if kwargs:
        out.kwargs.update(dict(kwargs))
    if timeout_s is not None:
        out.timeout.FromNanoseconds(round(float(timeout_s) * 1e9))
    return out


def _item_result(proto: reward_pb2.ItemScore) -> ItemResult:
    scores = {}
    for s in proto.scores:
        status = _STATUS.get(s.status, "error")
        scores[s.name] = FunctionResult(
            name=s.name,
            status=status,
            score=s.score if status == "ok" else None,
            error=from_status(s.error) if s.HasField("error") else None,
        )
    return ItemResult(total=proto.total if proto.HasField("total") else None, scores=scores)


class RewardClient:
    """An async RewardService client over one channel; close it (or use ``async with``)."""

    def __init__(self, address: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.address = address
        self._channel = channel(address, max_message_bytes=max_message_bytes)
        self._stub = reward_pb2_grpc.RewardServiceStub(self._channel)

    async def __aenter__(self) -> RewardClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def score(
        self,
        items: Sequence[Mapping[str, Any]],
        rewards: Sequence[Sequence[Any]] | None = None,
        timeout_s: float = 120.0,
    ) -> list[ItemResult]:
        """Score ``items`` (dicts: completion, and optionally prompt, prompt_ids,
        completion_ids, extra) with ``rewards`` ((name, weight[, kwargs[, timeout_s]]); None:
        the server's default set). One result per item, in order."""
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s}")
        request = reward_pb2.ScoreRequest(
            items=[_item(i, item) for i, item in enumerate(items)],
            rewards=[_reward(i, spec) for i, spec in enumerate(rewards or ())],
        )
        try:
            response = await self._stub.Score(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return [_item_result(r) for r in response.results]

    async def list_rewards(self, timeout_s: float = 30.0) -> list[RewardInfo]:
        """Every reward the server runs, sorted by name."""
        try:
            response = await self._stub.ListRewards(
                reward_pb2.ListRewardsRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return [
            RewardInfo(
                name=r.name,
                kind=_KIND.get(r.kind, "unspecified"),
                description=r.description,
                extra_keys=tuple(r.extra_keys),
                default_timeout_s=r.default_timeout.ToNanoseconds() / 1e9,
                default_weight=r.default_weight if r.HasField("default_weight") else None,
            )
            for r in response.rewards
        ]
