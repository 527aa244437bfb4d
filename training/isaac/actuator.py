"""The STS3215 servo model (soarm/servo.py) as an Isaac Lab explicit actuator.

Isaac Lab hands `compute` the joint position targets (the goals the task wrote) and the
joint state every physics step; the torque comes from the same firmware loop and DC motor
model the embedded simulator integrates, not from Isaac Lab's implicit PD. Coulomb and
load-dependent friction, which our integrator applies implicitly, enter here as a smooth
opposing torque: the solver sees them as any other joint effort.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from isaaclab.actuators import ActuatorBase, ActuatorBaseCfg
from isaaclab.utils import configclass
from isaaclab.utils.types import ArticulationActions

from soarm import CONFIG_DIR, config
from soarm.arm_params import JOINT_FIELDS
from soarm.reach import ReachCfg
from soarm.servo import ServoConfig, ServoState, quantize, servo_torque

STICTION_VELOCITY = 0.01          # rad/s: the tanh width of the smoothed Coulomb friction


class ServoActuator(ActuatorBase):
    cfg: ServoActuatorCfg
    # The per-environment physics it holds, named as soarm.sim.Physics (and ArmParams) name them:
    # the task's domain randomization writes them. (Armature and link masses go to the
    # articulation; the actuator models no gear play.)
    PHYSICS = ("gain_scale", "coulomb", "viscous", "friction_load", "deadband", "encoder_offset")

    def __init__(self, cfg: ServoActuatorCfg, *args, stiffness=None, damping=None, **kwargs):
        super().__init__(cfg, *args, **kwargs)          # (authored gains unused: no PD in the solver)
        servo = config.load(ServoConfig, CONFIG_DIR / cfg.servo)
        self.params, self.registers = servo.params, servo.registers
        shape = (self._num_envs, self.num_joints)
        zeros = torch.zeros(shape, device=self._device)
        self.firmware = ServoState(zeros)
        for name in self.PHYSICS:                       # the servo model's, until randomized
            value = JOINT_FIELDS[name].nominal(self.params) if name in JOINT_FIELDS else 0.0
            setattr(self, name, torch.full(shape, value, device=self._device))

    def measured(self, joint_pos: torch.Tensor, env_ids: torch.Tensor | None = None) -> torch.Tensor:
        """What the servo's encoder reads: whole ticks, with its calibration error."""
        return quantize(joint_pos + (self.encoder_offset if env_ids is None else self.encoder_offset[env_ids]))

    def restart(self, env_ids: torch.Tensor, joint_pos: torch.Tensor) -> None:
        """Torque on at joint_pos [len(env_ids), J] (goal := present) for `env_ids`."""
        fw = self.firmware
        fw.target[env_ids] = quantize(joint_pos + self.encoder_offset[env_ids])
        fw.target_vel[env_ids] = 0.0
        fw.integral[env_ids] = 0.0

    def reset(self, env_ids: Sequence[int]):
        pass                                     # the task restarts the firmware at the new pose

    def compute(self, control_action: ArticulationActions, joint_pos: torch.Tensor,
                joint_vel: torch.Tensor) -> ArticulationActions:
        params = dataclasses.replace(self.params, friction_viscous=self.viscous, friction_coulomb=self.coulomb,
                                     friction_load=self.friction_load, deadband_ticks=self.deadband)
        tau, coulomb = servo_torque(self.firmware, quantize(control_action.joint_positions),
                                    self.measured(joint_pos), joint_vel, params, self.registers,
                                    self.cfg.dt, gain_scale=self.gain_scale)
        self.computed_effort = tau - coulomb * torch.tanh(joint_vel / STICTION_VELOCITY)
        self.applied_effort = self.computed_effort
        control_action.joint_efforts = self.applied_effort
        control_action.joint_positions = None
        control_action.joint_velocities = None
        return control_action


@configclass
class ServoActuatorCfg(ActuatorBaseCfg):
    class_type: type = ServoActuator
    servo: str = ReachCfg.servo                     # under configs/; the env sets the task's
    dt: float = ReachCfg().physics_dt               # s, physics step: the firmware advances by it
    stiffness: float = 0.0                          # no implicit PD in the solver
    damping: float = 0.0
