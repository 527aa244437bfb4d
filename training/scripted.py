"""A scripted reach controller: resolved-rate damped least squares on the observation alone.

It reads the same observation a policy reads (measured joints, target error) and outputs
relative joint targets, so it runs through exactly the same action path; integrating the
goal absorbs the servo's gravity sag. It is the baseline a learned policy must beat.
"""

from __future__ import annotations

import torch

from soarm.dynamics import ArmDynamics
from soarm.reach import OBS_SLICES, ActionBounds, full_pose


class ScriptedReach:
    def __init__(self, dyn: ArmDynamics, bounds: ActionBounds, gain: float = 0.1, damping: float = 0.02):
        self.dyn, self.scale, self.clip, self.gain, self.damping = dyn, bounds.scale, bounds.clip, gain, damping
        self.home = torch.as_tensor(dyn.robot.home, dtype=dyn.dtype)
        self.arm = dyn.robot.arm_index

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        s = OBS_SLICES
        q = obs[:, s["joint_pos"]] + self.home
        err = obs[:, s["target_error"]]
        J = self.dyn.jacobian(full_pose(self.dyn, q))[:, :, self.arm]          # [N,3,5]
        JJt = J @ J.transpose(1, 2) + self.damping ** 2 * torch.eye(3, dtype=J.dtype)
        dq = (J.transpose(1, 2) @ torch.linalg.solve(JJt, self.gain * err[..., None])).squeeze(-1)
        return torch.clamp(dq / self.scale, -self.clip, self.clip)
