"""PPO / A2C over rollout fragments: decode, stack, advantages, update.

The math is bench/game/ppo_baseline.py's (CleanRL's ``ppo.py``, time-limit bootstrapping), fed by
``bus.v1.RolloutFragment`` messages instead of a local vector env:

1. ``decode_fragment``: one message -> tensors ``[T, N, ...]``, every shape checked;
2. ``FragmentBatch``: several fragments; those of equal length T are concatenated along the
   env axis into one segment ``[T, sum N]``, since GAE treats envs independently;
3. ``prepare``: values (the learner's current critic, or the actor's), the advantage estimator
   the game preset names (``GAME_ADVANTAGES``: GAE) per segment with truncated steps
   bootstrapped from V(final observation) and the fragment end from V(s_T); everything
   flattened to ``[B]`` rows;
4. ``update``: ``update_epochs`` x shuffled minibatches of the policy loss the game preset names
   (``POLICY_LOSSES``: ``ppo``/``a2c``, its hyperparameters from
   ``LearnerSettings.policy_loss_kwargs``) + ``vf_coef`` x value loss (optionally clipped) -
   ``ent_coef`` x entropy,
   advantages normalised per minibatch, optional ``target_kl`` early stop; returns CleanRL-named
   metrics. NaN/inf in the batch stops the update before its first step, and a step whose loss
   or gradients are NaN/inf is never taken (learner.engine.check_step): ``NonfiniteUpdate``,
   naming the fragments that hold NaN/inf, if any.

The consumer's bookkeeping (``AppliedWindow``, ``triage``) is shared with the LM workload and
lives in learner.consumer; the service around this (learner.game.workload) only adapts it.

The four steps above stay one pipeline in one file, each step's checks next to the shapes it
reads: split, one tensor's story would spread over several files.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from common.tensor import decode, decode_tree
from learner.algos import (
    GAME_ADVANTAGES,
    POLICY_LOSSES,
    aggregate,
    entropy_loss,
    normalize_advantages,
    value_loss,
)
from learner.engine import NonfiniteUpdate, check_step
from rlfleet.bus.v1 import trajectory_pb2
from services.errors import InvalidArgument

if TYPE_CHECKING:
    from learner.engine import Engine
    from learner.game.settings import LearnerSettings

__all__ = [
    "Fragment",
    "FragmentBatch",
    "Rollout",
    "Segment",
    "decode_fragment",
    "prepare",
    "update",
]

ValueFn = Callable[[Tensor], Tensor]  # observations [B, ...] -> V [B]
LogpFn = Callable[[Tensor, Tensor], Tensor]  # (observations [B, ...], actions [B, ...]) -> [B]


# ---------------------------------------------------------------------------- decoding


@dataclass
class Fragment:
    """One decoded RolloutFragment (T steps of N envs), tensors on the CPU."""

    fragment_id: str
    actor_id: str  # an actor's name, or a game link's "<env server>/link-<id>"
    policy_version: int
    obs: Tensor  # [T, N, *obs]
    actions: Tensor  # [T, N, *act]
    logprobs: Tensor  # [T, N] float32, behaviour log pi(a|s)
    rewards: Tensor  # [T, N] float32
    terminated: Tensor  # [T, N] bool
    truncated: Tensor  # [T, N] bool
    next_obs: Tensor  # [N, *obs] s_T
    final_indices: Tensor  # [K] int64, flat t * N + n of truncated (not terminated) steps
    final_obs: Tensor | None  # [K, *obs]
    values: Tensor | None = None  # [T, N] behaviour V(s_t)
    bootstrap_values: Tensor | None = None  # [N] behaviour V(s_T)
    final_values: Tensor | None = None  # [K] behaviour V(final observation)
    env_address: str = ""  # the env server(s) its envs ran on

    def nonfinite(self) -> list[str]:
        """The names of its float tensors that hold NaN/inf."""
        named = {
            "observations": self.obs,
            "actions": self.actions,
            "logprobs": self.logprobs,
            "rewards": self.rewards,
            "next_observations": self.next_obs,
            "final_observations": self.final_obs,
            "values": self.values,
            "bootstrap_values": self.bootstrap_values,
            "final_values": self.final_values,
        }
        return [
            name
            for name, t in named.items()
            if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all())
        ]

    def source(self) -> str:
        """Who made it, for a line about its data."""
        where = f" over {self.env_address}" if self.env_address else ""
        return f"{self.actor_id}{where} (fragment {self.fragment_id})"

    @property
    def num_steps(self) -> int:
        return int(self.rewards.shape[0])

    @property
    def num_envs(self) -> int:
        return int(self.rewards.shape[1])

    @property
    def size(self) -> int:
        """Environment transitions: T * N."""
        return self.num_steps * self.num_envs


Shape = Sequence[Any]  # extents; -1 = any extent, a trailing ... = any further dimensions


def _array(msg: Any, name: str, shape: Shape, dtype: str | None = None) -> Tensor:
    """Decode a Tensor, check dtype and shape, copy into a writable torch tensor."""
    array = decode(msg, name=name)
    if dtype is not None and array.dtype != np.dtype(dtype):
        raise InvalidArgument(f"{name}: expected {dtype}, got {array.dtype}", field=name)
    return torch.from_numpy(_check_shape(np.array(array), name, shape))


def _tree(msg: Any, name: str, shape: Shape) -> Tensor:
    value = decode_tree(msg, name=name)
    if not isinstance(value, np.ndarray):
        raise InvalidArgument(f"{name}: only array (Box/Discrete) observations are supported")
    return torch.from_numpy(_check_shape(np.array(value), name, shape))


def _check_shape(array: np.ndarray, name: str, shape: Shape) -> np.ndarray:
    want = list(shape)
    if want and want[-1] is Ellipsis:
        want = want[:-1] + [-1] * max(0, array.ndim - len(want) + 1)
    ok = array.ndim == len(want) and all(
        w in (-1, g) for w, g in zip(want, array.shape, strict=True)
    )
    if not ok:
        shown = ["*" if w == -1 else w for w in shape if w is not Ellipsis]
        rest = ", ..." if list(shape)[-1:] == [Ellipsis] else ""
        raise InvalidArgument(
            f"{name}: expected shape {shown}{rest}, got {list(array.shape)}", field=name
        )
    return array


def decode_fragment(
    msg: trajectory_pb2.RolloutFragment,
    obs_shape: Sequence[int] | None = None,
    action_shape: Sequence[int] | None = None,
) -> Fragment:
    """Decode and check a RolloutFragment; raises InvalidArgument naming the bad field.

    ``obs_shape`` / ``action_shape`` are one env's shapes (``space.shape``); None accepts any,
    as long as every observation tensor agrees with ``observations``.
    """
    T, N = int(msg.num_steps), int(msg.num_envs)
    if T < 1 or N < 1:
        raise InvalidArgument(f"fragment {msg.fragment_id}: num_steps={T}, num_envs={N}")
    any_tail: Shape = [...]
    obs_tail = list(obs_shape) if obs_shape is not None else any_tail
    act_tail = list(action_shape) if action_shape is not None else any_tail
    observations = _tree(msg.observations, "observations", [T, N, *obs_tail])
    obs = list(observations.shape[2:])
    actions = _tree(msg.actions, "actions", [T, N, *act_tail])
    has_values = msg.HasField("values")
    final_indices = torch.zeros(0, dtype=torch.int64)
    if msg.HasField("final_indices"):
        final_indices = _array(msg.final_indices, "final_indices", [-1], "int64")
    K = int(final_indices.shape[0])
    fragment = Fragment(
        fragment_id=msg.fragment_id,
        actor_id=msg.actor_id,
        policy_version=int(msg.policy_version),
        obs=observations,
        actions=actions,
        logprobs=_array(msg.logprobs, "logprobs", [T, N], "float32"),
        rewards=_array(msg.rewards, "rewards", [T, N], "float32"),
        terminated=_array(msg.terminated, "terminated", [T, N], "bool"),
        truncated=_array(msg.truncated, "truncated", [T, N], "bool"),
        next_obs=_tree(msg.next_observations, "next_observations", [N, *obs]),
        final_indices=final_indices,
        final_obs=_tree(msg.final_observations, "final_observations", [K, *obs]) if K else None,
        env_address=msg.env_address,
    )
    if has_values:
        fragment.values = _array(msg.values, "values", [T, N], "float32")
        fragment.bootstrap_values = _array(msg.bootstrap_values, "bootstrap_values", [N], "float32")
        if K:
            fragment.final_values = _array(msg.final_values, "final_values", [K], "float32")
    expected = torch.nonzero((fragment.truncated & ~fragment.terminated).reshape(-1)).reshape(-1)
    if not torch.equal(final_indices, expected):
        raise InvalidArgument(
            f"final_indices {final_indices.tolist()} are not the truncated, non-terminated steps "
            f"{expected.tolist()}",
            field="final_indices",
        )
    return fragment


# ---------------------------------------------------------------------------- stacking


@dataclass
class Segment:
    """Fragments of equal length T side by side: every tensor ``[T, N]`` with N = sum of theirs."""

    obs: Tensor  # [T, N, *obs]
    actions: Tensor  # [T, N, *act]
    logprobs: Tensor  # [T, N]
    rewards: Tensor  # [T, N]
    terminated: Tensor  # [T, N]
    truncated: Tensor  # [T, N]
    next_obs: Tensor  # [N, *obs]
    final_t: Tensor  # [K] step of each final observation
    final_n: Tensor  # [K] env column of each final observation
    final_obs: Tensor | None  # [K, *obs]
    values: Tensor | None  # [T, N]; None unless every fragment carried values
    bootstrap_values: Tensor | None  # [N]
    final_values: Tensor | None  # [K]


def _stack(fragments: Sequence[Fragment]) -> Segment:
    cat = torch.cat
    final_t, final_n, offset = [], [], 0
    for f in fragments:
        final_t.append(f.final_indices // f.num_envs)
        final_n.append(f.final_indices % f.num_envs + offset)
        offset += f.num_envs
    with_values = all(f.values is not None for f in fragments)
    finals = [f.final_obs for f in fragments if f.final_obs is not None]
    final_values = [f.final_values for f in fragments if f.final_values is not None]
    return Segment(
        obs=cat([f.obs for f in fragments], dim=1),
        actions=cat([f.actions for f in fragments], dim=1),
        logprobs=cat([f.logprobs for f in fragments], dim=1),
        rewards=cat([f.rewards for f in fragments], dim=1),
        terminated=cat([f.terminated for f in fragments], dim=1),
        truncated=cat([f.truncated for f in fragments], dim=1),
        next_obs=cat([f.next_obs for f in fragments], dim=0),
        final_t=cat(final_t),
        final_n=cat(final_n),
        final_obs=cat(finals) if finals else None,
        values=cat([f.values for f in fragments], dim=1) if with_values else None,  # type: ignore[misc]
        bootstrap_values=(
            cat([f.bootstrap_values for f in fragments]) if with_values else None  # type: ignore[misc]
        ),
        final_values=cat(final_values) if with_values and final_values else None,
    )


@dataclass
class FragmentBatch:
    """The fragments of one update."""

    fragments: list[Fragment]

    @property
    def env_steps(self) -> int:
        return sum(f.size for f in self.fragments)

    def segments(self) -> list[Segment]:
        """Fragments grouped by length T (in first-seen order), each group stacked along N."""
        groups: dict[int, list[Fragment]] = collections.defaultdict(list)
        for f in self.fragments:
            groups[f.num_steps].append(f)
        return [_stack(group) for group in groups.values()]


# ---------------------------------------------------------------------------- advantages


@dataclass
class Rollout:
    """Flat training rows of a batch: B = total env transitions."""

    obs: Tensor  # [B, *obs]
    actions: Tensor  # [B, *act]
    logprobs: Tensor  # [B] behaviour log-probabilities
    values: Tensor  # [B] V(s) used for GAE (anchor of value clipping)
    advantages: Tensor  # [B]
    returns: Tensor  # [B] lambda-returns (V-trace: v_s), the value targets
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # of the estimator

    @property
    def size(self) -> int:
        return int(self.logprobs.shape[0])

    def nonfinite(self) -> list[str]:
        """The names of its float rows that hold NaN/inf (from the fragments or the critic)."""
        named = {
            "observations": self.obs,
            "logprobs": self.logprobs,
            "values": self.values,
            "advantages": self.advantages,
            "returns": self.returns,
        }
        return [
            name
            for name, t in named.items()
            if t.is_floating_point() and not bool(torch.isfinite(t).all())
        ]


@torch.no_grad()
def _segment_values(
    seg: Segment, value_fn: ValueFn | None, recompute: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(V(s_t) [T, N], V(s_T) [N], V(final obs) [K]) from the critic or the fragments."""
    T, N = seg.rewards.shape
    K = int(seg.final_t.shape[0])
    if not recompute and seg.values is not None:
        finals = seg.final_values if seg.final_values is not None else torch.zeros(0)
        return seg.values, seg.bootstrap_values, finals  # type: ignore[return-value]
    if value_fn is None:
        raise InvalidArgument("fragments carry no values and no critic was given to compute them")
    parts = [seg.obs.reshape(T * N, *seg.obs.shape[2:]), seg.next_obs]
    if seg.final_obs is not None:
        parts.append(seg.final_obs)
    v = value_fn(torch.cat(parts)).float().reshape(-1)  # [T*N + N + K]
    return v[: T * N].reshape(T, N), v[T * N : T * N + N], v[T * N + N : T * N + N + K]


