"""Real-arm logs: NVIDIA SAGE's SO-101 motions read into the one log type, bad files refused in
one line naming the file, the row and the field; `soarm arm-check` on them."""

import gzip
import json
import math

import numpy as np
import pytest

from soarm import REPO_ROOT, cli
from soarm.logs import SAGE_JOINTS, LogError, read_motion, read_sage

SAGE = REPO_ROOT / "data" / "sage_so101"


def write_sage(folder, rows=20, joints=6, gz=True, edit=lambda name, lines: lines):
    """A SAGE motion folder: `rows` ticks at 50 Hz, a slow sine on every joint."""
    folder.mkdir(parents=True, exist_ok=True)
    t = np.arange(rows) * 20_000.0 + 5.0
    goal = [[0.1 * math.sin(k / 10)] * joints for k in range(rows)]
    files = {"control": ["type,timestamp,positions"] +
             [f'CONTROL,{s},"{json.dumps(g)}"' for s, g in zip(t, goal)],
             "state_motor": ["type,timestamp,positions,velocities,torques"] +
             [f'STATE_MOTOR,{s},"{json.dumps(g)}","{json.dumps([0.0] * joints)}","{json.dumps([0.0] * joints)}"'
              for s, g in zip(t, goal)]}
    for name, lines in files.items():
        text = "\n".join(edit(name, lines)) + "\n"
        path = folder / f"{name}.csv{'.gz' if gz else ''}"
        path.write_bytes(gzip.compress(text.encode())) if gz else path.write_text(text)
    return folder


def replace_row(which, k, old, new):
    return lambda name, lines: [l.replace(old, new, 1) if name == which and i == k else l for i, l in enumerate(lines)]


def test_a_sage_motion_reads_into_the_one_log_type_in_this_projects_convention():
    log = read_motion(SAGE / "static_holding")
    assert log.joints == list(SAGE_JOINTS[:5]) and log.goal.shape == log.measured.shape == (len(log.t), 5)
    assert log.t[0] == 0 and np.all(np.diff(log.t) > 0.019) and log.rate_hz == 50
    # Readings: SAGE's 4096-a-turn radians on LeRobot's 4095-a-turn scale, whole or half ticks
    # from the middle of the range; goals: the tick the servo was sent.
    for x in (log.measured, log.goal):
        half_ticks = x * 4095 / math.pi
        np.testing.assert_allclose(half_ticks, np.round(half_ticks), atol=1e-6)
    assert log.rig["registers"]["acceleration"] == 0
    # The bus reads each joint in turn after writing every goal: later joints later in the tick.
    assert np.all(np.diff(log.read_delay) > 0) and log.read_delay[0] > log.goal_delay[-1] > 0


def test_plain_and_compressed_files_read_the_same(tmp_path):
    a, b = read_sage(write_sage(tmp_path / "gz")), read_sage(write_sage(tmp_path / "plain", gz=False))
    np.testing.assert_array_equal(a.measured, b.measured)
    np.testing.assert_array_equal(a.goal, b.goal)


@pytest.mark.parametrize("edit, file, words", [
    (lambda name, lines: ["type,timestamp"] + lines[1:] if name == "control" else lines, "control.csv.gz",
     ["row 0", "header"]),
    (lambda name, lines: lines[:-3] if name == "state_motor" else lines, "state_motor.csv.gz", ["17 rows", "20"]),
    (replace_row("control", 5, "80005.0", "1.0"), "control.csv.gz", ["row 5", "'timestamp'", "backwards"]),
    (replace_row("state_motor", 7, "[", "[NaN, "), "state_motor.csv.gz", ["row 7", "'positions'"]),
    (replace_row("control", 3, "[", "[0.1, "), "control.csv.gz", ["row 3", "'positions'", "7 joints, expected 6"]),
    (replace_row("state_motor", 9, "STATE_MOTOR,160005.0,", "STATE_MOTOR,1.6e5x,"), "state_motor.csv.gz",
     ["row 9", "'timestamp'"]),
])
def test_a_broken_sage_file_is_one_line_naming_the_file_the_row_and_the_field(tmp_path, edit, file, words):
    folder = write_sage(tmp_path / "m", edit=edit)
    with pytest.raises(LogError) as e:
        read_sage(folder)
    msg = str(e.value)
    assert "\n" not in msg and file in msg and all(w in msg for w in words), msg


