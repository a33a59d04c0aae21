"""Model turns of multi-turn episodes (clients/env/episodes.py) sampled on a SamplerService."""

from __future__ import annotations

import numpy as np

from clients.env.episodes import Episode, Generate
from clients.sampler import SamplerClient
from common import tensor
from rlfleet.sampler.v1 import sampler_pb2

__all__ = ["sampler_turns"]


def sampler_turns(client: SamplerClient, sampling: sampler_pb2.SamplingParams) -> Generate:
    """Model turns on one sampler (every turn of a group there: its prefix cache holds the
    conversation so far), each a pre-tokenized prompt, n=1, with logprobs and no more tokens
    than ``sampling.max_tokens`` or the room the episode has left. A seeded ``sampling`` seeds
    each turn of each episode differently (the same seed would give a group G equal episodes)."""

    async def generate(
        episode: Episode, prompt_ids: list[int], room: int
    ) -> sampler_pb2.PromptResult:
        params = sampler_pb2.SamplingParams()
        params.CopyFrom(sampling)
        params.n, params.logprobs = 1, True
        params.max_tokens = min(sampling.max_tokens or room, room)
        if sampling.HasField("seed"):  # reproducible, yet each episode and turn its own
            params.seed = (sampling.seed + 1_000_003 * episode.env_index + episode.turns) % 2**62
        prompt = sampler_pb2.Prompt(token_ids=tensor.encode(np.asarray(prompt_ids, np.int32)))
        request = sampler_pb2.GenerateRequest(prompts=[prompt], sampling=params)
        response = await client.generate_request(request)
        return response.results[0]

    return generate
