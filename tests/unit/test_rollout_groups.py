"""Rollout groups from a GenerateResponse and a ScoreResponse (sampler/rollout/groups.py)."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import json_format

from clients.env.episodes import Episode
from clients.trajectories.groups import episode_group, group_id, prompt_text
from clients.trajectories.prompts import prompt_key, prompt_task
from common import tensor
from common.datasets import Task
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.reward.v1 import reward_pb2
from rlfleet.sampler.v1 import sampler_pb2
from sampler.rollout.groups import (
    Expert,
    build_groups,
    call_seed,
    expert_text,
    generate_request,
    score_request,
    transcript_score_request,
)
from sampler.rollout.settings import RewardSpec, RolloutSettings, SamplingSettings
from services.errors import InvalidArgument

RUN = "grpo-1"


def _task(i: int, *, solution: str | None = None, chat: bool = False) -> trajectory_pb2.PromptTask:
    task = Task(
        prompt_id=f"p{i}",
        prompt="" if chat else f"Q: {i}+1=?\nA:",
        messages=({"role": "system", "content": "be brief"}, {"role": "user", "content": f"{i}+1"})
        if chat
        else (),
        extra={"answer": str(i + 1)},
        solution=solution,
    )
    return prompt_task(RUN, "arith:train:0", 2, task)


def _completion(ids: list[int], version: int, *, finish: int = 1) -> sampler_pb2.Completion:
    return sampler_pb2.Completion(
        token_ids=tensor.encode(np.array(ids, dtype=np.int32)),
        logprobs=tensor.encode(-np.arange(1, len(ids) + 1, dtype=np.float32) / 10),
        text=f"text{ids}",
        finish_reason=finish,
        policy_version=version,
        end_policy_version=version + 1,
    )


def _result(prompt_len: int, completions: list[sampler_pb2.Completion]) -> sampler_pb2.PromptResult:
    return sampler_pb2.PromptResult(
        prompt_token_ids=tensor.encode(np.arange(prompt_len, dtype=np.int32)),
        completions=completions,
    )


def _score(total: float | None, *names: str) -> reward_pb2.ItemScore:
    item = reward_pb2.ItemScore(
        scores=[
            reward_pb2.FunctionScore(name=n, status=reward_pb2.SCORE_STATUS_OK, score=0.5)
            for n in names
        ]
    )
    if total is not None:
        item.total = total
    return item


def _decode(message) -> np.ndarray:
    return tensor.decode(message)


def test_groups_carry_ids_logprobs_masks_rewards_and_versions() -> None:
    tasks = [_task(0), _task(1)]
    results = [
        _result(5, [_completion([7, 8, 9], 3), _completion([4], 2, finish=2)]),
        _result(3, [_completion([1, 2], 3), _completion([], 3, finish=3)]),
    ]
    scores = [_score(1.0, "accuracy"), _score(0.0, "accuracy"), _score(0.25), _score(None)]
    groups = build_groups(RUN, "rollout-0", tasks, results, [None, None], scores)

    assert [g.group_id for g in groups] == [
        f"{RUN}/arith:train:0/2/p0",
        f"{RUN}/arith:train:0/2/p1",
    ]
    first = groups[0]
    assert (first.run, first.prompt_id, first.source, first.dataset) == (
        RUN,
        "p0",
        "rollout-0",
        "arith:train:0",
    )
    assert first.prompt_text == "Q: 0+1=?\nA:"
    prompt = _decode(first.prompt_token_ids)
    assert prompt.dtype == np.int32 and prompt.tolist() == [0, 1, 2, 3, 4]
    assert first.policy_version == 2  # the oldest sampled completion
    assert first.create_time.seconds > 0

    c0, c1 = first.completions
    ids, logprobs, mask = _decode(c0.token_ids), _decode(c0.logprobs), _decode(c0.loss_mask)
    assert ids.dtype == np.int32 and ids.tolist() == [7, 8, 9]
    assert logprobs.dtype == np.float32 and logprobs.shape == (3,)
    np.testing.assert_allclose(logprobs, [-0.1, -0.2, -0.3], rtol=1e-6)
    assert mask.dtype == np.bool_ and mask.tolist() == [True, True, True]
    assert (c0.policy_version, c0.end_policy_version, c0.expert) == (3, 4, False)
    assert c0.finish_reason == sampler_pb2.FINISH_REASON_STOP
    assert c0.reward == 1.0 and [s.name for s in c0.rewards] == ["accuracy"]
    assert c1.finish_reason == sampler_pb2.FINISH_REASON_LENGTH and c1.HasField("reward")
    assert c0.text == "text[7, 8, 9]"

    aborted = groups[1].completions[1]
    assert _decode(aborted.token_ids).shape == (0,) and _decode(aborted.logprobs).shape == (0,)
    assert not aborted.HasField("reward")  # no function scored it: left out of training
    assert groups[1].completions[0].reward == 0.25


def test_expert_completion_follows_the_sampled_ones() -> None:
    tasks = [_task(0, solution=" <answer>1</answer>")]
    expert = Expert(text=expert_text(tasks[0]) or "", token_ids=np.array([11, 12, 2], np.int64))
    results = [_result(4, [_completion([5, 6], 7)])]
    request = score_request(tasks, results, [expert], [RewardSpec(name="accuracy")])
    assert [item.completion for item in request.items] == ["text[5, 6]", " <answer>1</answer>"]
    assert _decode(request.items[1].completion_token_ids).tolist() == [11, 12, 2]

    scores = [_score(0.0, "accuracy"), _score(1.0, "accuracy")]
    (group,) = build_groups(RUN, "d", tasks, results, [expert], scores)
    sampled, demo = group.completions
    assert demo.expert and not sampled.expert
    ids = _decode(demo.token_ids)
    assert ids.dtype == np.int32 and ids.tolist() == [11, 12, 2]
    assert not demo.HasField("logprobs")
    assert _decode(demo.loss_mask).tolist() == [True, True, True]
    assert (demo.policy_version, demo.end_policy_version) == (0, 0)
    assert demo.reward == 1.0 and demo.text == " <answer>1</answer>"
    assert group.policy_version == 7  # from the sampled completions only


def test_score_request_items_rewards_and_extra() -> None:
    tasks = [_task(0, solution="x"), _task(1, chat=True)]
    results = [_result(2, [_completion([1], 0)] * 2), _result(3, [_completion([2], 0)] * 2)]
    rewards = [
        RewardSpec(name="accuracy", weight=1.0),
        RewardSpec(name="length", weight=0.0, kwargs={"max_len": 8}, timeout_s=2.5),
    ]
    request = score_request(tasks, results, [None, None], rewards)
    assert len(request.items) == 4
    assert [r.name for r in request.rewards] == ["accuracy", "length"]
    assert request.rewards[1].kwargs["max_len"] == 8
    assert request.rewards[1].timeout.ToNanoseconds() == 2_500_000_000
    assert not request.rewards[0].HasField("timeout")
    first, last = request.items[0], request.items[3]
    assert first.prompt == "Q: 0+1=?\nA:"
    assert json_format.MessageToDict(first.extra) == {"answer": "1", "solution": "x"}
    assert last.prompt == "1+1"  # a chat prompt is scored against its last user message
    assert _decode(last.prompt_token_ids).tolist() == [0, 1, 2]
    assert _decode(last.completion_token_ids).tolist() == [2]


def test_generate_request_asks_for_logprobs_and_group_size() -> None:
    sampling = SamplingSettings(temperature=0.7, top_p=0.9, top_k=20, max_tokens=64, stop=["\n"])
    tasks = [_task(0), _task(1, chat=True)]
    request = generate_request(tasks, sampling, 6, seed=3)
    params = request.sampling
    assert (params.n, params.logprobs, params.max_tokens, list(params.stop)) == (
        6,
        True,
        64,
        ["\n"],
    )
    assert params.temperature == pytest.approx(0.7) and params.top_p == pytest.approx(0.9)
    assert params.top_k == 20 and params.seed == call_seed(3, tasks[0])
    assert request.prompts[0].text == "Q: 0+1=?\nA:"
    assert [m.role for m in request.prompts[1].chat.messages] == ["system", "user"]
    assert not generate_request(tasks, sampling, 6, seed=None).sampling.HasField("seed")
    assert call_seed(3, tasks[0]) != call_seed(3, tasks[1])


def test_mismatched_responses_are_refused() -> None:
    tasks = [_task(0)]
    results = [_result(2, [_completion([1, 2], 0)])]
    with pytest.raises(InvalidArgument, match="1 scores for 2 completions"):
        build_groups(RUN, "d", tasks, results, [Expert("e", np.array([1]))], [_score(1.0)])
    bad = _completion([1, 2], 0)
    bad.logprobs.CopyFrom(tensor.encode(np.zeros(3, np.float32)))
    with pytest.raises(InvalidArgument, match=r"completions\[0\]: logprobs shape \[3\]"):
        build_groups(RUN, "d", tasks, [_result(2, [bad])], [None], [_score(1.0)])
    bad.ClearField("logprobs")
    with pytest.raises(InvalidArgument, match="no logprobs"):
        build_groups(RUN, "d", tasks, [_result(2, [bad])], [None], [_score(1.0)])


def test_prompt_tasks_keys_and_texts() -> None:
    task = _task(4, solution="sol")
    assert prompt_key(task) == "arith:train:0/2/p4"
    assert group_id(RUN, task) == f"{RUN}/arith:train:0/2/p4"
    assert expert_text(task) == "sol" and expert_text(_task(5)) is None
    assert prompt_text(_task(3, chat=True)) == "3+1"


def test_settings_validate_at_load() -> None:
    base = {"sampler": "llm-0", "reward_service": "rewards", "dataset": {"generator": "arith"}}
    settings = RolloutSettings(**base)
    assert settings.sampler == ["llm-0"] and settings.queue == "prompts"
    with pytest.raises(ValueError, match="expert_completions needs model_path"):
        RolloutSettings(**base, expert_completions=True)
    with pytest.raises(ValueError, match="named more than once"):
        RolloutSettings(**base, rewards=[{"name": "a"}, {"name": "a"}])
    with pytest.raises(ValueError, match="unknown dataset generator"):
        RolloutSettings(**{**base, "dataset": {"generator": "nope"}})
    with pytest.raises(ValueError, match="extra"):
        RolloutSettings(**base, temperature=1.0)  # sampling params live under `sampling`


def _episode(index: int, answer: str, env_reward: float) -> Episode:
    episode = Episode(
        index,
        prompt_ids=[1, 2, 3],
        messages=[
            {"role": "system", "content": "use the tool"},
            {"role": "user", "content": "What is 12 * 34?"},
            {"role": "assistant", "content": "<tool_call>...</tool_call>"},
            {"role": "tool", "content": "408"},
            {"role": "assistant", "content": answer},
        ],
        info={"answer": 408, "outcome": "correct", "not_json": object()},
    )
    episode.add([7, 8], [-0.5, -0.25])
    episode.add([9])
    episode.add([10], [-1.0])
    episode.rewards.append(env_reward)
    return episode


def test_transcripts_go_to_the_reward_functions_with_the_envs_info() -> None:
    task = prompt_task(RUN, "env_seeds", 0, Task(prompt_id="e0", prompt="x", extra={"seed": 5}))
    episodes = [_episode(0, "<answer>408</answer>", 1.0), _episode(1, "no idea", 0.0)]
    rewards = [RewardSpec(name="accuracy"), RewardSpec(name="format", weight=0.5)]
    request = transcript_score_request(task, episodes, rewards)
    assert [(r.name, r.weight) for r in request.rewards] == [("accuracy", 1.0), ("format", 0.5)]
    first = request.items[0]
    assert first.prompt == "What is 12 * 34?"
    assert first.completion == "<answer>408</answer>"  # the model's last message
    assert tensor.decode(first.completion_token_ids).tolist() == [7, 8, 9, 10]
    extra = json_format.MessageToDict(first.extra)
    assert extra["answer"] == 408 and extra["seed"] == 5 and "not_json" not in extra
    assert extra["transcript"].startswith("[user] What is 12 * 34?\n[assistant] <tool_call>")
    assert request.items[1].completion == "no idea"

    def score(total: float | None, *values: float) -> reward_pb2.ItemScore:
        out = reward_pb2.ItemScore(
            scores=[
                reward_pb2.FunctionScore(name=name, status=reward_pb2.SCORE_STATUS_OK, score=v)
                for name, v in zip(["accuracy", "format"], values, strict=False)
            ]
        )
        if total is not None:
            out.total = total
        return out

    group = episode_group(RUN, "rollout-0", task, episodes, [score(1.5, 1, 1), score(None)])
    ok, abstained = group.completions
    assert [r.name for r in ok.rewards] == ["env", "accuracy", "format"]
    assert ok.reward == pytest.approx(2.5)  # the env's 1 plus the functions' weighted 1.5
    assert abstained.reward == 0.0 and [r.name for r in abstained.rewards] == ["env"]
    assert tensor.decode(ok.loss_mask).tolist() == [True, True, False, True]
    without = episode_group(RUN, "rollout-0", task, episodes)
    assert [c.reward for c in without.completions] == [1.0, 0.0]


def test_episodes_whose_openings_differ_share_their_common_prefix() -> None:
    task = prompt_task(RUN, "agent", 0, Task(prompt_id="t0", prompt="x"))
    same, other = _episode(0, "<answer>408</answer>", 1.0), _episode(1, "no idea", 0.0)
    other.prompt_ids = [1, 2, 5, 6]  # an agent that wrote its opening otherwise
    group = episode_group(RUN, "gateway", task, [same, other], reward_name="agent")
    assert tensor.decode(group.prompt_token_ids).tolist() == [1, 2]
    first, second = group.completions
    assert tensor.decode(first.token_ids).tolist() == [3, 7, 8, 9, 10]
    assert tensor.decode(first.loss_mask).tolist() == [False, True, True, False, True]
    assert tensor.decode(first.logprobs).tolist() == [0.0, -0.5, -0.25, 0.0, -1.0]
    assert tensor.decode(second.token_ids).tolist() == [5, 6, 7, 8, 9, 10]
    assert [r.name for r in second.rewards] == ["agent"]
    # The model's own tokens never become the shared prompt, even when every episode begins
    # its first turn alike.
    alike = episode_group(RUN, "rollout-0", task, [same, _episode(2, "x", 0.0)])
    assert tensor.decode(alike.prompt_token_ids).tolist() == [1, 2, 3]
    other.prompt_ids = [9]
    with pytest.raises(InvalidArgument, match="share no opening token"):
        episode_group(RUN, "gateway", task, [same, other])
