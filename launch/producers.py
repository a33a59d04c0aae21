"""Whether anything can still feed the learner: `rlfleet up`'s view of a run's producers.

A producer is a service whose kind says it feeds the learner (``ServiceSpec.produces``: game
actors and rollout drivers that publish, env servers whose game links publish). One the
launcher runs to completion is gone once its process has finished (or failed for good); an env
server is fed by games that connect to it, so it is gone while it runs only when it has had
game links and its last one has ended, as its producer records say (services/producers.py). An
env server no game has linked to yet is waiting, not gone (it says so itself).

When every producer is gone while the main service (the learner) still runs, and stays so for
``grace_s`` with no service of the run starting or restarting (a crashed game coming back),
`ProducerWatch.check` returns the one line that says what is gone and what the learner still
waits for; the launcher then ends the run or waits, as ``run.when_producers_gone`` says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.producers import ProducerReport
from services.waits import WAIT_NOTICE_S

__all__ = ["GRACE_S", "HOLDING_STATES", "ProducerWatch"]

GRACE_S = 3.0  # all gone this long (a game relinking, a restart between) before it is said
# Service states (Launcher.service_status) in which a service may yet bring a producer back.
HOLDING_STATES = frozenset({"waiting", "starting", "restarting"})


@dataclass
class _Links:
    live: int = 0
    ever: bool = False  # has had a live link
    last_change: str = ""


@dataclass
class ProducerWatch:
    """The producers of one run (instance name -> what it feeds, "rollout fragments") and the
    service the run waits on (``consumer``, the main service)."""

    producers: Mapping[str, str]
    consumer: str
    grace_s: float = GRACE_S
    repeat_s: float = WAIT_NOTICE_S  # said again this often while nothing comes back
    links: dict[str, _Links] = field(default_factory=dict)
    _gone_since: float | None = None
    _said_at: float = 0.0
    said: bool = False  # the "all gone" line was said and nothing came back since
    # The run's status said DONE or FAILED: producers stop (actors follow the status) while
    # the learner finishes, which is no stall.
    run_over: bool = False

    def report(self, record: ProducerReport) -> str | None:
        """Take a producer record; a line worth showing when it matters (the first link of a
        server, or a link after all were gone), else None."""
        if record.source not in self.producers:
            return None
        links = self.links.setdefault(record.source, _Links())
        before = links.live
        links.live, links.last_change = record.live, record.change
        links.ever = links.ever or record.live > 0
        if before == 0 and record.live > 0:
            return f"{record.source}: {record.change} ({record.live} {record.what} live)"
        return None

    def gone(self, states: Mapping[str, str]) -> dict[str, str] | None:
        """Why each producer is gone (name -> reason), or None while one can still produce."""
        why: dict[str, str] = {}
        for name in self.producers:
            state = states.get(name, "waiting")
            links = self.links.get(name)
            if state in ("finished", "failed", "stopped"):
                why[name] = state
            elif links and links.ever and not links.live and state not in HOLDING_STATES:
                why[name] = f"its last game link ended: {links.last_change}"
            else:
                return None
        return why

    def check(self, states: Mapping[str, str], progress: str | None, now: float) -> str | None:
        """The line to say once every producer has been gone ``grace_s``, and again every
        ``repeat_s`` while none comes back; None otherwise. ``states``: every service's state
        (Launcher.service_status); ``progress``: the consumer's last progress
        (``step 2.05k/300k``), if any."""
        consumer_state = states.get(self.consumer)
        holding = any(state in HOLDING_STATES for state in states.values())
        why = self.gone(states)
        over = self.run_over or consumer_state in ("finished", "failed", "stopped", None)
        if why is None or holding or over:
            self._gone_since = None
            self.said = self.said and why is not None  # something came back: say it again later
            return None
        if self._gone_since is None:
            self._gone_since = now
        if now - self._gone_since < self.grace_s:
            return None
        if self.said and now - self._said_at < self.repeat_s:
            return None
        again = f" ({now - self._gone_since:.0f} s)" if self.said else ""
        self.said, self._said_at = True, now
        return self.describe(why, progress) + again

    def describe(self, why: Mapping[str, str], progress: str | None) -> str:
        gone = ", ".join(f"{name} ({reason})" for name, reason in why.items())
        wanted = " and ".join(sorted(set(self.producers.values())))
        at = f" at {progress}" if progress else ""
        return (
            f"no producer of training data left: {gone}; {self.consumer} still waits for "
            f"{wanted}{at}"
        )
