"""launch.console: the progress line's numbers, the interval logic, metrics.jsonl."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from google.protobuf import json_format, struct_pb2

from launch.console import Console, compact, duration, format_progress, metric_value
from rlfleet.bus.v1 import events_pb2
from services.progress import Progress, progress_record


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0"),
        (840, "840"),
        (12.5, "12.5"),
        (999.6, "1k"),
        (1290, "1.29k"),
        (6100, "6.1k"),
        (21504, "21.5k"),
        (300_000, "300k"),
        (999_999, "1M"),
        (1_234_567, "1.23M"),
        (2e9, "2G"),
        (-21504, "-21.5k"),
    ],
)
def test_compact(n: float, text: str) -> None:
    assert compact(n) == text


@pytest.mark.parametrize(
    ("v", "text"),
    [
        (475.0, "475.0"),
        (21.37, "21.4"),
        (4.561, "4.56"),
        (0.41, "0.41"),
        (0.0, "0.00"),
        (0.0031, "0.0031"),
        (1290.0, "1.29k"),
        (-0.5, "-0.50"),
    ],
)
def test_metric_value(v: float, text: str) -> None:
    assert metric_value(v) == text


@pytest.mark.parametrize(
    ("s", "text"),
    [
        (0, "0s"),
        (44.6, "45s"),
        (60, "1m"),
        (190, "3m10s"),
        (540, "9m"),
        (3900, "1h05m"),
        (200_000, "2d7h"),
    ],
)
def test_duration(s: float, text: str) -> None:
    assert duration(s) == text


def record(done: float, total: float = 300_000, version: int = 84) -> Progress:
    fields = json_format.MessageToDict(
        progress_record(
            "learner",
            unit="step",
            done=done,
            total=total,
            version=version,
            headline=[("EpRewMean", 475.0), ("EpLenMean", 475.0), ("FPS", 1290.0)],
        )
    )
    progress = Progress.from_fields(fields)
    assert progress is not None
    return progress


def test_the_line() -> None:
    assert format_progress("cartpole-ppo", record(21_504), 190) == (
        "cartpole-ppo  step 21.5k/300k  7%  EpRewMean 475.0  EpLenMean 475.0  FPS 1.29k  v84  "
        "ETA 3m10s"
    )
    lm = Progress("learner", "update", 12, 200, 12, (("reward", 0.41), ("eval", 0.35)))
    assert (
        format_progress("grpo-arith", lm)
        == "grpo-arith  update 12/200  6%  reward 0.41  eval 0.35  v12"
    )


def test_record_drops_non_finite_headline_values_and_rejects_other_structs() -> None:
    r = progress_record(
        "l", unit="update", done=1, total=2, version=0, headline=[("x", float("nan"))]
    )
    progress = Progress.from_fields(json_format.MessageToDict(r))
    assert progress is not None and progress.headline == ()
    assert Progress.from_fields({"service": "hb", "seq": 3}) is None


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_one_line_per_interval_with_eta_from_the_rate() -> None:
    out, clock = io.StringIO(), Clock()
    console = Console(out, "cartpole-ppo", interval_s=5.0, clock=clock)
    console.progress(record(1000))  # the first line at once
    for i in range(1, 10):  # 10 records a second for 0.9 s: held back
        clock.t += 0.1
        console.progress(record(1000 + 100 * i))
        assert not console.tick()
    assert len(out.getvalue().splitlines()) == 1
    clock.t = 1005.0
    assert console.tick()  # due: the latest record, with the rate over what was seen
    clock.t += 1.0
    assert not console.tick()  # nothing newer
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("cartpole-ppo  step 1k/300k  0%  ") and "ETA" not in lines[0]
    # 900 steps in 0.9 s: 1000 steps/s, 298.1k left: 298 s
    assert lines[1] == (
        "cartpole-ppo  step 1.9k/300k  0%  EpRewMean 475.0  EpLenMean 475.0  FPS 1.29k  v84  "
        "ETA 4m58s"
    )
    clock.t += 1.0
    console.progress(record(3000))  # newer, but within the interval of the last line
    assert len(out.getvalue().splitlines()) == 2
    console.close()  # the last state is shown at the end
    assert out.getvalue().splitlines()[-1].startswith("cartpole-ppo  step 3k/300k")


def test_events_metrics_hidden_struct_shown_verbose_all_and_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    out = io.StringIO()
    console = Console(out, "r", metrics_path=path)
    metrics = events_pb2.Metrics(source="actor-0", step=7, scalars={"charts/SPS": 900.0})
    console.event("metrics", "rlfleet.bus.v1.Metrics", metrics, lambda: "[metrics] actor-0")
    beat = struct_pb2.Struct()
    beat.update({"service": "hb", "seq": 3})
    console.event("metrics", "google.protobuf.Struct", beat, lambda: "[metrics] service=hb seq=3")
    episode = events_pb2.EpisodeStats(source="a")
    console.event("episodes", "rlfleet.bus.v1.EpisodeStats", episode, lambda: "[episodes] a")
    resumed = events_pb2.RunStatus(source="learner", message="resumed from checkpoint at update 84")
    console.event("status", "rlfleet.bus.v1.RunStatus", resumed, lambda: None)
    console.close()
    assert out.getvalue().splitlines() == [
        "  [metrics] service=hb seq=3",
        "learner: resumed from checkpoint at update 84",
    ]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["service"], r["kind"]) for r in rows] == [("actor-0", "metrics"), ("hb", "metrics")]
    assert rows[0]["values"] == {"charts/SPS": 900.0} and rows[0]["step"] == 7
    assert rows[1]["values"] == {"seq": 3.0} and isinstance(rows[1]["time"], float)

    out = io.StringIO()
    verbose = Console(out, "r", verbose=True)
    verbose.event("metrics", "rlfleet.bus.v1.Metrics", metrics, lambda: "[metrics] actor-0")
    verbose.event("episodes", "rlfleet.bus.v1.EpisodeStats", episode, lambda: "[episodes] a")
    assert out.getvalue().splitlines() == ["  [metrics] actor-0", "  [episodes] a"]


def test_live_line_on_a_terminal() -> None:
    out, clock = io.StringIO(), Clock()
    console = Console(out, "r", live=True, clock=clock)
    console.start()
    console.line("rlfleet: hello")
    console.progress(record(21_504))
    console.close()
    text = out.getvalue()
    assert "rlfleet: hello" in text and "r  step 21.5k/300k  7%" in text


def status(source: str, message: str) -> events_pb2.RunStatus:
    return events_pb2.RunStatus(source=source, state=events_pb2.RUN_STATE_STARTING, message=message)


def struct_event(console: Console, record: struct_pb2.Struct) -> None:
    console.event("progress", "google.protobuf.Struct", record, lambda: None)


def test_start_up_phases_print_in_order_and_a_counted_phase_gets_its_own_eta() -> None:
    """What an LM run shows before its first update: phases as `<source>: <message>` lines, the
    SFT steps as a progress line without a policy version, then the update line, whose ETA
    follows the updates only (not the rate of the SFT steps before them)."""
    out, clock = io.StringIO(), Clock()
    console = Console(out, "grpo-arith", interval_s=0.0, clock=clock)
    status_event = "rlfleet.bus.v1.RunStatus"
    console.event("status", status_event, status("learner", "loading model m"), lambda: None)
    for t, done in ((1000.0, 3), (1001.0, 5)):
        clock.t = t
        sft = progress_record(
            "learner", unit="sft step", done=done, total=5, version=None,
            headline=[("sft_loss", 2.5)],
        )  # fmt: skip
        struct_event(console, sft)
    console.event("status", status_event, status("learner", "SFT done in 1.0 s"), lambda: None)
    console.event("status", status_event, status("sampler-0", "warming up"), lambda: None)
    clock.t = 1011.0
    struct_event(console, progress_record("learner", unit="update", done=8, total=200, version=8))
    clock.t = 1021.0
    struct_event(console, progress_record("learner", unit="update", done=9, total=200, version=9))
    assert out.getvalue().splitlines() == [
        "learner: loading model m",
        "grpo-arith  sft step 3/5  60%  sft_loss 2.50",
        "grpo-arith  sft step 5/5  100%  sft_loss 2.50  ETA 0s",
        "learner: SFT done in 1.0 s",
        "sampler-0: warming up",
        "grpo-arith  update 8/200  4%  v8",  # one update seen: no rate yet
        "grpo-arith  update 9/200  4%  v9  ETA 31m50s",  # 0.1 update/s, 191 left
    ]


def test_a_finished_phase_s_last_line_goes_out_before_the_next_phase() -> None:
    """A status message shows a held-back progress line first when that line ends its phase
    (not otherwise: the interval still holds for a phase under way)."""
    out, clock = io.StringIO(), Clock()
    console = Console(out, "r", interval_s=5.0, clock=clock)
    console.progress(record(1000))  # shown at once
    clock.t += 1.0
    console.progress(record(2000))  # held back: within the interval
    notice = events_pb2.RunStatus(source="sampler-0", message="warming up")
    console.event("status", "rlfleet.bus.v1.RunStatus", notice, lambda: None)
    clock.t += 1.0
    console.progress(record(300_000))  # the last step, held back
    done = events_pb2.RunStatus(source="learner", message="SFT done in 50.7 s")
    console.event("status", "rlfleet.bus.v1.RunStatus", done, lambda: None)
    lines = out.getvalue().splitlines()
    assert [line.split("  ")[1] for line in lines[::2]] == ["step 1k/300k", "step 300k/300k"]
    assert lines[1::2] == ["sampler-0: warming up", "learner: SFT done in 50.7 s"]


def test_non_finite_metrics_are_null_and_flagged_in_metrics_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    console = Console(io.StringIO(), "r", metrics_path=path)
    scalars = {"losses/pg_loss": float("nan"), "losses/kl": float("inf"), "charts/SPS": 900.0}
    metrics = events_pb2.Metrics(source="learner", step=14, scalars=scalars)
    console.event("metrics", "rlfleet.bus.v1.Metrics", metrics, lambda: None)
    console.close()

    def strict(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    (row,) = [json.loads(line, parse_constant=strict) for line in path.read_text().splitlines()]
    assert row["values"] == {"losses/pg_loss": None, "losses/kl": None, "charts/SPS": 900.0}
    assert row["nonfinite"] == ["losses/kl", "losses/pg_loss"]
