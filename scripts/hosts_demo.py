"""`make hosts-demo`: CartPole PPO spread over 3 network namespaces, mutual TLS on.

Host 1 runs nats-server and the learner, host 2 env-0, host 3 the actor and env-1: the actor
steps env-1 through shared memory (same host) and env-0 over gRPC (another host). Prints where
each service ran and what the actor's links chose, then removes every namespace, link and
process (docs/multi_host.md). ``--nats-cluster``: the bus as a JetStream cluster of one
nats-server per host instead of one on host 1. Needs root.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the harness lives with the tests

from tests.fixtures.hosts import Hosts, unavailable_reason  # noqa: E402
from tests.fixtures.spread import SpreadRun  # noqa: E402

EXAMPLE = REPO / "examples" / "cartpole_ppo.yaml"
# env-1 shares host 3 with the actor; env-0 stays on host 2 (spread.DEFAULT_HOSTS).
PLACEMENT = {"env-1": 2}


def cartpole_run(folder: Path, *, total_timesteps: int, target_return: float | None) -> Path:
    """The example with two env servers (the actor's envs split over both), a unique run
    name and its run dir in ``folder``."""
    config = yaml.safe_load(EXAMPLE.read_text())
    config["run"] = {"name": f"hosts-{uuid.uuid4().hex[:8]}", "dir": str(folder / "run")}
    config["job"].update(
        env_servers=2, total_timesteps=total_timesteps, target_return=target_return
    )
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="env steps to train")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    parser.add_argument(
        "--nats-cluster", action="store_true", help="one nats-server per host, one cluster"
    )
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"hosts-demo: {reason}", file=sys.stderr)
        return 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlfleet-hosts-") as tmp, Hosts(3) as hosts:
        print(f"hosts on {hosts.network} (bridge in {hosts.switch}; this machine {hosts.gateway}):")
        for host in hosts:
            print(f"  {host.name}: {host.address} hostname {host.hostname}")
        run_file = cartpole_run(Path(tmp), total_timesteps=args.steps, target_return=None)
        nodes = 3 if args.nats_cluster else 1
        with SpreadRun(hosts, run_file, placement=PLACEMENT, nats_nodes=nodes, say=print) as run:
            try:
                run.start()
                code = run.wait(args.timeout)
            except RuntimeError as exc:
                print(f"hosts-demo failed: {exc}\n{run.diagnostics()}", file=sys.stderr)
                return 1
            learner = run.placed["learner"].log.read_text(errors="replace")
            actor = run.placed["actor-0"].log.read_text(errors="replace")
        print(f"learner exit {code}")
        for line in re.findall(r"^.* done: .*$", learner, re.M):
            print(f"  learner: {line.strip()}")
        for line in re.findall(r"^.*(?:gRPC steps|steps via|done:).*$", actor, re.M):
            print(f"  actor-0: {line.strip()}")
    left = hosts.wait_gone()
    print(f"removed every namespace, link and process: {not left} {left or ''}".rstrip())
    print(f"hosts-demo took {time.monotonic() - started:.0f}s")
    return 0 if code == 0 and not left else 1


if __name__ == "__main__":
    sys.exit(main())
