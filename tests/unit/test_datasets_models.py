"""Prompt datasets (JSONL, the arith generator) and init-model's checks and output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from common.datasets import (
    DatasetSpecError,
    Task,
    dataset_columns,
    iter_tasks,
    shared_prompts,
    take,
)
from common.models import MODEL_SIZES, ModelSize, init_model


def test_arith_is_seeded_and_splits_differ() -> None:
    train = take(iter_tasks({"generator": "arith", "seed": 3}), 50)
    again = take(iter_tasks({"generator": "arith", "seed": 3}), 50)
    held_out = take(iter_tasks({"generator": "arith", "seed": 3}, split="eval"), 50)
    assert [t.prompt for t in train] == [t.prompt for t in again]
    assert [t.prompt for t in train] != [t.prompt for t in held_out]
    for task in train:
        a, op, b = re.fullmatch(r"Q: (\d+)([+-])(\d+)=\?\nA:", task.prompt).groups()
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert task.extra == {"answer": str(value)}
        assert task.solution == f" <answer>{value}</answer>"


def test_arith_holds_its_eval_prompts_out_of_train_by_construction() -> None:
    # 1 digit, + and -: 200 prompts in all, so seeds alone cannot keep eval out of train.
    spec = {"generator": "arith", "digits": 1, "seed": 0}
    train = {t.prompt for t in take(iter_tasks(spec), 5000)}
    for seed in (0, 1, 7):
        spec = {"generator": "arith", "digits": 1, "seed": seed}
        held_out = {t.prompt for t in take(iter_tasks(spec, split="eval"), 2000)}
        assert not train & held_out
        assert len(train | held_out) == 200  # together they are the whole space
    assert 20 <= len(held_out) <= 60  # about a fifth


def test_shared_prompts_counts_distinct_eval_prompts_seen_in_training() -> None:
    def tasks(*prompts: str) -> list[Task]:
        return [Task(prompt_id=str(i), prompt=p) for i, p in enumerate(prompts)]

    train = tasks("a", "b", "c", "d")
    assert shared_prompts(iter(train), tasks("b", "b", "d", "x"), limit=10) == (2, 3)
    assert shared_prompts(iter(train), tasks("b", "b", "d", "x"), limit=2) == (1, 3)  # a, b


def test_columns_are_extra_and_solution_as_reward_keywords(tmp_path: Path) -> None:
    task = Task(prompt_id="p", prompt="Q", extra={"answer": "4"}, solution=" <answer>4</answer>")
    assert task.columns() == {"answer": "4", "solution": " <answer>4</answer>"}
    assert Task(prompt_id="p", extra={"answer": "4"}).columns() == {"answer": "4"}
    assert dataset_columns({"generator": "arith"}) == {"answer", "solution"}
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "level": 1}\n{"prompt": "b", "topic": "x"}\n')
    assert dataset_columns({"jsonl": str(rows)}) == {"level", "topic"}
    assert dataset_columns({"jsonl": str(tmp_path / "missing.jsonl")}) is None


def test_dataset_spec_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(DatasetSpecError, match="unknown dataset generator 'arit'"):
        iter_tasks({"generator": "arit"})
    with pytest.raises(DatasetSpecError, match="digits must be in"):
        next(iter_tasks({"generator": "arith", "digits": 9}))
    with pytest.raises(DatasetSpecError, match="does not exist"):
        next(iter_tasks({"jsonl": str(tmp_path / "missing.jsonl")}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi", "answer": "1"}\n{"answer": "2"}\n')
    tasks = iter_tasks({"jsonl": str(bad)})
    assert next(tasks).extra == {"answer": "1"}
    with pytest.raises(DatasetSpecError, match=r"bad.jsonl:2: set exactly one of prompt, messages"):
        next(tasks)
    bad.write_text("not json\n")
    with pytest.raises(DatasetSpecError, match=r"bad.jsonl:1: not JSON"):
        next(iter_tasks({"jsonl": str(bad)}))


def test_jsonl_chat_rows(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    row = {"id": "q1", "messages": [{"role": "user", "content": "2+2?"}], "solution": "4"}
    path.write_text(json.dumps(row) + "\n")
    (task,) = list(iter_tasks({"jsonl": str(path)}))
    assert task.prompt_id == "q1" and task.messages[0]["content"] == "2+2?"
    assert task.solution == "4" and task.extra == {}


def test_head_size_must_suit_vllm_cpu_attention() -> None:
    with pytest.raises(
        ValueError, match=r"head size 48 .* is not one vLLM's CPU attention accepts"
    ):
        ModelSize(96, 2, 2, 1, 128).check()
    for size in MODEL_SIZES.values():
        size.check()


def test_init_model_loads_through_from_pretrained(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert model.config.head_dim == 32 and not model.config.tie_word_embeddings
    ids = tokenizer("Q: 12+34=?\nA:", add_special_tokens=False)["input_ids"]
    digits = [tokenizer.decode([i]) for i in ids if tokenizer.decode([i]).isdigit()]
    assert digits == ["1", "2", "3", "4"]  # one token per digit
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n")
    meta = json.loads((tiny_model_dir / "rlfleet_model.json").read_text())
    assert meta["parameters"] == sum(p.numel() for p in model.parameters())


def test_the_chat_template_lists_tools_and_renders_tool_calls(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from env_server.text import BUILTIN_TEXT_ENVS, tool_calls

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2*21?"},
    ]
    without = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    assert without == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2*21?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )  # as before tools were known: run files and recorded prompts render the same
    tools = BUILTIN_TEXT_ENVS["Calculator-v0"].tools
    call = {"id": "c1", "function": {"name": "calculator", "arguments": '{"expression": "2*21"}'}}
    conversation = [
        *plain,
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
        {"role": "tool", "content": '{"result": 42}'},
    ]
    text = tokenizer.apply_chat_template(
        conversation, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert text.count("<|im_start|>system") == 1  # the system prompt joins the tools' turn
    assert '"name": "calculator"' in text.split("\n</tools>")[0]
    assert '<|im_start|>tool\n{"result": 42}<|im_end|>' in text
    # The call renders in the format a model writes and the text envs read back.
    (parsed,) = tool_calls({"role": "assistant", "content": text.split("<|im_start|>assistant")[1]})
    assert (parsed.name, parsed.arguments) == ("calculator", {"expression": "2*21"})

    # A turn that only calls renders as the model wrote it (the call text as its content): a
    # client sending the call back (OpenAI's tool_calls, no content) gets the sampled prompt.
    said = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*21"}}\n</tool_call>'
    as_sent, as_said = (
        tokenizer.apply_chat_template(
            [*plain, turn, {"role": "tool", "content": "42"}], tools=tools, tokenize=False
        )
        for turn in (
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "assistant", "content": said},
        )
    )
    assert as_sent == as_said
    # Content as a list of parts (how vLLM's OpenAI server passes it to a template that reads
    # parts) renders as the string would, the system prompt beside the tools included.
    as_parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in conversation]
    listed = tokenizer.apply_chat_template(
        as_parts, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert listed == text


def test_init_model_refuses_a_size_vllm_cannot_serve(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head size"):
        init_model(tmp_path / "m", size=ModelSize(96, 1, 2, 1, 64))
    assert not (tmp_path / "m" / "config.json").exists()


def test_an_env_trains_the_tokenizer_so_its_tool_prompts_stay_short(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from env_server.text.envs import CalculatorEnv

    size = ModelSize(64, 1, 2, 1, 64)  # the tokenizer is what counts here
    plain = init_model(tmp_path / "plain", size=size, corpus_size=2_000)
    with_env = init_model(
        tmp_path / "env", size=size, corpus_size=2_000, env={"env_id": "Calculator-v0"}
    )
    env = CalculatorEnv(split="eval")
    opening, _ = env.reset(seed=5)
    lengths = {}
    for name, folder in (("plain", plain), ("env", with_env)):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        text = tokenizer.apply_chat_template(
            opening, tools=CalculatorEnv.tools, add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text  # still lossless
        lengths[name] = len(ids)
        # digits stay one token each: arithmetic is as learnable as before
        assert [tokenizer.decode([i]) for i in tokenizer(env.task)["input_ids"][:3]] == list(
            env.task[:3]
        )
    assert lengths["env"] < 0.5 * lengths["plain"], lengths


def test_an_env_from_a_users_file_trains_the_tokenizer_too(tmp_path: Path) -> None:
    """A TextEnv named by a file reference (as agent_custom_env.yaml names its env) is not an id
    of the process that makes the model until registered, as an env server registers it."""
    env_id = (
        f"{Path(__file__).resolve().parents[2] / 'examples' / 'custom_text_env.py'}:RunningTotal"
    )
    size = ModelSize(64, 1, 2, 1, 64)
    folder = init_model(tmp_path / "m", size=size, corpus_size=200, env={"env_id": env_id})
    assert json.loads((folder / "rlfleet_model.json").read_text())["tokenizer_env"] == env_id


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--env", "Calculator-v0", "--env-kwargs", "{digits: 3"], "--env-kwargs: not JSON"),
        (["--env", "Calculator-v0", "--env-kwargs", "[3]"], "--env-kwargs: a JSON object"),
        (["--env", "Calculator-v0", "--env-kwargs", '{"digits": 30}'], "digits"),
        (["--env", "NoSuchEnv-v9"], "NoSuchEnv-v9"),
    ],
)
def test_init_model_env_errors_name_what_was_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    from launch import cli

    code = cli.main(["init-model", str(tmp_path / "m"), *argv])
    _, err = capsys.readouterr()
    assert code != 0 and message in err, err
    assert not (tmp_path / "m" / "config.json").exists()
