"""The bus driver on the real Feetech SDK, over a real pseudo-terminal, against our emulator."""

import os
import subprocess
import sys

import pytest

from soarm.robot import control_table as ct
from soarm.robot.bus import BusError, FeetechBus
from soarm.robot.emulator import FaultCfg, ServoBusEmulator

pytestmark = pytest.mark.bus

IDS = {"shoulder_pan": 1, "shoulder_lift": 2, "elbow_flex": 3, "wrist_flex": 4, "wrist_roll": 5, "gripper": 6}


@pytest.fixture
def emu():
    with ServoBusEmulator() as e:
        yield e


def connect(port, ids=IDS):
    bus = FeetechBus(port, ids)
    bus.connect()
    return bus


def test_sign_magnitude_round_trip():
    reg = ct.STS3215["Homing_Offset"]
    for v in (0, 1, -1, 2047, -2047):
        assert ct.from_bytes(reg, ct.to_bytes(reg, v)) == v
    assert ct.to_bytes(reg, -5) == [5, 0x08]                 # sign in bit 11
    with pytest.raises(ValueError):
        ct.to_bytes(ct.STS3215["Torque_Enable"], 300)


def test_connect_and_read_present_positions(emu):
    bus = connect(emu.port)
    bus.enable_torque()                          # hold still, so the readings can be compared
    assert emu.wait(0.2)                         # simulated seconds: the same on any machine
    pos = bus.sync_read("Present_Position")
    assert list(pos) == list(IDS.values())
    for sid, p in pos.items():
        assert abs(p - emu.raw_position(sid)) <= 2           # homing offset 0: the raw reading
    assert bus.read("Model_Number", 3) == ct.MODEL_STS3215
    bus.close()


def test_eeprom_writes_apply_at_once_and_last_only_when_unlocked(emu):
    """Feetech's memory table, Lock (address 55): a write to EEPROM takes effect either way;
    only one made with Lock = 0 is still there after the supply is switched off and on."""
    bus = connect(emu.port)
    raw = emu.raw_position(4)
    bus.write("Homing_Offset", 4, 100)                       # locked, as powered up: applies
    assert bus.read("Homing_Offset", 4) == 100
    assert bus.read("Present_Position", 4) == (emu.raw_position(4) - 100) % 4096
    emu.power_cycle()
    assert bus.read("Homing_Offset", 4) == 0                 # not saved
    bus.write("Lock", 4, 0)
    bus.write("Homing_Offset", 4, -100)
    bus.write("Lock", 4, 1)
    emu.power_cycle()
    assert bus.read("Homing_Offset", 4) == -100 and bus.read("Lock", 4) == 1
    assert bus.read("Present_Position", 4) == (emu.raw_position(4) + 100) % 4096
    assert abs(emu.raw_position(4) - raw) < 5                # nothing moved (torque off, at rest)


def test_torque_on_holds_where_it_is_and_the_goal_register_says_so(emu):
    bus = connect(emu.port)
    held = bus.enable_torque()
    for sid in IDS.values():
        assert abs(bus.read("Goal_Position", sid) - held[sid]) <= 2
    assert bus.read("Overload_Torque", 1) == 80 and bus.read("Protection_Time", 1) == 200   # Feetech's defaults
    assert bus.torque_off()


def test_the_registers_a_host_writes_drive_that_servos_physics(emu):
    """P, Torque_Limit and Acceleration as written reach the servo model, joint by joint:
    the plant used to run on the YAML's values whatever was written."""
    bus = connect(emu.port)
    held = bus.enable_torque()
    bus.write("Torque_Limit", 1, 0)                           # the pan: no torque at all
    bus.write("P_Coefficient", 5, 0)                          # the wrist roll: no position gain
    bus.sync_write("Goal_Position", {1: held[1] + 300, 5: held[5] + 300, 4: held[4] + 300})
    assert emu.wait(1.0)
    now = bus.sync_read("Present_Position")
    assert abs(now[1] - held[1]) < 10 and abs(now[5] - held[5]) < 10, (held, now)   # neither moved
    assert abs(now[4] - (held[4] + 300)) < 40, (held, now)                         # an untouched one did
    bus.write("Torque_Limit", 1, 1000)
    assert emu.wait(1.0)                                      # there at once: its profile ran meanwhile
    start = bus.read("Present_Position", 1)
    assert abs(start - (held[1] + 300)) < 40
    bus.write("Acceleration", 1, 1)                           # 100 ticks/s^2: 300 ticks back take ~3.5 s
    bus.write("Goal_Position", 1, held[1])
    assert emu.wait(1.0)
    assert 10 < start - bus.read("Present_Position", 1) < 150
    assert bus.torque_off()