def prepare(
    batch: FragmentBatch,
    cfg: LearnerSettings,
    value_fn: ValueFn | None = None,
    device: torch.device | str = "cpu",
    logp_fn: LogpFn | None = None,
) -> Rollout:
    """The preset's advantages per segment (``cfg.gamma``, ``cfg.gae_lambda``) and flatten to
    training rows.

    Values come from ``value_fn`` (the learner's critic) when ``cfg.recompute_values`` or when a
    fragment has none; otherwise from the fragments (the behaviour critic). An off-policy
    estimator (one that takes ``target_logp``: V-trace) also gets the fragments' behaviour
    log-probs and ``logp_fn``'s, the learner's current policy.
    """
    preset = cfg.game_preset
    estimator = GAME_ADVANTAGES.get(preset.advantage)
    off_policy = "target_logp" in (GAME_ADVANTAGES.hyperparameters(preset.advantage) or ())
    if off_policy and logp_fn is None:
        raise InvalidArgument(f"advantage {preset.advantage!r} needs the learner's log-probs")
    rows: dict[str, list[Tensor]] = collections.defaultdict(list)
    log_rhos: list[Tensor] = []
    for seg in batch.segments():
        T, N = seg.rewards.shape
        values, last_value, final_v = _segment_values(seg, value_fn, cfg.recompute_values)
        values, last_value = values.cpu().float(), last_value.cpu().float()
        final_values = torch.full((T, N), math.nan)
        final_values[seg.final_t, seg.final_n] = final_v.cpu().float()
        extra = dict(preset.advantage_kwargs)
        if off_policy:
            assert logp_fn is not None
            target = _segment_logp(seg, logp_fn)  # [T, N]
            extra.update(behaviour_logp=seg.logprobs, target_logp=target)
            log_rhos.append((target - seg.logprobs).reshape(-1))
        advantages, returns = estimator(
            seg.rewards,
            values,
            terminated=seg.terminated,
            truncated=seg.truncated,
            last_value=last_value,
            final_values=final_values,
            gamma=cfg.gamma,
            lam=cfg.gae_lambda,
            bootstrap_truncated=cfg.bootstrap_truncated,
            **extra,
        )
        rows["obs"].append(seg.obs.reshape(T * N, *seg.obs.shape[2:]))
        rows["actions"].append(seg.actions.reshape(T * N, *seg.actions.shape[2:]))
        rows["logprobs"].append(seg.logprobs.reshape(-1))
        rows["values"].append(values.reshape(-1))
        rows["advantages"].append(advantages.reshape(-1))
        rows["returns"].append(returns.reshape(-1))
    flat = {k: torch.cat(v).to(device) for k, v in rows.items()}
    rollout = Rollout(
        obs=flat["obs"],
        actions=flat["actions"],
        logprobs=flat["logprobs"],
        values=flat["values"],
        advantages=flat["advantages"],
        returns=flat["returns"],
    )
    if log_rhos:  # how far off-policy the batch was, and how much the clips cut
        rhos = torch.cat(log_rhos).exp()
        rho_bar = float(extra.get("rho_bar", 1.0))
        rollout.metrics = {
            "vtrace_rho_mean": float(rhos.mean()),
            "vtrace_rho_clipfrac": float((rhos > rho_bar).float().mean()),
        }
    return rollout


