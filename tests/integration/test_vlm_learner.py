"""The LM learner's decode on a vision-language model, over a real bus: a group naming images
(``image_sha256``) is decoded with the pixels of exactly those images, fetched from the run's
image store; a group naming an image the store does not hold is invalid, naming the field."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from common import tensor
from common.datasets import iter_tasks, take
from common.images import open_image
from learner.lm.model import image_pixels
from learner.lm.settings import LMLearnerSettings
from learner.lm.workload import LMWorkload
from learner.workload import Progress, RunDirs, RunHandle
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.sampler.v1 import sampler_pb2
from services.bus import Bus
from services.bus.images import ImageStore
from services.errors import InvalidArgument
from services.registry import ServiceContext

pytestmark = pytest.mark.slow  # a DeepSpeed engine and a NATS server

RUN = "vlm-decode"


class _Scalars:
    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        pass


def _group(processor: Any, pngs: list[bytes], digests: list[str]) -> trajectory_pb2.TrajectoryGroup:
    content = [{"type": "image"} for _ in pngs] + [{"type": "text", "text": "Which side?"}]
    messages = [{"role": "user", "content": content}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    images = [[open_image(p) for p in pngs]]
    prompt = processor(text=[text], images=images)["input_ids"][0]
    ids = np.asarray([5, 6, 7], np.int32)
    return trajectory_pb2.TrajectoryGroup(
        run=RUN, group_id="g", prompt_id="p", policy_version=0,
        prompt_token_ids=tensor.encode(np.asarray(prompt, np.int32)), image_sha256=digests,
        completions=[
            trajectory_pb2.TrajectoryCompletion(
                token_ids=tensor.encode(ids), logprobs=tensor.encode(np.zeros(3, np.float32)),
                finish_reason=sampler_pb2.FINISH_REASON_STOP, reward=1.0, policy_version=0,
            )
        ],
    )  # fmt: skip


async def test_decode_fetches_the_named_images(
    vision_model_dir: Path, nats_url: str, tmp_path: Path
) -> None:
    settings = LMLearnerSettings.model_validate(
        {"model_path": str(vision_model_dir), "device": "cpu", "algo": {"kl_beta": 0.0}}
    )
    workload = LMWorkload(ServiceContext("learner", "lm_learner", settings, run_name=RUN), settings)
    torch.manual_seed(0)
    engine = workload.build()
    pngs = [t.images[0] for t in take(iter_tasks({"generator": "shapes"}), 2)]
    try:
        async with Bus.connect(nats_url, name="vlm-learner-test") as bus:
            store = ImageStore(bus.payloads, RUN)
            digests = [await store.put(p) for p in pngs]
            assert digests == [hashlib.sha256(p).hexdigest() for p in pngs]
            run = RunHandle(
                run_name=RUN, source="learner", progress=Progress(), bus=bus,
                dirs=RunDirs.of(tmp_path), writer=_Scalars(), tensorboard_step=lambda p: 0,
            )  # fmt: skip
            await workload.begin(run)
            processor = workload.processor
            samples = await workload.decode(_group(processor, pngs, digests))
            values, mask = image_pixels(processor, [open_image(p) for p in pngs])
            (sample,) = samples
            assert sample.pixel_values is not None and sample.pixel_attention_mask is not None
            assert np.array_equal(sample.pixel_values, values)
            assert np.array_equal(sample.pixel_attention_mask, mask)
            gone = _group(processor, pngs, [digests[0], "0" * 64])  # never stored
            with pytest.raises(InvalidArgument, match=r"image_sha256\[1\]"):
                await workload.decode(gone)
    finally:
        await workload.close()
        engine.close()
