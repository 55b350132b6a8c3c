"""`--stop-by TIME`: read as one absolute UTC time, budgeted at each step boundary with the
measured save and step times plus a margin, reported as the reason the run stopped."""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime, timedelta

import pytest

from qwentitan.launch.base.deadline import format_utc, parse_stop_by
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.request import RunRequest

NOW = datetime(2026, 12, 3, 6, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("+90m", NOW + timedelta(minutes=90)),
        ("+1h30m", NOW + timedelta(hours=1, minutes=30)),
        ("+45s", NOW + timedelta(seconds=45)),
        ("+100", NOW + timedelta(seconds=100)),
        ("+2h", NOW + timedelta(hours=2)),
        ("2026-12-03T18:00:00Z", datetime(2026, 12, 3, 18, tzinfo=UTC)),
        ("2026-12-03 18:00:00+00:00", datetime(2026, 12, 3, 18, tzinfo=UTC)),
        ("2026-12-03T20:00:00+02:00", datetime(2026, 12, 3, 18, tzinfo=UTC)),  # the same moment
        ("2026-12-03T13:30-04:30", datetime(2026, 12, 3, 18, tzinfo=UTC)),
    ],
)
def test_stop_by_reads_utc_times_and_durations(text, expected):
    assert parse_stop_by(text, NOW) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("+", "is not a duration"),
        ("+10 minutes", "is not a duration"),
        ("tomorrow", "is not a time"),
        ("2026-12-03T18:00:00", "names no UTC offset"),
        ("+99999999999h", "lies beyond the year 9999"),
        ("+" + "9" * 5000 + "s", "lies beyond the year 9999"),
        ("9999-12-31T23:00:00-02:00", "lies beyond the year 9999"),
    ],
)
def test_a_stop_by_that_is_not_a_utc_time_is_one_sentence(text, says):
    with pytest.raises(LaunchError) as error:
        parse_stop_by(text, NOW)
    assert error.value.field == "stop_by" and says in str(error.value)


def test_the_request_holds_an_absolute_time_and_passes_it_to_the_ranks():
    before = datetime.now(UTC)
    request = RunRequest(recipe="tiny_dense", stop_by="+90m")
    held = parse_stop_by(request.stop_by)
    assert timedelta(minutes=89) < held - before < timedelta(minutes=91)
    words = request.trainer_overrides()
    assert words[words.index("--stop-by") + 1] == request.stop_by == format_utc(held)
    # A request built again from it (a plan file, `replace`) keeps the same moment.
    assert request.replace(steps=3).stop_by == request.stop_by


def test_a_passed_stop_by_is_refused_on_the_command_line(capsys):
    from qwentitan.launch.launcher import cli

    assert cli.main(["train", "--stop-by", "2020-01-01T00:00:00Z"]) == 2
    err = capsys.readouterr().err
    assert "--stop-by 2020-01-01T00:00:00Z has already passed" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_stop_by_beyond_the_calendar_is_one_sentence_on_the_command_line(capsys):
    from qwentitan.launch.launcher import cli

    assert cli.main(["plan", "--recipe", "tiny_dense", "--stop-by", "+99999999999h"]) == 2
    err = capsys.readouterr().err
    assert "--stop-by '+99999999999h' lies beyond the year 9999" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_slurm_refuses_a_duration_that_would_count_from_writing_the_script(capsys, tmp_path):
    from qwentitan.launch.launcher import cli

    code = cli.main(["slurm", "--recipe", "tiny_dense", "--stop-by", "+2h",
                     "--output", str(tmp_path / "job.sbatch")])  # fmt: skip
    assert code == 2
    assert "needs an absolute UTC time" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