@torch.no_grad()
def _segment_logp(seg: Segment, logp_fn: LogpFn) -> Tensor:
    """log pi(a_t|s_t) ``[T, N]`` under the learner's current policy."""
    T, N = seg.rewards.shape
    obs = seg.obs.reshape(T * N, *seg.obs.shape[2:])
    actions = seg.actions.reshape(T * N, *seg.actions.shape[2:])
    return logp_fn(obs, actions).cpu().float().reshape(T, N)


# ---------------------------------------------------------------------------- update


def explained_variance(values: Tensor, returns: Tensor) -> float:
    """1 - Var[R - V] / Var[R] (CleanRL); NaN when the returns do not vary."""
    var_y = returns.var()
    return math.nan if float(var_y) == 0 else float(1 - (returns - values).var() / var_y)


def update(
    engine: Engine,
    batch: FragmentBatch,
    cfg: LearnerSettings,
    *,
    lr: float | None = None,
    generator: torch.Generator | None = None,
    clip_grad: bool = False,
) -> dict[str, float]:
    """One update on ``batch``: epochs x shuffled minibatches; returns CleanRL-named metrics
    (means over the minibatches run). ``lr`` sets the learning rate first (annealing).
    ``clip_grad``: clip the gradients to ``cfg.max_grad_norm`` here (``clip_grad_norm``), for an
    engine built without DeepSpeed's clipping (``learner.game.workload.engine_settings``)."""
    if lr is not None:
        engine.set_lr(lr)
    module: Any = engine.module

    def value_fn(obs: Tensor) -> Tensor:
        with engine.autocast():
            return module.value(obs.to(engine.device))

    def logp_fn(obs: Tensor, actions: Tensor) -> Tensor:
        with engine.autocast():
            return module.evaluate(obs.to(engine.device), actions.to(engine.device))[1]

    rollout = prepare(batch, cfg, value_fn, engine.device, logp_fn)
    bad = rollout.nonfinite()
    if bad:  # before any step: no part of such an update is applied
        exc = NonfiniteUpdate(f"NaN/inf in the batch's {', '.join(bad)}; no step taken")
        exc.sources = _nonfinite_sources(batch)
        raise exc
    policy_loss = POLICY_LOSSES.get(cfg.game_preset.policy_loss)
    kwargs = cfg.policy_loss_kwargs()
    clip = cfg.clip_coef if cfg.clip_vloss else None
    B = rollout.size
    world = int(getattr(engine, "world_size", 1))  # data-parallel ranks (learner.ranks)
    clip_here = clip_grad and cfg.max_grad_norm is not None
    stats: dict[str, list[float]] = collections.defaultdict(list)
    epochs = 0
    for _epoch in range(cfg.update_epochs):
        epochs += 1
        perm = torch.randperm(B, generator=generator).to(rollout.obs.device)
        for lo in range(0, B, cfg.minibatch_size):
            mb = perm[lo : lo + cfg.minibatch_size]
            adv = rollout.advantages[mb]
            if cfg.norm_adv:  # over the whole minibatch, so ranks' shards match one rank's
                adv = normalize_advantages(adv)
            share = 1.0
            if world > 1:
                mb, adv, share = _rank_shard(mb, adv, engine.rank, world)
            _, logp, entropy, value = engine(rollout.obs[mb], rollout.actions[mb])
            logp, entropy, value = logp.float(), entropy.float(), value.float()
            pg, pg_metrics = policy_loss(
                logp=logp, old_logp=rollout.logprobs[mb], adv=adv, **kwargs
            )
            v, _ = value_loss(value, rollout.values[mb], rollout.returns[mb], clip=clip)
            ent, ent_metrics = entropy_loss(entropy)
            pg_loss, v_loss, ent_loss = aggregate(pg), aggregate(v), aggregate(ent)
            loss = pg_loss + cfg.vf_coef * v_loss + cfg.ent_coef * ent_loss
            if world > 1:  # DeepSpeed averages the ranks' gradients: weigh by shard size
                loss = loss * share
            engine.backward(loss)
            try:
                check_step(engine, loss)
            except NonfiniteUpdate as exc:
                exc.metrics.update(
                    {
                        "losses/policy_loss": float(pg_loss.detach()),
                        "losses/value_loss": float(v_loss.detach()),
                        "losses/loss": float(loss.detach()),
                    }
                )
                exc.sources = _nonfinite_sources(batch)
                raise
            if clip_here:
                clip_grad_norm(module.parameters(), cfg.max_grad_norm)  # type: ignore[arg-type]
            engine.step()
            stats["policy_loss"].append(float(pg_loss.detach()))
            stats["value_loss"].append(float(v_loss.detach()))
            stats["loss"].append(float(loss.detach()))
            for key, val in {**pg_metrics, **ent_metrics}.items():
                stats[key].append(float(val))
        if cfg.target_kl is not None:
            # Every rank decides on the same (averaged) value, or they would part ways.
            kl = _mean_over_ranks(stats["approx_kl"][-1], world, engine.device)
            if kl > cfg.target_kl:
                break
    metrics = {f"losses/{k}": float(np.mean(v)) for k, v in stats.items() if k != "logp_mean"}
    metrics["losses/explained_variance"] = explained_variance(rollout.values, rollout.returns)
    metrics.update({f"losses/{k}": v for k, v in rollout.metrics.items()})
    metrics["losses/epochs"] = float(epochs)
    metrics["charts/learning_rate"] = engine.lr
    return metrics


