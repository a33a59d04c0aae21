"""Load an exported folder in vLLM and answer: greedy completions, log-probs of given token
sequences and a throughput figure. Run as a subprocess (vLLM spawns engine processes and keeps
them until its parent exits), by the export tests and bench/serving/export.py:

    python -m learner.export.vllm_probe REQUEST.json RESULT.json

REQUEST: ``{"model": DIR, "prompts": [text, ...], "max_tokens": 16, "score": [[ids...]],
"score_from": [n, ...], "score_self": false, "throughput_prompts": 0, "max_model_len": 256,
"kv_cache_gib": 1, "images": [[PNG path, ...], ...], "dtype": "auto"}``; RESULT: ``{"greedy":
[{"token_ids", "text", "logprobs", "prompt_token_ids"}], "score_logprobs":
[[float, ...]], "tokens_per_s", "load_s", "quantization"}``. ``score[i]`` is scored from
position ``score_from[i]`` on: the log-probability vLLM's model gives each of those tokens after
the ones before it. ``score_self`` scores the greedy completions just generated, after their
prompts (RESULT then holds ``score`` and ``score_from`` too). ``images[i]`` are prompt i's images
(a vision-language model's chat-template prompt holds one image token per image).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def probe(request: dict[str, Any]) -> dict[str, Any]:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(request.get("kv_cache_gib", 1))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = str(request["model"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    started = time.perf_counter()
    images = request.get("images") or []
    most = max((len(i) for i in images), default=0)
    llm = LLM(
        model=model,
        max_model_len=int(request.get("max_model_len", 256)),
        enforce_eager=True,
        seed=0,
        max_num_seqs=int(request.get("max_num_seqs", 64)),
        limit_mm_per_prompt={"image": most} if most else None,
        dtype=request.get("dtype", "auto"),
    )
    load_s = time.perf_counter() - started
    config = llm.llm_engine.model_config
    quant = getattr(config, "quantization", None)
    greedy_params = SamplingParams(
        temperature=0.0, max_tokens=int(request.get("max_tokens", 16)), logprobs=0
    )
    if images:  # text prompts: the engine's processor expands each image token
        from PIL import Image

        prompts: list[Any] = [
            {"prompt": p, "multi_modal_data": {"image": [Image.open(f).convert("RGB") for f in i]}}
            for p, i in zip(request["prompts"], images, strict=True)
        ]
    else:
        prompts = [TokensPrompt(prompt_token_ids=tokenizer.encode(p)) for p in request["prompts"]]
    out: dict[str, Any] = {"load_s": load_s, "quantization": quant}
    results = llm.generate(prompts, greedy_params, use_tqdm=False)
    out["greedy"] = [_answer(r) for r in results]
    if request.get("score_self"):  # score this model's own greedy completions
        request = {
            **request,
            "score": [g["prompt_token_ids"] + g["token_ids"] for g in out["greedy"]],
            "score_from": [len(g["prompt_token_ids"]) for g in out["greedy"]],
        }  # fmt: skip
        out["score"], out["score_from"] = request["score"], request["score_from"]
    if request.get("score"):
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        seqs = [TokensPrompt(prompt_token_ids=list(ids)) for ids in request["score"]]
        scored = llm.generate(seqs, params, use_tqdm=False)
        logprobs = []
        for ids, start, r in zip(request["score"], request["score_from"], scored, strict=True):
            row = []
            for position in range(int(start), len(ids)):
                entry: Any = r.prompt_logprobs[position]  # type: ignore[index]
                row.append(float(entry[ids[position]].logprob))
            logprobs.append(row)
        out["score_logprobs"] = logprobs
    count = int(request.get("throughput_prompts", 0))
    if count:
        many = [prompts[i % len(prompts)] for i in range(count)]
        params = SamplingParams(
            temperature=0.0, max_tokens=int(request.get("max_tokens", 16)), ignore_eos=True
        )
        started = time.perf_counter()
        results = llm.generate(many, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        out["tokens_per_s"] = sum(len(r.outputs[0].token_ids) for r in results) / elapsed
    return out


def _answer(result: Any) -> dict[str, Any]:
    """A greedy completion: its tokens, text, each token's log-probability, and the prompt's
    tokens as the engine saw them (images expanded)."""
    completion = result.outputs[0]
    return {
        "token_ids": list(completion.token_ids),
        "text": completion.text,
        "logprobs": [
            float(step[token].logprob)
            for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ],
        "prompt_token_ids": list(result.prompt_token_ids or []),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(
            "usage: python -m learner.export.vllm_probe REQUEST.json RESULT.json", file=sys.stderr
        )
        return 2
    request = json.loads(Path(args[0]).read_text())
    result = probe(request)
    Path(args[1]).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