def test_a_folder_without_sage_files_and_a_joint_count_other_than_six_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(LogError, match="not a SAGE motion folder"):
        read_motion(tmp_path / "empty")
    with pytest.raises(LogError, match="5 joints, expected 6"):
        read_sage(write_sage(tmp_path / "five", joints=5))


def test_arm_check_prints_a_line_per_log_then_the_mean_and_writes_nothing_on_bad_input(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert cli.main(["arm-check", str(SAGE / "ramp_motion"), "--arm", "nominal", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].split()[0] == "ramp_motion" and lines[1].split()[0] == "mean"
    values = [float(x) for x in lines[0].split()[1:]]
    assert len(values) == 6 and values[0] == pytest.approx(np.mean(values[1:]), abs=0.01)
    assert json.loads(out.read_text())["rms_mrad"]["ramp_motion"]["shoulder_lift"] == pytest.approx(values[2], abs=0.01)
    bad = write_sage(tmp_path / "bad", edit=replace_row("control", 3, "[", "[0.1, "))
    assert cli.main(["arm-check", str(bad), "--arm", "nominal", "--out", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "row 3" in err[0] and not (tmp_path / "bad.json").exists()


def test_sysid_scores_each_left_out_motion_whole_with_a_fit_that_never_saw_it():
    """Leave-motions-out as `arm-check` replays a motion: the whole log, from its first pose."""
    from soarm.calibration.sysid import held_out_folds
    from soarm.calibration.windows import cut_windows
    from soarm.description import load_robot

    robot, dt = load_robot(), 1 / 180
    logs = [read_motion(SAGE / name) for name in ("ramp_motion", "triangle_wave", "velocity_ramp")]
    w = cut_windows(logs, robot, 10.0, 2.0, dt, per_log=2)
    folds = held_out_folds(w, 2, logs, robot, dt)
    assert len(folds) == 2 and sorted(n for f in folds for n in f.scored.log) == sorted(set(w.log))
    for fold in folds:
        assert not set(fold.scored.log) & {w.log[i] for i in fold.fitted}        # never fitted on
        for name, source, valid in zip(fold.scored.log, fold.scored.source, fold.scored.valid):
            log = next(m for m in logs if m.source.endswith(name))
            assert source.startswith(f"{name}:0.0-") and int(valid.sum()) == len(log.t)   # whole


def test_the_default_model_is_the_arm_identified_on_sage_and_nominal_stays_the_servo_model(monkeypatch, capsys):
    """`arm-check` without `--arm` replays configs/arm/so101_sage.yaml (the task's `arm:`), as
    the issue's command names it from the repository root; `--arm nominal` the servo model."""
    monkeypatch.chdir(REPO_ROOT)
    means = {}
    for arm in (None, "configs/arm/so101_sage.yaml", "nominal"):
        assert cli.main(["arm-check", str(SAGE / "ramp_motion")] + ([] if arm is None else ["--arm", arm])) == 0
        means[arm] = float(capsys.readouterr().out.strip().splitlines()[-1].split()[1])
    assert means[None] == means["configs/arm/so101_sage.yaml"] < 0.5 * means["nominal"], means


# ---------------------------------------------------------------- LeRobot datasets
LEROBOT_NAMES = [f"{j}.pos" for j in SAGE_JOINTS]


def write_lerobot(root, episodes=2, frames=40, version="v3.0", names=LEROBOT_NAMES, action=None):
    """A LeRobot v3 dataset's layout as LeRobot writes it (meta/info.json, one parquet data
    file); tests/test_lerobot_client.py reads one LeRobot's own code wrote."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "meta").mkdir(parents=True)
    (root / "data" / "chunk-000").mkdir(parents=True)
    feature = {"dtype": "float32", "shape": [len(names)], "names": names}
    (root / "meta" / "info.json").write_text(json.dumps({
        "codebase_version": version, "robot_type": "so101_follower", "fps": 30,
        "features": {"action": feature, "observation.state": feature}}))
    ep = np.repeat(np.arange(episodes), frames)
    k = np.tile(np.arange(frames), episodes)
    state = np.stack([10.0 * np.sin(k / 7 + j) for j in range(len(names))], axis=1)
    act = state + 1.0 if action is None else action(state)
    pq.write_table(pa.table({"episode_index": ep, "frame_index": k, "timestamp": (k / 30).astype(np.float32),
                             "action": act.astype(np.float32).tolist(),
                             "observation.state": state.astype(np.float32).tolist()}),
                   root / "data" / "chunk-000" / "file-000.parquet")
    return root


def test_a_lerobot_dataset_reads_as_one_motion_per_episode_in_radians(tmp_path):
    from soarm.logs import read_motions

    logs = read_motions(write_lerobot(tmp_path / "ds"))
    assert [log.source.rsplit("/", 1)[1] for log in logs] == ["episode_000000", "episode_000001"]
    log = logs[1]
    assert log.joints == list(SAGE_JOINTS[:5]) and log.rate_hz == 30 and len(log.t) == 40   # no gripper
    assert np.allclose(log.t, np.arange(40) / 30, atol=1e-6)
    k = np.arange(40)
    assert np.allclose(np.degrees(log.measured[:, 2]), 10 * np.sin(k / 7 + 2), atol=1e-4)
    assert np.allclose(np.degrees(log.goal - log.measured), 1.0, atol=1e-4)
    assert log.rig["registers"] == {"p": 16, "i": 0, "d": 32, "acceleration": 254}    # what LeRobot writes


@pytest.mark.parametrize("case, words", [
    ("old_format", "LeRobot dataset format v2.1; this reads v3"),
    ("no_arm_names", "feature 'action' names"),
    ("nan", "episode_000000: row 3, field 'action': not finite"),
    ("no_data", "no .parquet files"),
    ("garbage", "file-000.parquet: unreadable"),
    ("bad_json", "info.json: not valid JSON"),
])
def test_a_broken_lerobot_dataset_is_one_line_and_stays_as_it_was(tmp_path, case, words):
    from soarm.logs import read_lerobot

    root = tmp_path / "ds"

    def nan_at_3(state):
        out = state + 1.0
        out[3, 0] = np.nan
        return out
    write_lerobot(root, version="v2.1" if case == "old_format" else "v3.0",
                  names=[f"motor_{i}" for i in range(6)] if case == "no_arm_names" else LEROBOT_NAMES,
                  action=nan_at_3 if case == "nan" else None)
    data = root / "data" / "chunk-000" / "file-000.parquet"
    if case == "no_data":
        data.unlink()
    elif case == "garbage":
        data.write_bytes(b"PAR1 not really")
    elif case == "bad_json":
        (root / "meta" / "info.json").write_text("{")
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with pytest.raises(LogError) as e:
        read_lerobot(root)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def test_a_lerobot_dataset_in_range_mode_reads_through_its_calibration(tmp_path, capsys):
    """use_degrees off: LeRobot's -100..100 per joint (MotorsBus._normalize, 0.6.1; drive_mode
    flips it), back to radians through the calibration file: `--lerobot-calibration`."""
    from soarm.calibration.calibration import MotorCalibration, range_mode, save, ticks_to_rad
    from soarm.logs import read_lerobot

    cal = {n: MotorCalibration(i + 1, int(n == "elbow_flex"), 0, 1000 + 10 * i, 3000 - 10 * i)
           for i, n in enumerate(SAGE_JOINTS)}
    save(cal, tmp_path / "cal.json")
    root = write_lerobot(tmp_path / "ds")
    logs = read_lerobot(root, range_mode(tmp_path / "cal.json"))
    state = np.degrees(read_lerobot(root)[0].measured)                  # the -100..100 values as written
    for j, name in enumerate(SAGE_JOINTS[:5]):
        c = cal[name]
        norm = -state[:, j] if c.drive_mode else state[:, j]
        ticks = (norm + 100) / 200 * (c.range_max - c.range_min) + c.range_min
        assert np.allclose(logs[0].measured[:, j], ticks_to_rad(c, ticks), atol=1e-9), name
    assert cli.main(["arm-check", str(root), "--lerobot-calibration", str(tmp_path / "cal.json")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("mean ")