def _nonfinite_sources(batch: FragmentBatch) -> list[str]:
    """The fragments holding NaN/inf, with their tensors: where a non-finite loss came from."""
    return [
        f"{f.source()}: NaN/inf in {', '.join(bad)}"
        for f in batch.fragments
        if (bad := f.nonfinite())
    ]


def clip_grad_norm(parameters: Any, max_norm: float) -> Tensor:
    """DeepSpeed's ``clip_grad_norm_`` (deepspeed/runtime/utils.py) for one fp32 rank: the same
    arithmetic in the same order, so the same bits (``bench/game/ppo_update_profile.py`` checks the
    weights), without its all-reduce of the norm over the data-parallel group (a group of one
    has nothing to reduce, and on a small model the call costs more than the rest) and with
    the per-tensor loops as single ``_foreach`` calls. Returns the total norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.stack(torch._foreach_norm(grads, 2.0)).pow(2.0).sum().pow(0.5)  # [] L2 norm
    # A tensor divided, as DeepSpeed does (a float over a tensor is a reciprocal times it).
    coef = torch.tensor(float(max_norm), device=total.device) / (total + 1e-6)  # []
    coef = coef.clamp(max=1.0)  # DeepSpeed's min(1, max_norm / norm)
    torch._foreach_mul_(grads, coef)
    return total


def _rank_shard(mb: Tensor, adv: Tensor, rank: int, world: int) -> tuple[Tensor, Tensor, float]:
    """This rank's rows of a minibatch and the weight of its mean loss, ``rows x world / n``:
    DeepSpeed averages gradients over ranks, so the weighted means add up to the mean over the
    whole minibatch. A rank left without rows (a minibatch smaller than the world) runs the
    whole minibatch with weight 0: it must still join the gradient all-reduce."""
    rows = torch.arange(len(mb), device=mb.device).tensor_split(world)[rank]
    if len(rows) == 0:
        return mb, adv, 0.0
    return mb[rows], adv[rows], len(rows) * world / len(mb)


def _mean_over_ranks(value: float, world: int, device: torch.device) -> float:
    if world == 1:
        return value
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.float32, device=device)  # (NCCL: on the GPU)
    dist.all_reduce(total)  # the process group DeepSpeed set up
    return float(total.item()) / world
