"""Game-policy export: ``policy.onnx`` (one graph, batch dimension dynamic) plus
``policy.onnx.json`` (inputs, outputs, both spaces, how to turn outputs into an env action) so a
game engine runs the trained policy itself (ONNX Runtime, Unity Sentis/Barracuda, Godot, ...).

The graph is the policy's acting path (`common.artifacts.LoadedPolicy`): observation ->
trunk -> actor/critic. Outputs:

- discrete actions (Discrete/MultiDiscrete): ``logits`` [B, sum(n)] (the categorical logits of
  each action dimension, concatenated), ``action`` [B] or [B, K] int64 (greedy: argmax of each
  dimension plus the space's ``start``), ``value`` [B];
- continuous actions (Box): ``mean`` [B, *shape] (the Gaussian mean), ``log_std`` [B, *shape],
  ``action`` [B, *shape] (greedy: the mean clipped to the bounds), ``value`` [B].

At export the ONNX graph is run with onnxruntime on sampled observations and compared with the
torch module (parity); a mismatch fails the export.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from services.errors import RlfleetError

__all__ = ["ONNX_FILE", "ONNX_JSON", "export_game", "onnx_parity"]

ONNX_FILE = "policy.onnx"
ONNX_JSON = "policy.onnx.json"
OPSET = 17
ATOL, RTOL = 1e-4, 1e-4
PARITY_SAMPLES = 256


def _acting_module(net: Any) -> Any:
    import torch
    from torch import nn

    class Acting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            space = net.action_space
            if not net.action_dims:
                low = np.broadcast_to(np.asarray(space.low, np.float32), space.shape)
                high = np.broadcast_to(np.asarray(space.high, np.float32), space.shape)
                self.register_buffer("low", torch.as_tensor(np.nan_to_num(low, neginf=-3e38)))
                self.register_buffer("high", torch.as_tensor(np.nan_to_num(high, posinf=3e38)))

        def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            x = obs if obs.dtype == torch.uint8 else obs.float()
            features = self.net.trunk(x)
            out = self.net.actor(features)
            value = self.net.critic(features).squeeze(-1)
            if self.net.action_dims:
                picks = [part.argmax(-1) for part in torch.split(out, self.net.action_dims, dim=-1)]
                action = torch.stack(picks, dim=-1) + self.net.action_offset
                if len(self.net.action_dims) == 1:
                    action = action.reshape(-1)
                return out, action, value
            shape = (-1, *self.net.continuous_shape)
            mean = out.reshape(shape)
            log_std = self.net.log_std.expand_as(out).reshape(shape)
            low, high = self.get_buffer("low"), self.get_buffer("high")
            action = torch.minimum(torch.maximum(mean, low), high)
            return mean, log_std, action, value

    return Acting().eval()


def _sample_obs(space: Any, count: int, seed: int = 0) -> np.ndarray:
    space.seed(seed)
    return np.stack([np.asarray(space.sample()) for _ in range(count)]).astype(space.dtype)


def onnx_parity(
    onnx_path: Path, policy: Any, *, samples: int = PARITY_SAMPLES, seed: int = 0
) -> dict[str, Any]:
    """Run the ONNX graph (onnxruntime, CPU) and the torch policy on the same sampled
    observations: max |difference| per output, greedy action agreement."""
    import onnxruntime as ort  # type: ignore[import-untyped]
    import torch

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    obs = _sample_obs(policy.observation_space, samples, seed)
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(None, {"obs": obs}), strict=True))
    with torch.no_grad():
        want_raw = _acting_module(policy.net)(torch.as_tensor(obs))
    want = {n: t.detach().numpy() for n, t in zip(names, want_raw, strict=True)}
    diffs = {
        n: float(np.max(np.abs(got[n].astype(np.float64) - want[n].astype(np.float64))))
        for n in names
        if n != "action"
    }
    close = all(np.allclose(got[n], want[n], atol=ATOL, rtol=RTOL) for n in names if n != "action")
    # Discrete greedy actions must be equal (logits that tie within the tolerance may not be:
    # 99% must); continuous ones are floats like the rest.
    if policy.net.action_dims:
        same = got["action"] == want["action"]
    else:
        same = np.isclose(got["action"], want["action"], atol=ATOL, rtol=RTOL)
    agree = float(np.mean(np.all(same.reshape(samples, -1), -1)))
    return {
        "samples": samples,
        "max_abs_diff": diffs,
        "atol": ATOL,
        "rtol": RTOL,
        "action_agreement": agree,
        "ok": bool(close and agree >= 0.99),
    }


def _io(name: str, dtype: Any, shape: tuple[Any, ...], doc: str) -> dict[str, Any]:
    return {"name": name, "dtype": str(np.dtype(dtype)), "shape": ["batch", *shape], "doc": doc}


def export_game(policy: Any, out: Path, say: Any) -> dict[str, Any]:
    """Write policy.onnx + policy.onnx.json into ``out``; returns manifest fields."""
    import torch

    net = policy.net
    obs_space = policy.observation_space
    module = _acting_module(net)
    example = torch.as_tensor(_sample_obs(obs_space, 2))
    discrete = bool(net.action_dims)
    outputs = ["logits", "action", "value"] if discrete else ["mean", "log_std", "action", "value"]
    say(f"exporting {policy.env_id} policy to ONNX (opset {OPSET})")
    axes = {"obs": {0: "batch"}, **{n: {0: "batch"} for n in outputs}}
    with warnings.catch_warnings():  # the TorchScript exporter is deprecated, still supported
        warnings.simplefilter("ignore", DeprecationWarning)
        _onnx_export(module, example, out / ONNX_FILE, outputs, axes)
    say("checking parity with onnxruntime")
    parity = onnx_parity(out / ONNX_FILE, policy)
    if not parity["ok"]:
        raise RlfleetError(
            f"ONNX export does not match the torch policy: max |diff| {parity['max_abs_diff']}, "
            f"action agreement {parity['action_agreement']:.3f}"
        )
    return _describe(policy, out, parity)


def _onnx_export(module: Any, example: Any, path: Path, outputs: list[str], axes: Any) -> None:
    import torch

    torch.onnx.export(
        module,
        (example,),
        str(path),
        dynamo=False,  # the TorchScript exporter: no onnxscript needed
        input_names=["obs"],
        output_names=outputs,
        dynamic_axes=axes,
        opset_version=OPSET,
    )


def _describe(policy: Any, out: Path, parity: dict[str, Any]) -> dict[str, Any]:
    import json

    from google.protobuf import json_format

    from common import spaces as space_codec

    net = policy.net
    obs_space, act_space = policy.observation_space, policy.action_space
    discrete = bool(net.action_dims)
    act_shape = tuple(act_space.shape)
    if discrete:
        k = len(net.action_dims)
        act_doc = "greedy action: argmax of each dimension's logits + the action space's start"
        io_out = [
            _io("logits", np.float32, (sum(net.action_dims),),
                f"categorical logits, dimensions of sizes {net.action_dims} concatenated"),
            _io("action", np.int64, () if k == 1 else (k,), act_doc),
        ]  # fmt: skip
    else:
        io_out = [
            _io("mean", np.float32, act_shape, "Gaussian mean (sample: + exp(log_std) * N(0,1))"),
            _io("log_std", np.float32, act_shape, "Gaussian log standard deviation"),
            _io("action", np.float32, act_shape, "greedy action: the mean clipped to the bounds"),
        ]  # fmt: skip
    io_out.append(_io("value", np.float32, (), "state value (critic)"))
    obs_doc = "observation batch" + (
        " (uint8 images HWC, scaled by 1/255 inside)" if obs_space.dtype == np.uint8 else ""
    )
    description = {
        "format": "rlfleet-onnx-policy/1",
        "file": ONNX_FILE,
        "opset": OPSET,
        "env_id": policy.env_id,
        "env_kwargs": policy.env_kwargs,
        "inputs": [_io("obs", obs_space.dtype, tuple(obs_space.shape), obs_doc)],
        "outputs": io_out,
        "observation_space": json_format.MessageToDict(space_codec.to_proto(obs_space)),
        "action_space": json_format.MessageToDict(space_codec.to_proto(act_space)),
        "stochastic": (
            "sample each dimension from softmax(logits)" if discrete
            else "mean + exp(log_std) * N(0, 1), clipped to the action space bounds"
        ),
        "parity": parity,
    }  # fmt: skip
    (out / ONNX_JSON).write_text(json.dumps(description, indent=2) + "\n")
    return {
        "weight_version": policy.description.get("version"),
        "updates": policy.description.get("updates"),
        "source": {"kind": "final", "path": str(policy.directory)},
        "algo": policy.description.get("algo"),
        "parity": parity,
    }