def test_the_firmware_cut_out_acts_on_overload_and_overcurrent(emu):
    """Overload_Torque/Protection_Time and Protection_Current/Over_Current_Protection_Time as
    written watch the servo model's duty and current: a fault sets its Status bit (and the
    status packets' error byte); Unloading_Condition decides whether it acts: an overload holds
    the drive to Protective_Torque, an overcurrent turns it off. Torque on again clears it.
    Thresholds are set low so that holding the arm out (5-10 % duty, ~0.2 A) trips them."""
    bus = connect(emu.port)
    held = bus.enable_torque()
    bus.sync_write("Goal_Position", {2: held[2] - 400, 3: held[3] + 400})      # arm out: gravity loads both
    assert emu.wait(1.0)
    assert bus.read("Present_Load", 2) != 0 and bus.read("Present_Current", 3) != 0
    assert bus.read("Status", 2) == 0 and bus.read("Status", 3) == 0
    out = bus.sync_read("Present_Position")
    bus.write("Unloading_Condition", 1, 0)                    # the pan: reports, never acts
    for sid, reg, value in ((1, "Overload_Torque", 0), (1, "Protection_Time", 20),
                            (2, "Overload_Torque", 2), (2, "Protection_Time", 20), (2, "Protective_Torque", 0),
                            (3, "Protection_Current", 5), (3, "Over_Current_Protection_Time", 20)):
        bus.write(reg, sid, value)
    bus.write("Goal_Position", 1, held[1] + 200)             # the pan moves: its duty is above 0 %
    assert emu.wait(1.0)
    assert bus.read("Status", 1) & ct.ERR_OVERLOAD and bus.read("Torque_Enable", 1) == 1
    assert abs(bus.read("Present_Position", 1) - (held[1] + 200)) < 30          # still drives
    assert bus.read("Status", 2) & ct.ERR_OVERLOAD and bus.read("Torque_Enable", 2) == 1
    assert bus.read("Status", 3) & ct.ERR_OVERCURRENT and bus.read("Torque_Enable", 3) == 0
    assert bus.read("Present_Current", 3) == 0
    bus.sync_write("Goal_Position", {2: held[2], 3: held[3]})                 # back up: neither can
    assert emu.wait(1.0)
    now = bus.sync_read("Present_Position")
    assert abs(now[2] - out[2]) < 30 and abs(now[3] - out[3]) < 30, (out, now)
    bus.write("Protection_Current", 3, 500)
    bus.write("Torque_Enable", 3, 1)                          # on again: the servo starts afresh
    assert emu.wait(0.5)
    assert bus.read("Status", 3) == 0 and bus.read("Torque_Enable", 3) == 1
    assert abs(bus.read("Present_Position", 3) - held[3]) < 30                  # drives again
    assert bus.torque_off()


def test_a_sagging_supply_drives_weaker_and_below_the_voltage_limit_is_flagged(emu):
    """`supply(V)`: every servo reads it, its motor is driven by it (the wrist roll, no ramp,
    turns slower: full duty at 5 V spins the motor at 4.0 rad/s, at 7.4 V past the profile's
    5.2), and below Min_Voltage_Limit (4.0 V) the voltage bit is set."""
    bus = connect(emu.port)
    held = bus.enable_torque()
    bus.write("Acceleration", 5, 0)

    def turned() -> int:
        bus.write("Goal_Position", 5, held[5] + 1500)
        assert emu.wait(0.3)
        moved = bus.read("Present_Position", 5) - held[5]
        bus.write("Goal_Position", 5, held[5])
        assert emu.wait(1.5)
        return moved
    fast = turned()
    emu.supply(5.0)
    slow = turned()
    assert bus.read("Present_Voltage", 2) == 50 and bus.read("Status", 2) == 0
    assert 100 < slow < 0.85 * fast, (slow, fast)
    emu.supply(3.6)
    assert all(bus.read("Status", sid) & ct.ERR_VOLTAGE for sid in IDS.values())
    emu.supply(7.4)
    assert bus.read("Status", 2) == 0
    assert bus.torque_off()


def test_torque_on_holds_then_follows_goals_within_limits(emu):
    bus = connect(emu.port)
    held = bus.enable_torque()
    assert emu.wait(0.3)
    now = bus.sync_read("Present_Position")
    assert all(abs(now[s] - held[s]) < 25 for s in held), (held, now)   # held, no jump
    bus.write("Lock", 3, 0)
    bus.write("Max_Position_Limit", 3, held[3] + 200)
    bus.write("Lock", 3, 1)
    bus.sync_write("Goal_Position", {3: held[3] + 1000})                  # beyond the limit
    assert emu.wait(1.0)
    assert abs(bus.read("Present_Position", 3) - (held[3] + 200)) < 30
    assert bus.torque_off()


