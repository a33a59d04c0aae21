"""Client side of `RewardService`, for rollout drivers, learners, benchmarks and tests.

    async with RewardClient("127.0.0.1:50051") as rewards:
        results = await rewards.score(
            [{"prompt": p, "completion": c, "completion_ids": ids, "extra": {"answer": "42"}}],
            [("accuracy", 1.0), ("soft_overlong", 0.5, {"max_completion_len": 4096})],
        )
        results[0].total, results[0].scores["accuracy"].score

`score` takes dicts and returns dataclasses; `score_request` sends a ScoreRequest as it is and
returns the ScoreResponse (the rollout driver copies its FunctionScores into TrajectoryGroups).

Call errors come back as the services.errors class the server raised (InvalidArgument naming
the field, ResourceExhausted, Unavailable, ...), the message prefixed with the service and the
method ("reward service 127.0.0.1:50051: Score: ..."); per-item failures of one function are in
`FunctionResult.error`, rebuilt the same way (its ``code`` is DEADLINE_EXCEEDED, INTERNAL, or
UNAVAILABLE for a function the server refuses while earlier calls of it are stuck).

The reward service's client module: other services import it only through this one, and it
imports only the contracts (rlfleet.*), the runtime (services.*) and common.*.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common import tensor
from rlfleet.reward.v1 import reward_pb2, reward_pb2_grpc
from services.calls import rpc
from services.errors import InvalidArgument, RlfleetError, from_status
from services.grpc_names import service_name
from services.membership import Balancer, PeerView
from services.server import DEFAULT_MAX_MESSAGE_BYTES, channel

__all__ = [
    "BATCH_KEYS",
    "SERVICE_NAME",
    "FunctionResult",
    "ItemResult",
    "RewardClient",
    "RewardInfo",
    "RewardPool",
]

SERVICE_NAME = service_name(reward_pb2, "RewardService")  # for health checks
# What every reward function receives, one entry per item; ScoreItem.extra may not use these.
BATCH_KEYS = ("prompts", "completions", "prompt_ids", "completion_ids")

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


def _check_timeout(timeout_s: float) -> float:
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s}")
    return timeout_s


class RewardClient:
    """An async RewardService client over one channel; close it (or use ``async with``).
    ``timeout_s`` is the gRPC deadline of a Score call that does not give its own."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 120.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.address = address
        self.timeout_s = _check_timeout(timeout_s)
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
        timeout_s: float | None = None,
    ) -> list[ItemResult]:
        """Score ``items`` (dicts: completion, and optionally prompt, prompt_ids,
        completion_ids, extra) with ``rewards`` ((name, weight[, kwargs[, timeout_s]]); None:
        the server's default set). One result per item, in order."""
        timeout_s = _check_timeout(self.timeout_s if timeout_s is None else timeout_s)
        request = reward_pb2.ScoreRequest(
            items=[_item(i, item) for i, item in enumerate(items)],
            rewards=[_reward(i, spec) for i, spec in enumerate(rewards or ())],
        )
        response = await self.score_request(request, timeout_s=timeout_s)
        return [_item_result(r) for r in response.results]

    async def score_request(
        self, request: reward_pb2.ScoreRequest, *, timeout_s: float | None = None
    ) -> reward_pb2.ScoreResponse:
        """Send a ready ScoreRequest; the response as it is (one ItemScore per item)."""
        timeout_s = _check_timeout(self.timeout_s if timeout_s is None else timeout_s)
        call = self._stub.Score(request, timeout=timeout_s)
        return await rpc(f"reward service {self.address}: Score", call)

    async def list_rewards(self, timeout_s: float = 30.0) -> list[RewardInfo]:
        """Every reward the server runs, sorted by name."""
        call = self._stub.ListRewards(reward_pb2.ListRewardsRequest(), timeout=timeout_s)
        response = await rpc(f"reward service {self.address}: ListRewards", call)
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


class RewardPool:
    """Score on the reward services ``peers`` names (fixed addresses, or an instance's live
    replicas: services/membership.py), each call on the one with the fewest calls in flight."""

    def __init__(self, peers: PeerView, *, timeout_s: float = 120.0) -> None:
        self.balancer = Balancer(
            peers, lambda a: RewardClient(a, timeout_s=timeout_s), RewardClient.close
        )

    @property
    def addresses(self) -> list[str]:
        return self.balancer.addresses

    async def score_request(
        self, request: reward_pb2.ScoreRequest, *, timeout_s: float | None = None
    ) -> reward_pb2.ScoreResponse:
        """`RewardClient.score_request` on the least busy reward service."""
        async with self.balancer.use() as (_, client):
            return await client.score_request(request, timeout_s=timeout_s)

    async def close(self) -> None:
        await self.balancer.close()
