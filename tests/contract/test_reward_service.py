"""RewardService against a real reward_service (service.serve) on a loopback socket.

The server runs in this process, on the test loop, with the test plugins of
tests/plugins/rewards_plugin.py added as entry points (nothing installed). The reward-model test
builds a tiny Qwen2 classifier and a character-level tokenizer in a temporary folder and serves
it through the real from_pretrained path; it has its own server, so the other tests do not pay
for importing transformers. The plugins that try to take the server down (SystemExit, blocking
calls, ...) have a server of their own too, with a small worker pool.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from importlib.metadata import EntryPoint
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from clients.reward import SERVICE_NAME, RewardClient
from reward_service.service import RewardSettings, serve
from reward_service.settings import RewardModelSettings
from rlfleet.reward.v1 import reward_pb2, reward_pb2_grpc
from services.errors import InvalidArgument, ResourceExhausted
from services.ports import free_port
from services.registry import ServiceContext
from services.server import channel

PLUGINS = {
    "ratio": "length_ratio",
    "flaky": "raise_on_bad",
    "nan": "nan_reward",
    "short": "short_list",
    "slow": "slow",
    "echo": "async_echo",
}
BUILTIN_NAMES = ["accuracy", "cosine", "format", "repetition", "soft_overlong"]
GOOD = "<think>6 times 7</think><answer>42</answer>"
WRONG = "<think>guess</think><answer>41</answer>"


async def start(settings: RewardSettings, **kwargs) -> tuple[str, ServiceContext, asyncio.Task]:
    ctx = ServiceContext(name="reward-contract", kind="reward_service", settings=settings)
    ctx.port = free_port()
    serving = asyncio.create_task(serve(ctx, entry_points=[], **kwargs))
    address = f"127.0.0.1:{ctx.port}"
    async with channel(address) as ch:  # wait until it answers
        await reward_pb2_grpc.RewardServiceStub(ch).ListRewards(
            reward_pb2.ListRewardsRequest(), wait_for_ready=True, timeout=60
        )
    return address, ctx, serving


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client() -> AsyncIterator[RewardClient]:
    settings = RewardSettings(
        rewards={"accuracy": 1.0, "format": 0.5},
        reward_kwargs={"soft_overlong": {"max_completion_len": 10, "cache_len": 4}},
        timeouts={"slow": 0.3},
        max_items_per_request=8,
        max_concurrent_requests=2,
    )
    extra = [
        EntryPoint(name, f"tests.plugins.rewards_plugin:{attr}", "rlfleet.rewards")
        for name, attr in PLUGINS.items()
    ]
    address, ctx, serving = await start(settings, extra_entry_points=extra)
    async with RewardClient(address) as c:
        yield c
    ctx.stop_event.set()
    await asyncio.wait_for(serving, 30)


async def test_scores_with_weights_per_function(client: RewardClient) -> None:
    items = [
        {
            "prompt": "6*7?",
            "completion": GOOD,
            "completion_ids": list(range(5)),
            "extra": {"answer": "42"},
        },
        {
            "prompt": "6*7?",
            "completion": WRONG,
            "completion_ids": list(range(8)),
            "extra": {"answer": 42},
        },
        {"prompt": "hi", "completion": "no tags at all", "completion_ids": list(range(12))},
    ]
    rewards = [("accuracy", 1.0), ("format", 0.5), ("soft_overlong", 2.0, {"cache_len": 2})]
    results = await client.score(items, rewards)
    good, wrong, untagged = results
    assert list(good.scores) == ["accuracy", "format", "soft_overlong"]
    assert good.scores["accuracy"].score == 1.0 and good.scores["format"].score == 1.0
    assert good.scores["soft_overlong"].score == 0.0
    assert good.total == pytest.approx(1.5) and good.complete
    # 8 tokens, L_max 10 (server default kwargs), L_cache 2 (request): the last unpunished length.
    assert wrong.scores["accuracy"].score == 0.0
    assert wrong.total == pytest.approx(0.5)
    assert untagged.scores["accuracy"].status == "abstained"
    assert untagged.scores["accuracy"].score is None and not untagged.complete
    assert untagged.scores["soft_overlong"].score == -1.0  # 12 tokens > L_max 10
    assert untagged.total == pytest.approx(0.5 * 0.0 + 2.0 * -1.0)


async def test_response_reports_what_ran(client: RewardClient) -> None:
    """Request order, applied weights and timeouts, merged kwargs; the default set when empty."""
    async with channel(client.address) as ch:
        stub = reward_pb2_grpc.RewardServiceStub(ch)
        request = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(completion=GOOD)])
        rw = request.rewards.add(name="soft_overlong", weight=0.25)
        rw.timeout.FromMilliseconds(1500)
        request.rewards.add(name="format", weight=0.0)  # computed, not counted
        response = await stub.Score(request, timeout=60)  # longer than any budget: no cut
        defaults = await stub.Score(
            reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(completion=GOOD)]), timeout=10
        )
    first, second = response.rewards
    assert (first.name, first.weight, first.timeout.ToMilliseconds()) == (
        "soft_overlong",
        0.25,
        1500,
    )
    assert dict(first.kwargs) == {"max_completion_len": 10, "cache_len": 4}
    assert second.name == "format" and second.timeout.ToMilliseconds() == 10_000
    result = response.results[0]
    assert result.scores[0].status == reward_pb2.SCORE_STATUS_ABSTAINED  # no token ids
    assert result.scores[1].score == 1.0
    assert result.total == 0.0  # format is OK with weight 0
    assert [(r.name, r.weight) for r in defaults.rewards] == [("accuracy", 1.0), ("format", 0.5)]
    assert defaults.results[0].total == 0.5  # format's 1.0 at its default weight 0.5
    assert defaults.results[0].scores[0].status == reward_pb2.SCORE_STATUS_ABSTAINED


async def test_total_is_unset_when_no_function_scored(client: RewardClient) -> None:
    [result] = await client.score([{"completion": "x"}], [("accuracy", 1.0), ("ratio", 1.0)])
    assert result.total is None
    assert {s.status for s in result.scores.values()} == {"abstained"}


async def test_score_request_returns_the_response_as_it_is(client: RewardClient) -> None:
    """What the rollout driver sends: a ready ScoreRequest, the ScoreResponse back."""
    request = reward_pb2.ScoreRequest(
        items=[reward_pb2.ScoreItem(completion=GOOD, extra={"answer": "42"})],
        rewards=[reward_pb2.RewardWeight(name="accuracy", weight=2.0)],
    )
    response = await client.score_request(request)
    assert isinstance(response, reward_pb2.ScoreResponse)
    [item] = response.results
    assert item.total == 2.0 and [s.name for s in item.scores] == ["accuracy"]
    [as_dicts] = await client.score(
        [{"completion": GOOD, "extra": {"answer": "42"}}], [("accuracy", 2.0)]
    )
    assert as_dicts.total == item.total


async def test_timeouts_must_be_positive(client: RewardClient) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        RewardClient(client.address, timeout_s=0)
    with pytest.raises(ValueError, match="timeout_s"):
        await client.score([{"completion": "x"}], timeout_s=math.inf)
    with pytest.raises(ValueError, match="timeout_s"):
        await client.score_request(reward_pb2.ScoreRequest(), timeout_s=-1.0)


async def test_unknown_reward_names_the_field_and_the_known_ones(client: RewardClient) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await client.score([{"completion": GOOD}], [("format", 1.0), ("acuracy", 1.0)])
    assert caught.value.field == "rewards[1].name"
    # The client names the service and method before the server's own words.
    assert caught.value.message.startswith(
        f"reward service {client.address}: Score: "
        "unknown reward 'acuracy' (did you mean 'accuracy'?); known: accuracy, cosine, echo,"
    )
    # The wire carries a google.rpc.BadRequest naming the field, for non-Python clients.
    async with channel(client.address) as ch:
        stub = reward_pb2_grpc.RewardServiceStub(ch)
        request = reward_pb2.ScoreRequest(
            items=[reward_pb2.ScoreItem(completion="x")],
            rewards=[reward_pb2.RewardWeight(name="acuracy")],
        )
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await stub.Score(request, timeout=10)
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(raw.value)
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status.details)
    assert bad.field_violations[0].field == "rewards[0].name"


@pytest.mark.parametrize(
    ("items", "rewards", "field", "message"),
    [
        ([], [("format", 1.0)], "items", "at least one item"),
        ([{"completion": "x"}] * 9, [("format", 1.0)], "items", "max_items_per_request=8"),
        (
            [{"completion": "x"}],
            [("format", 1.0), ("format", 2.0)],
            "rewards[1].name",
            "named twice",
        ),
        ([{"completion": "x"}], [("format", math.nan)], "rewards[0].weight", "must be finite"),
        ([{"completion": "x"}], [("format", math.inf)], "rewards[0].weight", "must be finite"),
        ([{"completion": "x"}], [("format", 1.0, None, -1.0)], "rewards[0].timeout", "negative"),
        (
            [{"completion": "x"}],
            [("format", 1.0, {"size": 3})],
            "rewards[0].kwargs.size",
            "takes no keyword 'size' (takes: pattern, tags)",
        ),
        (
            [{"completion": "x"}],
            [("flaky", 1.0, {"bogus": 1})],
            "rewards[0].kwargs.bogus",
            "takes: scale",
        ),
        (
            [{"completion": "x"}],
            [("format", 1.0, {"pattern": "("})],
            "rewards[0].kwargs",
            "not a valid regex",
        ),
        (
            [{"completion": "x"}],
            [("repetition", 1.0, {"max_penalty": 1})],
            "rewards[0].kwargs",
            "<= 0",
        ),
        (
            [{"completion": "x", "extra": {"prompts": "p"}}],
            [("format", 1.0)],
            "items[0].extra.prompts",
            "reserved",
        ),
        (
            [{"completion": "x"}, {"completion": "y", "extra": {"max_len": 9}}],
            [("cosine", 1.0)],
            "items[1].extra.max_len",
            "is a keyword of reward 'cosine'",
        ),
        (
            [{"completion": "x", "extra": {"scale": 2}}],
            [("flaky", 1.0, {"scale": 3})],
            "rewards[0].kwargs.scale",
            "clashes",
        ),
        ([{"completion": "x"}], [("", 1.0)], "rewards[0].name", "empty"),
    ],
)
async def test_bad_requests_are_invalid_argument(
    client: RewardClient, items: list, rewards: list, field: str, message: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await client.score(items, rewards)
    assert caught.value.field == field
    assert message in caught.value.message


async def test_a_plugin_failing_on_one_item_fails_only_that_item(client: RewardClient) -> None:
    items = [{"completion": "fine"}, {"completion": "bad one"}, {"completion": "also fine"}]
    results = await client.score(items, [("flaky", 1.0, {"scale": 0.5}), ("format", 1.0)])
    assert [r.scores["flaky"].status for r in results] == ["ok", "error", "ok"]
    assert results[0].scores["flaky"].score == 0.5
    error = results[1].scores["flaky"].error
    assert error.code == grpc.StatusCode.INTERNAL
    assert "raised ZeroDivisionError: cannot score 'bad one'" in error.message
    assert all(r.scores["format"].status == "ok" for r in results)  # other functions unaffected
    assert results[1].total == 0.0  # format's 0.0 only


async def test_bad_return_values_are_errors_saying_which(client: RewardClient) -> None:
    items = [{"completion": "a"}, {"completion": "b"}]
    results = await client.score(items, [("nan", 1.0), ("short", 1.0), ("format", 1.0)])
    for r in results:
        assert r.scores["nan"].status == "error"
        assert r.scores["nan"].error.message == "reward 'nan' returned NaN"
        assert "wrong length: 1 scores for 2 items" in r.scores["short"].error.message
        assert r.total == 0.0


async def test_slow_plugin_runs_out_of_budget_alone(client: RewardClient) -> None:
    items = [{"completion": GOOD}, {"completion": "x"}]
    started = time.monotonic()
    results = await client.score(items, [("slow", 1.0, None, 0.2), ("format", 1.0)], timeout_s=10)
    assert time.monotonic() - started < 2.0  # the 5 s sleep was abandoned, not awaited
    for r in results:
        slow = r.scores["slow"]
        assert slow.status == "error" and slow.error.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "0.2s budget" in slow.error.message
        assert r.scores["format"].status == "ok"
    assert results[0].total == 1.0
    # The caller's deadline (1 s) is shorter than the requested budget (5 s): the budget shrinks
    # to fit, and the other functions' scores still arrive.
    started = time.monotonic()
    results = await client.score(items, [("slow", 1.0, None, 5.0), ("format", 1.0)], timeout_s=1)
    assert time.monotonic() - started < 1.0
    assert results[0].scores["slow"].error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert results[0].scores["format"].score == 1.0


async def test_async_plugin_and_trl_kwargs(client: RewardClient) -> None:
    items = [
        {"prompt": "same", "completion": "same", "extra": {"target": 8}},
        {"prompt": "p", "completion": "four", "extra": {"other": "x"}},  # no target: abstain
    ]
    results = await client.score(items, [("echo", 1.0), ("ratio", 2.0)])
    assert results[0].scores["echo"].score == 1.0 and results[1].scores["echo"].score == 0.0
    assert results[0].scores["ratio"].score == 0.5
    assert results[0].total == pytest.approx(2.0)
    assert results[1].scores["ratio"].status == "abstained"


async def test_over_the_concurrency_cap_is_resource_exhausted(client: RewardClient) -> None:
    slow = [("slow", 1.0, None, 0.5)]
    busy = [asyncio.create_task(client.score([{"completion": "x"}], slow)) for _ in range(2)]
    await asyncio.sleep(0.15)
    with pytest.raises(ResourceExhausted, match="max_concurrent_requests=2"):
        await client.score([{"completion": "x"}], [("format", 1.0)])
    for result in await asyncio.gather(*busy):
        assert result[0].scores["slow"].error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    await client.score([{"completion": "x"}], [("format", 1.0)])  # free again


async def test_list_rewards(client: RewardClient) -> None:
    infos = {r.name: r for r in await client.list_rewards()}
    assert list(infos) == sorted([*BUILTIN_NAMES, *PLUGINS])
    accuracy = infos["accuracy"]
    assert (accuracy.kind, accuracy.extra_keys, accuracy.default_weight) == (
        "rule",
        ("answer",),
        1.0,
    )
    assert "math-verify" in accuracy.description
    assert infos["format"].default_weight == 0.5
    assert infos["cosine"].default_weight is None
    assert infos["slow"].kind == "plugin" and infos["slow"].default_timeout_s == 0.3
    assert infos["ratio"].extra_keys == ("target",)
    assert infos["soft_overlong"].default_timeout_s == 10.0


# --------------------------------------------------------------------------- unruly plugins

UNRULY = [
    "exits",
    "interrupts",
    "generator_exit",
    "async_exits",
    "async_interrupts",
    "async_cancels_itself",
    "sleeps",
    "async_sleeps",
    "hangs",
    "async_hangs",
]
BLOCK_S = 3.0  # tests/plugins/rewards_plugin.py:BLOCK_S, how long sleeps and async_sleeps block


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def unruly() -> AsyncIterator[str]:
    settings = RewardSettings(
        worker_threads=8, max_threads_per_function=4, max_stuck_calls=2, max_concurrent_requests=8
    )
    extra = [
        EntryPoint(name, f"tests.plugins.rewards_plugin:{name}", "rlfleet.rewards")
        for name in UNRULY
    ]
    address, ctx, serving = await start(settings, extra_entry_points=extra)
    yield address
    ctx.stop_event.set()
    await asyncio.wait_for(serving, 30)


async def health(address: str) -> int:
    async with channel(address) as ch:
        answer = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5
        )
    return answer.status


@pytest.mark.parametrize(
    ("name", "code", "message"),
    [
        ("exits", grpc.StatusCode.INTERNAL, "reward 'exits' raised SystemExit: 3"),
        ("interrupts", grpc.StatusCode.INTERNAL, "reward 'interrupts' raised KeyboardInterrupt"),
        ("generator_exit", grpc.StatusCode.INTERNAL, "raised GeneratorExit"),
        ("async_exits", grpc.StatusCode.INTERNAL, "reward 'async_exits' raised SystemExit: 4"),
        ("async_interrupts", grpc.StatusCode.INTERNAL, "raised KeyboardInterrupt"),
        ("async_cancels_itself", grpc.StatusCode.INTERNAL, "raised CancelledError: plugin's own"),
        ("sleeps", grpc.StatusCode.DEADLINE_EXCEEDED, "reward 'sleeps' ran out of its 0.3s"),
        ("async_sleeps", grpc.StatusCode.DEADLINE_EXCEEDED, "'async_sleeps' ran out of its 0.3s"),
    ],
)
async def test_a_plugin_cannot_stop_or_stall_the_server(
    unruly: str, name: str, code: grpc.StatusCode, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    items = [{"completion": GOOD}, {"completion": "x"}]
    async with RewardClient(unruly) as first, RewardClient(unruly) as other:
        started = time.monotonic()
        unruly_call = asyncio.create_task(
            first.score(items, [(name, 1.0, None, 0.3), ("format", 1.0)], timeout_s=10)
        )
        await asyncio.sleep(0.1)  # the plugin is running (blocking, for the sleepers) by now
        asked = time.monotonic()
        [answer] = await other.score([{"completion": GOOD}], [("format", 1.0)], timeout_s=10)
        other_latency = time.monotonic() - asked
        results = await unruly_call
        elapsed = time.monotonic() - started
    # Another client is answered at once, not after the plugin's BLOCK_S.
    assert other_latency < BLOCK_S / 6
    assert answer.scores["format"].score == 1.0
    # The call itself answers within its budget, with the plugin's failure in-band.
    assert elapsed < 0.3 + 1.2 < BLOCK_S
    for r in results:
        score = r.scores[name]
        assert score.status == "error" and score.error.code == code
        assert message in score.error.message
        assert r.scores["format"].status == "ok"  # the other function is unaffected
    assert [r.total for r in results] == [1.0, 0.0]
    assert await health(unruly) == health_pb2.HealthCheckResponse.SERVING
    # Logged once, naming the plugin and what it did (the batch and each item raised: 3 calls).
    logged = [
        r for r in caplog.records if r.levelname == "WARNING" and f"reward '{name}'" in r.message
    ]
    assert len(logged) == 1, [r.message for r in logged]
    what = "overran its 0.3s budget" if code == grpc.StatusCode.DEADLINE_EXCEEDED else message
    assert what in logged[0].getMessage()


@pytest.mark.parametrize("name", ["hangs", "async_hangs"])
async def test_a_plugin_that_keeps_hanging_becomes_unavailable_then_recovers(
    unruly: str, name: str
) -> None:
    """Its stuck calls hold at most max_stuck_calls=2 of the 8 workers; after that its items are
    UNAVAILABLE without calling it, until a stuck call returns (each blocks 1.5 s)."""
    rewards = [(name, 1.0, None, 0.2), ("format", 1.0)]
    item = [{"completion": GOOD}]
    async with RewardClient(unruly) as client:
        started = time.monotonic()
        for _ in range(2):
            [r] = await client.score(item, rewards)
            assert r.scores[name].error.code == grpc.StatusCode.DEADLINE_EXCEEDED
        asked = time.monotonic()
        [r] = await client.score(item, rewards)
        assert time.monotonic() - asked < 0.15  # refused at once, not after its 0.2 s budget
        refused = r.scores[name]
        assert refused.status == "error" and refused.error.code == grpc.StatusCode.UNAVAILABLE
        assert f"reward '{name}' is unavailable: 2 earlier calls overran" in refused.error.message
        assert r.scores["format"].score == 1.0 and r.total == 1.0
        assert await health(unruly) == health_pb2.HealthCheckResponse.SERVING
        # Both stuck calls have returned 1.5 s after they started (for the async one, the
        # second never started: it was cancelled as soon as the loop was free).
        await asyncio.sleep(max(0.0, started + 2.0 - time.monotonic()))
        [r] = await client.score(item, [(name, 1.0, None, 5.0)])
        assert r.scores[name].status == "ok" and r.scores[name].score == 1.0


async def test_cancelled_request_abandons_the_plugin_call(unruly: str) -> None:
    """The caller's cancellation is the server's own: it propagates, and the server goes on."""
    async with RewardClient(unruly) as client:
        call = asyncio.create_task(client.score([{"completion": "x"}], [("async_sleeps", 1.0)]))
        await asyncio.sleep(0.2)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        asked = time.monotonic()
        [r] = await client.score([{"completion": GOOD}], [("format", 1.0)])
        assert time.monotonic() - asked < BLOCK_S / 6 and r.total == 1.0
    assert await health(unruly) == health_pb2.HealthCheckResponse.SERVING


# --------------------------------------------------------------------------- reward model


def build_tiny_reward_model(folder: Path) -> None:
    """A 1-layer Qwen2 sequence classifier (hidden 32, one regression output) and a
    character-level tokenizer, saved as a reward model folder."""
    import string

    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForSequenceClassification

    vocab = {"[PAD]": 0, "[UNK]": 1, **{c: i + 2 for i, c in enumerate(string.printable)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]"
    ).save_pretrained(folder)
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(folder)


def reference_scores(folder: Path, texts: list[str]) -> list[float]:
    """Each text alone, unpadded: what batched, padded scoring must reproduce."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.inference_mode():
        return [float(model(**tokenizer(t, return_tensors="pt")).logits[0, 0]) for t in texts]


async def test_reward_model_scores_prompt_and_completion(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-rm"
    await asyncio.to_thread(build_tiny_reward_model, folder)
    settings = RewardSettings(
        reward_models=[RewardModelSettings(name="rm", path=folder, batch_size=2, max_length=64)]
    )
    address, ctx, serving = await start(settings)
    try:
        items = [
            {"prompt": "Q: 2+2? ", "completion": "4"},
            {"prompt": "Q: 2+2? ", "completion": "five, I think, but maybe not"},
            {"prompt": "", "completion": "x"},
        ]
        async with RewardClient(address) as c:
            results = await c.score(items, [("rm", 2.0)])
            [info] = [r for r in await c.list_rewards() if r.name == "rm"]
        want = reference_scores(folder, [i["prompt"] + i["completion"] for i in items])
        got = [r.scores["rm"].score for r in results]
        assert got == pytest.approx(want, abs=1e-5)
        assert len(set(got)) == 3  # the model does look at the text
        assert [r.total for r in results] == pytest.approx([2 * w for w in want], abs=1e-5)
        assert info.kind == "model" and info.default_timeout_s == 120.0
    finally:
        ctx.stop_event.set()
        await asyncio.wait_for(serving, 30)
