"""Encoder logs recorded by the loop through the emulator, replayed bit-for-bit; the real
servo logs imported and replayed; bad logs refused with one line."""

import numpy as np
import pytest

from soarm import REPO_ROOT, cli
from soarm.export.runtime import PolicyRuntime
from soarm.logs import EncoderLogWriter, LogError, read_log
from soarm.robot.loop import ControlLoop
from soarm.robot.replay import import_bam, replay_decisions
from soarm.robot.safety import SafetyCfg, SafetyLayer
from tests.helpers import calibrated_arm

pytestmark = pytest.mark.bus

REAL_LOGS = sorted((REPO_ROOT / "data" / "real_servo_logs").glob("*.json"))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tiny_policy):
    from soarm.description import load_robot

    robot = load_robot()
    path = tmp_path_factory.mktemp("log") / "run.mcap"
    with calibrated_arm(robot, seed=4) as (emu, bus, cal):
        loop = ControlLoop(bus, PolicyRuntime(tiny_policy), cal, SafetyLayer.for_arm(SafetyCfg(), robot, cal),
                           target=lambda: np.array([0.2, 0.05, 0.12], dtype=np.float32))
        loop.start()
        writer = EncoderLogWriter(path, loop.log_header())
        loop.recorder = writer
        loop.run(seconds=1.0)
        writer.close()
    return path


def test_log_round_trip_and_exact_replay(recorded, tiny_policy):
    header, ticks = read_log(recorded)
    assert header["source"] == "soarm" and len(ticks) >= 25
    assert all(x is not None for x in (ticks[0].raw, ticks[0].q, ticks[0].target, ticks[0].goal_sent))
    report = replay_decisions(header, ticks, PolicyRuntime(tiny_policy))
    assert report["ticks_differing"] == 0 and report["max_abs_diff_rad"] < 1e-5, report


def test_replay_with_another_policy_shows_where_it_differs(recorded, tiny_policy, tmp_path):
    header, ticks = read_log(recorded)
    for t in ticks:                                   # as if another target had been commanded
        t.target = [0.3, -0.1, 0.25]
    report = replay_decisions(header, ticks, PolicyRuntime(tiny_policy))
    assert report["ticks_differing"] > 0 and report["first_difference_tick"] is not None


def test_bad_logs_are_one_line_errors(recorded, tmp_path):
    data = recorded.read_bytes()
    (tmp_path / "cut.mcap").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.mcap").write_text("hello")
    for name, words in (("cut.mcap", "truncated"), ("text.mcap", "truncated"), ("none.mcap", "no such")):
        with pytest.raises(LogError) as e:
            read_log(tmp_path / name)
        assert words in str(e.value) and name in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("log", REAL_LOGS, ids=lambda p: p.stem)
def test_real_servo_logs_import_and_replay_through_the_cli(log, tiny_policy, tmp_path, capsys):
    header, ticks = import_bam(log)
    assert len(ticks) > 100 and header["source"].startswith("bam-import")
    plot = tmp_path / "replay.png"
    assert cli.main(["replay", str(log), "--policy", str(tiny_policy), "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 10_000 and "ticks differ" in capsys.readouterr().out


def test_truncated_real_log_is_refused(tmp_path, tiny_policy, capsys):
    bad = tmp_path / "cut.json"
    bad.write_text(REAL_LOGS[0].read_text()[:1000])
    assert cli.main(["replay", str(bad), "--policy", str(tiny_policy)]) == 2
    err = capsys.readouterr().err.strip()
    assert "cut.json" in err and err.count("\n") == 0


@pytest.mark.parametrize("log", REAL_LOGS[:3], ids=lambda p: p.stem)
def test_real_encoder_streams_through_the_deployed_pipeline_stay_inside_the_clamps(log):
    """Real encoder data (the BAM logs) through observation -> shipped policy -> safety, as
    on the arm: every recomputed command is inside the limits and the per-tick cap, and a
    clamp event is reported exactly where the policy asked for more."""
    from soarm.calibration.calibration import MotorCalibration
    from soarm.description import load_robot
    from soarm.robot.safety import SafetyCfg, SafetyLayer

    header, ticks = import_bam(log)
    report = replay_decisions(header, ticks, PolicyRuntime(REPO_ROOT / "data" / "policies" / "reach.onnx"))
    _, _, recomputed, _, _ = report["_series"]
    cal = {n: MotorCalibration(**c) for n, c in header["calibration"].items()}
    cfg = SafetyCfg(**header["safety"]) if "safety" in header else SafetyCfg()
    limits = SafetyLayer.for_arm(cfg, load_robot(), cal)
    sent = recomputed[np.isfinite(recomputed).all(1)]
    assert len(sent) > 100
    assert (sent >= limits.lower - 1e-9).all() and (sent <= limits.upper + 1e-9).all()
    step = np.abs(np.diff(sent, axis=0))
    assert (step <= cfg.max_step + 1e-6).all()
    at_cap = int(np.isclose(step, cfg.max_step, atol=1e-6).any(1).sum())
    # A goal moves by exactly the cap only when limited: the rate limit, or a velocity-cap hold.
    assert report["events"].get("rate_limit", 0) + report["events"].get("velocity_cap", 0) >= at_cap
