"""STS3215 servo model: the firmware position loop driving a voltage-controlled DC motor.

Structure (after BAM, Duclusaud et al., ICRA 2025, extended with the registers LeRobot writes):

    encoder     position read in 4096 ticks/rev; the firmware only ever sees ticks
    profile     the internal target moves toward Goal_Position at most at the speed limit,
                with the Acceleration register's ramp (0 = no ramp)
    loop        duty = error_gain * gain_scale * (P * e + I * integral(e)) - d_gain * D * qd,
                e = target - position in rad of whole ticks, zero inside the dead-band,
                clipped to +-max_pwm * Torque_Limit/1000
    motor       tau = kt/R * (duty * V) - kt^2/R * qd       (back-EMF; none when torque is off)
    friction    viscous tau = -b * qd (torque on or off), plus Coulomb friction up to
                friction_coulomb + friction_load * |motor torque| (gearbox friction grows with
                the torque it transmits, BAM's load-dependent friction), applied implicitly by
                `integrate` so that it can stop a joint but never reverse it
    armature    reflected rotor inertia added to the joint's inertia

All tensors are batched [N, J]; every parameter may be a per-environment tensor
(domain randomization) or a float.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

TICKS_PER_REV = 4096
TICK = 2.0 * math.pi / TICKS_PER_REV           # rad per encoder tick
ACCEL_UNIT = 100.0 * TICK                      # rad/s^2 per unit of the Acceleration register


def quantize(q: torch.Tensor) -> torch.Tensor:
    """Joint angle as the encoder reports it: a whole number of ticks, in rad."""
    return torch.round(q / TICK) * TICK


@dataclass
class ServoParams:
    """Identified physical parameters of one servo type at one supply voltage."""
    kt: float = 1.21164              # N m / A (also V s / rad)
    resistance: float = 2.67617      # Ohm
    armature: float = 0.0284         # kg m^2, reflected rotor inertia
    friction_coulomb: float = 0.0524 # N m
    friction_viscous: float = 0.0591 # N m s / rad
    friction_load: float = 0.0       # extra Coulomb friction per N m of motor torque
    error_gain: float = 0.166        # duty per (P unit * rad of error)
    d_gain: float = 0.0              # duty per (D unit * rad/s)
    max_pwm: float = 0.97            # largest duty the firmware applies
    max_velocity: float = 5.2        # rad/s, profile speed with Goal_Speed = 0
    deadband_ticks: float = 1.0      # |e| <= this many ticks gives no drive
    voltage: float = 7.4             # V, supply

    def validate(self) -> None:
        for name in ("kt", "resistance", "armature", "error_gain", "max_pwm", "max_velocity", "voltage"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        for name in ("friction_coulomb", "friction_viscous", "friction_load", "d_gain", "deadband_ticks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must not be negative, got {getattr(self, name)}")
        if self.max_pwm > 1:
            raise ValueError(f"max_pwm: must be at most 1, got {self.max_pwm}")


@dataclass
class Datasheet:
    """A servo type's published ratings at the supply voltage it is rated at."""
    voltage: float                   # V
    stall_torque: float              # N m at the output
    no_load_speed: float             # rad/s at the output
    gear_ratio: float                # motor turns per output turn
    source: str = ""

    def validate(self) -> None:
        for name in ("voltage", "stall_torque", "no_load_speed", "gear_ratio"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")

    def motor_constants(self, speed_ratio, torque_ratio, max_pwm: float):
        """(kt, R) of a motor whose no-load speed and stall torque at full duty and this
        voltage are speed_ratio and torque_ratio times the rated ones (floats or tensors)."""
        volts = max_pwm * self.voltage
        kt = volts / (speed_ratio * self.no_load_speed)
        return kt, kt * volts / (torque_ratio * self.stall_torque)

    def ratios(self, p: ServoParams) -> tuple[float, float]:
        """(no-load speed, stall torque) of `p` at this voltage, relative to the ratings."""
        volts = p.max_pwm * self.voltage
        return volts / p.kt / self.no_load_speed, p.kt / p.resistance * volts / self.stall_torque


@dataclass
class Datasheets:
    """configs/servo/datasheets.yaml: servo type name -> its ratings."""
    motors: dict[str, Datasheet] = field(default_factory=dict)


@dataclass
class ServoRegisters:
    """What the host writes to the servo's control table (LeRobot's SO-101 defaults). ArmSim
    takes one value for every servo, or (the emulator, whose host writes each servo's) a
    tensor per register for p, d, i, acceleration and torque_limit."""
    p: int = 16
    d: int = 32
    i: int = 0
    acceleration: int = 254          # register units of 100 ticks/s^2; 0 = no ramp
    goal_speed: int = 0              # ticks/s; 0 = the servo's maximum
    torque_limit: int = 1000         # 0.1 % of max_pwm

    def validate(self) -> None:
        for name, hi in (("p", 254), ("d", 254), ("i", 254), ("acceleration", 254),
                         ("goal_speed", 32766), ("torque_limit", 1000)):
            v = getattr(self, name)
            if not 0 <= v <= hi:
                raise ValueError(f"{name}: must be in 0..{hi}, got {v}")


@dataclass
class ServoConfig:
    """A servo YAML file (configs/servo/): identified parameters, registers, provenance."""
    motor: str = ""                  # servo type, a key of configs/servo/datasheets.yaml
    params: ServoParams = field(default_factory=ServoParams)
    registers: ServoRegisters = field(default_factory=ServoRegisters)
    source: str = ""


class ServoState:
    """Firmware state of N x J servos: the profiled target and the integrator."""

    def __init__(self, q: torch.Tensor):
        self.target = quantize(q).clone()
        self.target_vel = torch.zeros_like(q)
        self.integral = torch.zeros_like(q)
        self.duty = torch.zeros_like(q)            # the PWM applied last step, where kept (its Present_Load)

    def reset(self, mask: torch.Tensor, q: torch.Tensor) -> None:
        """Restart servos where `mask` [N] is true at measured position q (torque-on: goal := present)."""
        m = mask[:, None]
        self.target = torch.where(m, quantize(q), self.target)
        self.target_vel = torch.where(m, 0.0, self.target_vel)
        self.integral = torch.where(m, 0.0, self.integral)
        self.duty = torch.where(m, 0.0, self.duty)


def servo_torque(state: ServoState, goal: torch.Tensor, q_meas: torch.Tensor, qd: torch.Tensor,
                 p: ServoParams, reg: ServoRegisters, dt: float,
                 gain_scale: torch.Tensor | float = 1.0, voltage: torch.Tensor | float | None = None,
                 enabled: torch.Tensor | bool = True, keep_duty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Actuator torque [N,J] (motor and viscous friction) for goals and measured positions
    (rad, whole ticks), and the Coulomb friction limit [N,J] for `integrate`; advances the
    firmware by dt.

    `gain_scale` multiplies the loop gain (randomizes unit-to-unit spread); `voltage`
    overrides the supply (a recorded voltage, or a randomized one). `keep_duty`: record the
    duty applied in `state.duty` (the emulator reports it; training never reads it).
    """
    vmax = p.max_velocity if reg.goal_speed == 0 else min(p.max_velocity, reg.goal_speed * TICK)
    # Speed/acceleration profile of the internal target (trapezoidal, no overshoot); the
    # registers may be per joint (tensors, the emulator's servos) or one value for all.
    to_go = goal - state.target
    acc = reg.acceleration * ACCEL_UNIT
    v_want = torch.sign(to_go) * torch.clamp(torch.sqrt(2.0 * acc * to_go.abs()), max=vmax)
    ramped = state.target_vel + torch.clamp(v_want - state.target_vel, -acc * dt, acc * dt)
    v = torch.where(torch.as_tensor(acc > 0), ramped, torch.sign(to_go) * vmax)    # 0: no ramp
    step = v * dt
    step = torch.where(step.abs() >= to_go.abs(), to_go, step)
    state.target = state.target + step
    state.target_vel = torch.where(step == to_go, 0.0, v)

    err = quantize(state.target) - q_meas
    err = torch.where(err.abs() <= p.deadband_ticks * TICK + 1e-9, torch.zeros_like(err), err)
    state.integral = state.integral + err * dt         # acts only with I > 0; reset at torque on
    duty = p.error_gain * gain_scale * (reg.p * err + reg.i * state.integral) - p.d_gain * reg.d * qd
    lim = p.max_pwm * reg.torque_limit / 1000.0
    duty = torch.clamp(duty, -lim, lim)
    if keep_duty:
        state.duty = duty
    volts = duty * (p.voltage if voltage is None else voltage)
    tau = p.kt / p.resistance * (volts - p.kt * qd)
    if enabled is not True:
        tau = tau * enabled     # torque off: open motor terminals, no drive and no back-EMF
    coulomb = p.friction_coulomb + p.friction_load * tau.abs()
    return tau - p.friction_viscous * qd, coulomb


def motor_current(p: ServoParams, duty: torch.Tensor, qd: torch.Tensor) -> torch.Tensor:
    """Motor current (A) at a duty and joint speed: servo_torque's motor equation over kt (what
    the STS3215 reports as Present_Current and its overcurrent cut-out watches)."""
    return (duty * p.voltage - p.kt * qd) / p.resistance


def integrate(q: torch.Tensor, qd: torch.Tensor, M: torch.Tensor, tau: torch.Tensor,
              coulomb: torch.Tensor | float, dt: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One semi-implicit Euler step of M qdd = tau with implicit Coulomb friction.

    Friction is applied per joint as the impulse that brings the joint to rest, capped at
    coulomb * dt through the joint's effective inertia, so it can stick a joint but never
    push it backwards, at any step size.
    """
    qdd, Minv_diag = _spd_solve(M, tau)
    v_free = qd + dt * qdd
    cap = coulomb * dt * Minv_diag
    v = v_free - torch.maximum(torch.minimum(v_free, cap), -cap)
    return q + dt * v, v


def _spd_solve(M: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x = M^-1 b and diag(M^-1) for small SPD matrices [N,J,J], by an unrolled Cholesky.

    Written out (J is 6 here) rather than calling LAPACK: per-matrix LAPACK calls dominate
    at this size, and plain tensor ops let torch.compile fuse the whole physics step.
    """
    J = M.shape[-1]
    L = [[None] * J for _ in range(J)]
    for j in range(J):
        d = M[..., j, j] - sum((L[j][k] * L[j][k] for k in range(j)), torch.zeros_like(M[..., j, j]))
        L[j][j] = torch.sqrt(d)
        inv = 1.0 / L[j][j]
        for i in range(j + 1, J):
            L[i][j] = (M[..., i, j] - sum((L[i][k] * L[j][k] for k in range(j)), torch.zeros_like(d))) * inv
    # Forward substitution L y = b, and the rows of L^-1 for diag(M^-1) = column norms of L^-1.
    y, Linv = [], [[None] * J for _ in range(J)]
    for i in range(J):
        inv = 1.0 / L[i][i]
        y.append((b[..., i] - sum((L[i][k] * y[k] for k in range(i)), torch.zeros_like(inv))) * inv)
        Linv[i][i] = inv
        for j in range(i):
            Linv[i][j] = -sum((L[i][k] * Linv[k][j] for k in range(j, i)), torch.zeros_like(inv)) * inv
    x = [None] * J
    for i in reversed(range(J)):
        x[i] = (y[i] - sum((L[k][i] * x[k] for k in range(i + 1, J)), torch.zeros_like(y[i]))) / L[i][i]
    diag = [sum(Linv[k][j] * Linv[k][j] for k in range(j, J)) for j in range(J)]
    return torch.stack(x, -1), torch.stack(diag, -1)