class TestStopClock:
    def clock(self, *, left: float, save_s: float = 2.0):
        from qwentitan.launch.runtime.stop_clock import StopClock

        return StopClock(deadline=1000.0 + left, save_s=save_s, margin_s=10.0)

    def test_stops_when_a_step_a_save_and_the_margin_no_longer_fit(self):
        clock = self.clock(left=100.0)
        clock.boundary(now=1000.0)  # training starts
        clock.boundary(now=1030.0)  # step 1, compilation included: 30 s
        assert clock.step_s == 30.0
        assert not clock.due(now=1030.0)  # 30 + 2 + 10 < 70 left
        assert clock.due(now=1058.0)  # 30 + 2 + 10 >= 42 left
        clock.boundary(now=1031.0)  # step 2: 1 s; the first step's compile no longer counts
        assert clock.step_s == 1.0 and not clock.due(now=1080.0)
        assert clock.due(now=1088.0)  # 1 + 2 + 10 >= 12 left

    def test_while_the_first_step_runs_its_time_so_far_counts(self):
        clock = self.clock(left=100.0)
        clock.boundary(now=1000.0)  # training starts; validation of step 1 asks at 1060
        assert not clock.due(now=1020.0)  # 20 s so far: 1020 + 20 + 2 + 10 < 1100
        assert clock.due(now=1045.0)  # 45 s so far: 1045 + 45 + 2 + 10 >= 1100
        assert clock.decision["step_s"] == 45.0  # the report says the step it counted

    def test_a_timed_save_replaces_the_estimate_and_leaves_the_step_time(self):
        clock = self.clock(left=100.0, save_s=50.0)
        clock.boundary(now=1000.0)
        clock.boundary(now=1001.0)
        clock.boundary(now=1002.0)
        assert clock.due(now=1040.0)  # the estimate: 1 + 50 + 10 >= 60 left
        clock.saved(5.0)  # the interval save after step 3 took 5 s
        clock.boundary(now=1008.0)
        assert (clock.save_s, clock.save_measured, clock.step_s) == (5.0, True, 1.0)
        assert not clock.due(now=1040.0)

    def test_the_report_keeps_the_figures_the_stop_was_decided_on(self):
        clock = self.clock(left=100.0, save_s=3.0)
        clock.boundary(now=1000.0)
        clock.boundary(now=1001.0)
        clock.boundary(now=1002.0)
        assert not clock.due(now=1080.0) and clock.decision is None  # 1 + 3 + 10 < 20 left
        assert clock.due(now=1087.0)  # 1 + 3 + 10 >= 13 left
        clock.saved(0.5)  # the stop's own save, faster than the last one
        assert clock.due(now=1096.0)  # asked again: the first answer's figures are kept
        assert clock.decision == clock.figures(now=1087.0) | {"save_s": 3.0, "save_measured": False}
        assert clock.decision["seconds_left"] == 13.0

    def test_the_slowest_recent_step_counts(self):
        clock = self.clock(left=100.0)
        for now in (1000.0, 1001.0, 1002.0, 1009.0, 1010.0):  # a validation step of 7 s
            clock.boundary(now=now)
        assert clock.step_s == 7.0
        figures = clock.figures(now=1010.0)
        assert figures["seconds_left"] == 90.0 and figures["save_measured"] is False

    def test_the_estimate_counts_the_ranks_state_and_the_optimizers_moments(self):
        import torch

        from qwentitan.launch.runtime.stop_clock import (
            ASSUMED_WRITE_BYTES_PER_S,
            StopClock,
            state_bytes,
        )

        params = [torch.zeros(10, 10), torch.zeros(5, dtype=torch.bfloat16)]
        assert state_bytes(params) == (400 + 10) * 3
        clock = StopClock.until(format_utc(datetime.now(UTC) + timedelta(hours=1)), 10**9)
        assert clock.save_s == pytest.approx(1e9 / ASSUMED_WRITE_BYTES_PER_S)
        assert 3590 < clock.deadline - time.time() <= 3600


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_only_saves_that_wrote_are_timed(tmp_path):
    import torch

    from .conftest import guarded_manager

    manager = guarded_manager(tmp_path, {"w": torch.ones(4)}, interval=2)
    assert manager.save(1) is False and manager.save_seconds == []
    assert manager.save(2, last_step=True) is True and len(manager.save_seconds) == 1
    assert manager.save_seconds[0] >= 0
    manager.close()


def test_the_summary_says_why_the_run_stopped():
    from qwentitan.launch.tracking.summary import format_summary

    block = format_summary({"stopped": "after step 7: --stop-by deadline"}, None)
    assert "  stopped" in block and "after step 7: --stop-by deadline; --resume continues" in block
    assert "stopped" not in format_summary({}, None)


@pytest.mark.parametrize(
    ("cause", "age_s", "expected"),
    [("deadline", 0, 75), ("spot", 0, 75), ("signal", 0, 0), ("deadline", -3600, 0)],
)
def test_run_exits_as_stopped_after_a_deadline_or_spot_stop(
    cause, age_s, expected, tmp_path, monkeypatch
):
    """The ranks exit 0 after any stop; the launcher tells a deadline or a spot notice from a
    finished run by the ranks' stop report of this launch (an earlier run's does not count)."""
    import os
    from types import SimpleNamespace

    from qwentitan.launch.launcher import start, supervisor

    report = tmp_path / "reports" / "stop.json"

    def ranks(argv, env, **_):
        report.parent.mkdir()
        report.write_text(json.dumps({"step": 3, "cause": cause}))
        os.utime(report, (time.time() + age_s,) * 2)
        return 0

    monkeypatch.setattr(supervisor, "supervise", ranks)
    plan = SimpleNamespace(run_folder=tmp_path, launch_argv=list, rank_env=dict)
    assert start.launch(plan, stopped_exit=supervisor.STOPPED_EXIT) == expected


def test_a_stop_by_inside_the_exit_margin_is_refused_at_plan_time(capsys):
    """The ranks keep 30 s after their last save to exit: a deadline closer than that would be
    missed by the first save (a run started, trained step 1 and saved after it)."""
    from qwentitan.launch.launcher import cli

    assert cli.main(["plan", "--recipe", "tiny_dense", "--stop-by", "+20s"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(
        r"qwentitan-launch plan: --stop-by \+20s leaves (19|20) s, within the 30 s a run keeps "
        r"after its last save for the ranks to exit; pass a later time, such as --stop-by \+10m\.",
        err,
    ), err