def test_missing_servo_and_wrong_model_are_one_line_errors(tmp_path):
    with ServoBusEmulator(faults=FaultCfg(silent_ids=(3,))) as e:
        with pytest.raises(BusError, match=r"servo 3 \(elbow_flex\) does not answer"):
            connect(e.port)
    with ServoBusEmulator() as e:
        e.servos[5].set("Model_Number", 1020)
        with pytest.raises(BusError, match="servo 5 .* is model 1020"):
            connect(e.port)
    with ServoBusEmulator() as e:
        e.servos[2].set("Firmware_Minor_Version", 5)
        with pytest.raises(BusError, match="different firmware"):
            connect(e.port)
    with pytest.raises(BusError, match="no such serial port"):
        connect(str(tmp_path / "ttyUSB9"))


def test_wrong_baud_rate_is_a_one_line_error(emu):
    bus = FeetechBus(emu.port, IDS, baud=500_000)            # the servos listen at 1 Mbaud
    with pytest.raises(BusError, match=r"servo 1 \(shoulder_pan\) does not answer \(wrong id, wrong baud rate"):
        bus.connect()
    bus.close()
    assert emu.counters["wrong_baud"] > 0 and emu.counters["replies"] == 0
    connect(emu.port).close()                                 # the right rate works on the same port


def test_permission_denied_is_a_one_line_error(emu):
    """A port this user may not open (mode 000 here; on a fresh Linux install, a user not in
    the dialout group). Root ignores file modes, so the check runs in a child with every
    capability dropped."""
    os.chmod(emu.port, 0)
    code = ("import sys; from soarm.robot.bus import FeetechBus, BusError\n"
            f"try: FeetechBus({emu.port!r}, {{'a': 1}}).connect()\n"
            "except BusError as e: print(e); sys.exit(2)")
    drop = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []
    r = subprocess.run([*drop, sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stdout.strip() == f"{emu.port}: permission denied (add your user to the 'dialout' group)"
    assert emu.counters["packets"] == 0


def test_faulty_replies_fail_a_tick_and_the_next_one_is_clean():
    with ServoBusEmulator() as e:
        bus = connect(e.port)
        bus.enable_torque()                      # holding still: every good reading is known
        assert e.wait(0.2)
        e.faults = FaultCfg(drop=0.05, late=0.05, corrupt=0.05, seed=3)
        ok = failed = 0
        for _ in range(200):
            try:
                pos = bus.sync_read("Present_Position")
            except BusError:
                failed += 1
                continue
            ok += 1
            # Never a zero for a missing servo, never another servo's reply.
            assert all(abs(pos[s] - e.raw_position(s)) < 10 for s in pos), (pos, e.counters)
        assert failed > 0 and ok > 50, (ok, failed, e.counters)


def test_a_reply_longer_than_the_read_asked_for_is_refused(emu):
    """The SDK slices any reply from the right id to the length it asked for, so a late
    reply to a longer read passed for this one (a false 'different firmware' refusal)."""
    bus = connect(emu.port)
    emu.faults = FaultCfg(oversize=1.0)
    with pytest.raises(BusError, match=r"reading Firmware_Major_Version from servo 2 \(\w+\) failed"):
        bus.read("Firmware_Major_Version", 2)
    assert emu.counters["oversize"] >= 3
    emu.faults = FaultCfg()
    assert bus.read("Firmware_Major_Version", 2) == bus.firmware[0]
    bus.close()


def test_reg_write_waits_for_action_and_broadcast_action_applies_it(emu):
    import scservo_sdk as scs

    bus = connect(emu.port)
    bus.enable_torque()
    reg = ct.STS3215["Acceleration"]
    for sid in (1, 2):
        bus.packets.regWriteTxRx(bus.port, sid, reg.address, 1, [100])
    assert bus.read("Acceleration", 1) == 254                 # registered, not yet applied
    bus.packets.action(bus.port, scs.BROADCAST_ID)
    assert bus.read("Acceleration", 1) == 100 and bus.read("Acceleration", 2) == 100


def test_unplugged_port_raises_and_torque_off_does_not(emu):
    bus = connect(emu.port)
    emu.unplug()
    with pytest.raises(BusError):
        for _ in range(3):
            bus.sync_read("Present_Position")
    assert bus.torque_off(tries=2) is False


def test_a_second_process_on_the_same_adapter_is_refused_until_the_first_lets_go(emu):
    """Two controllers on one bus interleave their goals tick by tick (pan overshot 1.13 rad
    while both said "enabled"): the port is held exclusively, and a second open is one line."""
    first = connect(emu.port)
    script = ("import sys\nfrom soarm.robot.bus import BusError, FeetechBus\n"
              f"bus = FeetechBus({emu.port!r}, {IDS!r})\n"
              "try:\n    bus.connect()\nexcept BusError as e:\n    print(e)\n    sys.exit(2)\n")
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert other.returncode == 2 and "in use by another process" in other.stdout, other
    assert len(other.stdout.strip().splitlines()) == 1
    first.connect()                                   # our own open again: not locked out by ourselves
    first.close()
    again = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again
