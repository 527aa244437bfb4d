"""Batched physics of the SO-101: rigid-body dynamics driven by one STS3215 model per joint.

`ArmSim` is the plant only: joint state, servo firmware state and the per-environment
physical parameters. It knows nothing of tasks or rewards, so the reach environment and
the servo-bus emulator drive the very same arm.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from soarm.description import RobotDescription
from soarm.dynamics import ArmDynamics
from soarm.servo import ServoParams, ServoRegisters, ServoState, integrate, quantize, servo_torque


@dataclass
class Physics:
    """Per-environment physical parameters; tensors [N, J] unless noted."""
    mass_scale: torch.Tensor        # link mass (and inertia) multiplier
    gain_scale: torch.Tensor        # firmware loop gain multiplier (unit-to-unit spread)
    coulomb: torch.Tensor           # N m
    stiction: torch.Tensor          # N m more a joint at rest holds (static above kinetic friction)
    viscous: torch.Tensor           # N m s / rad
    friction_load: torch.Tensor     # extra Coulomb friction per N m of motor torque
    armature: torch.Tensor          # kg m^2, reflected rotor inertia
    deadband: torch.Tensor          # encoder ticks of error the firmware does not act on
    encoder_offset: torch.Tensor    # rad, whole ticks: calibration error of each joint
    backlash: torch.Tensor          # rad of free play in each gearbox (modelled where ArmSim.gear_play)
    payload: torch.Tensor           # [N, 1] kg held at the fingertip (modelled where ArmSim.carries_payload)
    # Joints driven by an ideal position actuator instead of the servo model (where ArmSim.pd_drives):
    pd: torch.Tensor                # bool: this joint's drive is the PD below
    pd_kp: torch.Tensor             # N m / rad
    pd_kv: torch.Tensor             # N m s / rad, inside the force limit (MuJoCo's kv)
    pd_force: torch.Tensor          # N m, the force limit
    pd_damping: torch.Tensor        # N m s / rad, joint damping outside the actuator


def implicit_pd(goal: torch.Tensor, q: torch.Tensor, qd: torch.Tensor, ph: Physics, dt: float,
                enabled: torch.Tensor | bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """An ideal position actuator, tau = clip(kp (goal - q) - kv qd, +-force) - damping qd, as
    MuJoCo's `position` actuator and Isaac Lab's implicit actuator model published arms.

    Stiffness and damping act on the state at the end of the step (kp up to ~1000 N m/rad
    on a 0.03 kg m^2 rotor is unstable explicitly at our step): returns (torque at the
    start of the step with the position term advanced by dt*qd, the diagonal inertia
    dt^2 kp + dt (kv + damping) that `integrate` adds to M for the rest). A saturated
    actuator has no stiffness; a disabled one leaves only the joint damping."""
    tau = ph.pd_kp * (goal - q - dt * qd) - ph.pd_kv * qd
    live = (tau.abs() <= ph.pd_force) & enabled
    tau = torch.clamp(tau, -ph.pd_force, ph.pd_force) * enabled - ph.pd_damping * qd
    return tau, torch.where(live, dt * dt * ph.pd_kp + dt * ph.pd_kv, 0.0) + dt * ph.pd_damping


class ArmSim:
    def __init__(self, robot: RobotDescription, servo: ServoParams, registers: ServoRegisters,
                 num_envs: int, dt: float, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, backlash: float = 0.0, pd_drives: bool = False,
                 carries_payload: bool = False, reports_drive: bool = False):
        """`backlash`: rad of free play in each servo's gearbox, see `_gear_play`. Any value
        above 0 switches the gear-play model on (`gear_play`) for the sim's lifetime; the
        per-environment play is then `physics.backlash`, which randomization may redraw.
        `pd_drives` and `carries_payload` switch on the per-environment PD actuators
        (`implicit_pd`, where `physics.pd`) and fingertip payloads (`physics.payload`);
        `reports_drive` keeps each servo's duty (the emulator's Present_Load and current); the
        switches keep the physics step free of what a sim never uses."""
        self.robot, self.servo, self.registers = robot, servo, registers
        self.N, self.dt = num_envs, dt
        self.dyn = ArmDynamics(robot, device, dtype)
        J = self.J = self.dyn.J
        kw = dict(device=self.dyn.device, dtype=dtype)
        self.lower = torch.tensor(robot.lower, **kw)
        self.upper = torch.tensor(robot.upper, **kw)
        self.q = torch.zeros(num_envs, J, **kw)
        self.qd = torch.zeros(num_envs, J, **kw)
        self.goal = torch.zeros(num_envs, J, **kw)
        self.firmware = ServoState(self.q)
        self.enabled = torch.ones(num_envs, J, dtype=torch.bool, device=self.dyn.device)   # torque on
        ones = torch.ones(num_envs, J, **kw)
        zeros = torch.zeros_like(ones)
        self.physics = Physics(mass_scale=ones.clone(), gain_scale=ones.clone(),
                               coulomb=ones * servo.friction_coulomb, stiction=zeros.clone(), viscous=ones * servo.friction_viscous,
                               friction_load=ones * servo.friction_load, armature=ones * servo.armature,
                               deadband=ones * servo.deadband_ticks,
                               encoder_offset=zeros.clone(), backlash=ones * backlash,
                               payload=torch.zeros(num_envs, 1, **kw), pd=torch.zeros_like(ones, dtype=torch.bool),
                               pd_kp=zeros.clone(), pd_kv=zeros.clone(), pd_force=zeros.clone(),
                               pd_damping=zeros.clone())
        self.gear_play = backlash > 0
        self.pd_drives, self.carries_payload, self.reports_drive = pd_drives, carries_payload, reports_drive
        self.slack = torch.zeros_like(ones)          # motor side minus output side, |slack| <= backlash / 2
        self.motor_vel = torch.zeros_like(ones)

    def measured(self) -> torch.Tensor:
        """Encoder readings [N, J] in rad: whole ticks, including each joint's calibration error."""
        return quantize(self.q + self.physics.encoder_offset)

    def state_dict(self) -> dict:
        return {"q": self.q, "qd": self.qd, "goal": self.goal, "slack": self.slack, "motor_vel": self.motor_vel,
                "firmware": dict(vars(self.firmware)), "physics": dataclasses.asdict(self.physics)}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s output onto this sim's device (a checkpoint is read on the
        CPU and may come from another device)."""
        device = self.q.device
        for k in ("q", "qd", "goal", "slack", "motor_vel"):
            setattr(self, k, state[k].to(device))
        for k, v in state["firmware"].items():
            setattr(self.firmware, k, v.to(device))
        self.physics = Physics(**{k: v.to(device) for k, v in state["physics"].items()})

    def reset(self, mask: torch.Tensor, q: torch.Tensor) -> None:
        """Place environments `mask` at rest at q, torque on with goal := present."""
        m = mask[:, None]
        self.q = torch.where(m, q, self.q)
        self.qd = torch.where(m, 0.0, self.qd)
        self.slack = torch.where(m, 0.0, self.slack)
        self.motor_vel = torch.where(m, 0.0, self.motor_vel)
        meas = self.measured()
        self.goal = torch.where(m, meas, self.goal)
        self.firmware.reset(mask, meas)

    def step(self, goal: torch.Tensor, substeps: int) -> None:
        """Hold `goal` [N, J] (rad, encoder frame) for `substeps` physics steps."""
        self.goal = quantize(torch.clamp(goal, self.lower, self.upper))
        for _ in range(substeps):
            self._substep_fn()

    def compile(self, dynamic: bool = False) -> bool:
        """Fuse the physics substep with torch.compile; False (eager kept) where unavailable.
        dynamic: one compiled step for any number of environments (later sims of another
        size reuse it), instead of one specialised to this size."""
        try:
            fn = torch.compile(self._substep, dynamic=dynamic)
            state = (self.q, self.qd, self.slack, self.motor_vel, dict(vars(self.firmware)))
            with torch.no_grad():   # compile now, as it will run (grad mode is guarded), so failures surface here
                fn()
            self.q, self.qd, self.slack, self.motor_vel, firmware = state
            vars(self.firmware).update(firmware)
        except Exception as e:  # noqa: BLE001 - any backend failure means: stay eager
            print(f"torch.compile unavailable ({type(e).__name__}); physics runs eagerly")
            return False
        self._substep_fn = fn
        return True

    def _substep_fn(self) -> None:
        self._substep()

    def _substep(self) -> None:
        ph = self.physics
        params = dataclasses.replace(self.servo, friction_viscous=ph.viscous, friction_coulomb=ph.coulomb,
                                     friction_load=ph.friction_load, deadband_ticks=ph.deadband)
        tau, coulomb = servo_torque(self.firmware, self.goal, self.measured(), self.qd, params,
                                    self.registers, self.dt, gain_scale=ph.gain_scale, enabled=self.enabled,
                                    keep_duty=self.reports_drive)
        # Static friction: a joint that ended the last step stuck (integrate leaves it at exactly 0)
        # must be pushed past its kinetic friction plus the stiction to move again.
        coulomb = coulomb + torch.where(self.qd == 0, ph.stiction, 0.0)
        stiffness = torch.zeros_like(tau)          # the drives' implicit part, as diagonal inertia
        if self.pd_drives:
            pd_tau, pd_stiffness = implicit_pd(self.goal, self.q, self.qd, ph, self.dt, self.enabled)
            tau = torch.where(ph.pd, pd_tau, tau)
            coulomb = torch.where(ph.pd, ph.coulomb, coulomb)
            stiffness = torch.where(ph.pd, pd_stiffness, stiffness)
        M, bias = self.dyn.mass_and_bias(self.q, self.qd, ph.mass_scale,
                                         ph.payload if self.carries_payload else None)
        if self.gear_play:
            q, qd = self._gear_play(M, bias, tau, coulomb, stiffness)
        else:
            M = M + torch.diag_embed(ph.armature + stiffness)
            q, qd = integrate(self.q, self.qd, M, tau - bias, coulomb, self.dt)
        # Hard stops at the joint limits: the joint stops there.
        hit = (q < self.lower) | (q > self.upper)
        self.q = torch.clamp(q, self.lower, self.upper)
        self.qd = torch.where(hit, 0.0, qd)

    def _gear_play(self, M: torch.Tensor, bias: torch.Tensor, tau: torch.Tensor, coulomb: torch.Tensor,
                   stiffness: torch.Tensor):
        """One step with backlash between motor and output (the encoder reads the output shaft).

        A joint is engaged while its slack sits at the end of the gap that the drive torque
        pushes into: then it moves as one body with the rotor, as without backlash. Otherwise
        the output moves on its own (gravity, the other links) and the rotor on its own (drive
        torque, gearbox friction, rotor inertia), until the slack reaches an end of the gap,
        where the two meet in an inelastic impact (momentum kept, joint inertia M_jj).
        """
        half, eps, dt = self.physics.backlash / 2, 1e-6, self.dt
        rotor_inertia = self.physics.armature
        rotor = rotor_inertia + stiffness                 # the drive's implicit part acts on the rotor
        engaged = ((self.slack >= half - eps) & (tau >= 0)) | ((self.slack <= -half + eps) & (tau <= 0))
        drive = torch.where(engaged, tau, 0.0)
        inertia = M + torch.diag_embed(torch.where(engaged, rotor, 0.0))
        q, qd = integrate(self.q, self.qd, inertia, drive - bias, torch.where(engaged, coulomb, 0.0), dt)
        # The free rotor: drive torque against implicit Coulomb friction, as `integrate` applies it.
        v = self.motor_vel + dt * tau / rotor
        cap = coulomb * dt / rotor
        motor_vel = torch.where(engaged, qd, v - torch.clamp(v, -cap, cap))
        slack = torch.where(engaged, self.slack, self.slack + dt * (motor_vel - qd))
        hit = slack.abs() > half
        Mjj = M.diagonal(dim1=-2, dim2=-1)
        merged = (rotor_inertia * motor_vel + Mjj * qd) / (rotor_inertia + Mjj)
        self.slack = torch.clamp(slack, -half, half)
        self.motor_vel = torch.where(hit, merged, motor_vel)
        return q, torch.where(hit, merged, qd)
