"""Batched rigid-body kinematics and dynamics of the arm's kinematic tree, in PyTorch.

All quantities are in the world (base) frame. N environments, J revolute joints (each
joint moves one body, its "child"). CPU and CUDA; float32 for simulation, float64 for
verification against MuJoCo.

    fk          -> body rotations R [N,J,3,3] and origins p [N,J,3]
    fingertip   -> world position of the fingertip [N,3]
    jacobian    -> linear Jacobian of a body-fixed point [N,3,J]
    mass_matrix -> M(q) [N,J,J] of the rigid bodies (rotor armature belongs to the servo)
    bias        -> C(q, qd) qd + g(q) [N,J]

Speed comes from avoiding per-joint Python loops in the dynamics: the recursive
Newton-Euler and composite-rigid-body recursions are written as sums over ancestors and
over subtrees, each one matrix product with a constant 0/1 matrix over the joint axis.
Internally tensors are joint-major with the batch last ([J, 3, N], [J, 3, 3, N]), so those
products are single GEMMs and every other op runs over contiguous rows of N.
"""

from __future__ import annotations

import numpy as np
import torch

from soarm.description import RobotDescription

GRAVITY = 9.81


# Internal layout: the batch is the last, contiguous axis: vectors [..., 3, N], matrices
# [..., 3, 3, N], so every elementwise op runs over long contiguous rows.
def _cross(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a0, a1, a2 = a.unbind(-2)
    b0, b1, b2 = b.unbind(-2)
    return torch.stack((a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0), -2)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-2)


def _matvec(R: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (R * v.unsqueeze(-3)).sum(-2)


def _matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return (A.unsqueeze(-2) * B.unsqueeze(-4)).sum(-3)


def _transpose(A: torch.Tensor) -> torch.Tensor:
    return A.transpose(-2, -3)


class ArmDynamics:
    def __init__(self, robot: RobotDescription, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.robot = robot
        self.device, self.dtype = torch.device(device), dtype
        t = lambda x: torch.as_tensor(np.asarray(x), device=self.device, dtype=dtype)  # noqa: E731
        js = robot.joints
        self.J = len(js)
        self.parent = [j.parent for j in js]
        self.origin_rot = t([j.rot for j in js])          # [J,3,3]
        self.origin_xyz = t([j.xyz for j in js])          # [J,3]
        self.mass = t([j.mass for j in js])               # [J]
        self.com = t([j.com for j in js])                 # [J,3]
        self.inertia = t([j.inertia for j in js])         # [J,3,3]
        # ancestor[i, j] = 1 when joint j moves body i (j is i or an ancestor of i);
        # its transpose sums over subtrees.
        anc = np.zeros((self.J, self.J))
        for i in range(self.J):
            k = i
            while k >= 0:
                anc[i, k] = 1.0
                k = self.parent[k]
        self.ancestor = t(anc)
        self.subtree = t(anc.T)
        self._strict = t(anc.T - np.eye(self.J))
        # The parent's index for gathering, the base (-1) mapped to a zero row at the end.
        self.parent_index = torch.tensor([p if p >= 0 else self.J for p in self.parent], device=self.device)
        self.tip_body = robot.fingertip_body
        self.tip_xyz = t(robot.fingertip_xyz)[:, None]     # [3,1]
        self.gravity = t([0.0, 0.0, -GRAVITY])[:, None]      # [3,1]
        self._rot0 = self.origin_rot[..., None]               # [J,3,3,1]
        self._xyz0 = self.origin_xyz[..., None]               # [J,3,1]
        self._com = self.com[..., None]                       # [J,3,1]
        self._inertia = self.inertia[..., None]               # [J,3,3,1]

    # -------------------------------------------------------------- helpers
    def _over(self, mat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """sum_j mat[i, j] x[j] for joint-major x [J, ...]: one GEMM."""
        return (mat @ x.reshape(self.J, -1)).reshape(x.shape)

    def _of_parent(self, x: torch.Tensor) -> torch.Tensor:
        """x of each joint's parent body, zero for the base; joint-major."""
        return torch.cat((x, torch.zeros_like(x[:1])))[self.parent_index]

    # ----------------------------------------------------------- kinematics
    def _frames(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotations [J,3,3,N] and origins [J,3,N]."""
        qT = q.T                                               # [J,N]
        c, s = torch.cos(qT)[:, None], torch.sin(qT)[:, None]  # [J,1,N]
        R0 = self._rot0
        # origin_rot @ Rz(q): rotate the first two columns of the origin rotation.
        col0 = R0[:, :, 0] * c + R0[:, :, 1] * s
        col1 = R0[:, :, 1] * c - R0[:, :, 0] * s
        local = torch.stack((col0, col1, R0[:, :, 2].expand_as(col0)), 2)   # [J,3,3,N]
        Rs, ps = [], []
        for i in range(self.J):
            k = self.parent[i]
            if k < 0:
                Rs.append(local[i])
                ps.append(self._xyz0[i].expand(3, q.shape[0]))
            else:
                Rs.append(_matmul(Rs[k], local[i]))
                ps.append(ps[k] + _matvec(Rs[k], self._xyz0[i]))
        return torch.stack(Rs), torch.stack(ps)

    def fk(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotations [N,J,3,3] and origins [N,J,3] of every body for joint angles q [N,J]."""
        R, p = self._frames(q)
        return R.permute(3, 0, 1, 2), p.permute(2, 0, 1)

    def fingertip(self, q: torch.Tensor) -> torch.Tensor:
        """World position [N,3] of the fingertip."""
        R, p = self._frames(q)
        b = self.tip_body
        return (p[b] + _matvec(R[b], self.tip_xyz)).T

    def jacobian(self, q: torch.Tensor, body: int | None = None, xyz: torch.Tensor | None = None) -> torch.Tensor:
        """Linear Jacobian [N,3,J] of a point fixed in `body` (default: the fingertip)."""
        body = self.tip_body if body is None else body
        xyz = self.tip_xyz if xyz is None else torch.as_tensor(xyz, dtype=self.dtype, device=self.device)[:, None]
        R, p = self._frames(q)
        x = p[body] + _matvec(R[body], xyz)                   # [3,N]
        cols = _cross(R[:, :, 2], x - p)                       # [J,3,N]
        return (cols * self.ancestor[body][:, None, None]).permute(2, 1, 0)

    # ------------------------------------------------------------- dynamics
    def _bodies(self, R, p, mass_scale, payload):
        """COMs [J,3,N], world inertias [J,3,3,N] and masses [J,N]."""
        c = p + _matvec(R, self._com)
        Iw = _matmul(_matmul(R, self._inertia), _transpose(R))
        m = self.mass[:, None].expand(-1, p.shape[-1])
        if mass_scale is not None:
            m = m * mass_scale.T
            Iw = Iw * mass_scale.T[:, None, None]
        if payload is not None:
            c, Iw, m = self._with_payload(R, p, c, Iw, m, payload[:, 0])
        return c, Iw, m

    def _with_payload(self, R, p, c, Iw, m, mp):
        """A point mass mp [N] (kg) at the fingertip folded into the fingertip body: mass,
        centre of mass, and inertia about the new centre by the parallel-axis theorem."""
        b = self.tip_body
        x = p[b] + _matvec(R[b], self.tip_xyz)                   # [3,N]
        mb = m[b]
        total = mb + mp
        cb = (mb * c[b] + mp * x) / total

        def about(mass, r):                                       # inertia of a point mass at offset r
            eye = torch.eye(3, device=r.device, dtype=r.dtype)[:, :, None]
            return mass * ((r * r).sum(0) * eye - r[:, None] * r[None, :])
        Ib = Iw[b] + about(mb, c[b] - cb) + about(mp, x - cb)
        is_b = torch.arange(self.J, device=m.device) == b
        m = torch.where(is_b[:, None], total, m)
        c = torch.where(is_b[:, None, None], cb, c)
        Iw = torch.where(is_b[:, None, None, None], Ib, Iw)
        return c, Iw, m

    def mass_matrix(self, q: torch.Tensor, mass_scale: torch.Tensor | None = None,
                    payload: torch.Tensor | None = None) -> torch.Tensor:
        """Joint-space inertia [N,J,J] (composite rigid bodies, closed form)."""
        return self.mass_and_bias(q, None, mass_scale, payload)[0]

    def bias(self, q: torch.Tensor, qd: torch.Tensor, mass_scale: torch.Tensor | None = None,
             payload: torch.Tensor | None = None) -> torch.Tensor:
        """Generalized bias forces [N,J]: Coriolis, centrifugal and gravity (Newton-Euler, qdd = 0)."""
        R, p = self._frames(q)
        return self._bias(R, p, *self._bodies(R, p, mass_scale, payload), qd)

    def mass_and_bias(self, q: torch.Tensor, qd: torch.Tensor | None, mass_scale: torch.Tensor | None = None,
                      payload: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """M(q) [N,J,J] and, when qd is given, the bias [N,J], sharing one kinematics pass.
        `mass_scale` [N,J] multiplies each link's mass and inertia; `payload` [N,1] (kg) is a
        point mass held at the fingertip."""
        R, p = self._frames(q)
        bodies = self._bodies(R, p, mass_scale, payload)
        return self._mass(R, p, *bodies), (None if qd is None else self._bias(R, p, *bodies, qd))

    def _mass(self, R, p, c, Iw, m) -> torch.Tensor:
        z = R[:, :, 2]                                         # [J,3,N]
        # Moments of each subtree about the world origin: mass, first, second moment, inertia.
        S0 = self._over(self.subtree, m)                       # [J,N]
        S1 = self._over(self.subtree, m[:, None] * c)          # [J,3,N]
        S2 = self._over(self.subtree, m[:, None, None] * c[:, :, None] * c[:, None, :])
        Ic = self._over(self.subtree, Iw)                      # [J,3,3,N]
        # For i an ancestor of j, with the moments of subtree j (sum over its bodies k):
        #   M_ij = sum_k m_k (z_i x (c_k - p_i)) . (z_j x (c_k - p_j)) + z_i . I_k z_j
        # expanded with (a x u).(b x v) = (a.b)(u.v) - (a.v)(u.b). Row index i, column j.
        zi, pi, zj, pj = z[:, None], p[:, None], z[None], p[None]
        S0j, S1j = S0[None], S1[None]
        trS2 = (S2[:, 0, 0] + S2[:, 1, 1] + S2[:, 2, 2])[None]
        uv = trS2 - _dot(S1j, pi + pj) + S0j * _dot(pi, pj)
        zi_pj, pi_zj = _dot(zi, pj), _dot(pi, zj)
        # z_i.I z_j - z_i.S2 z_j in one product
        zDz = _dot(zi, _matvec((Ic - S2)[None], zj))
        A = (_dot(zi, zj) * uv + zDz + _dot(zi, S1j) * pi_zj + zi_pj * _dot(S1j, zj)
             - S0j * zi_pj * pi_zj)                            # [Ji,Jj,N]
        # Keep the entries with i an ancestor-or-self of j, mirror the strict ones.
        M = A * self.subtree[:, :, None] + (A * self._strict[:, :, None]).transpose(0, 1)
        return M.permute(2, 0, 1)

    def _bias(self, R, p, c, Iw, m, qd) -> torch.Tensor:
        z = R[:, :, 2]
        wz = z * qd.T[:, None]                                 # joint rates as vectors [J,3,N]
        w = self._over(self.ancestor, wz)                      # body angular velocities
        w_par = self._of_parent(w)
        # With qdd = 0 each joint adds d/dt(z_j qd_j) = w_parent x z_j qd_j of angular acceleration.
        alpha = self._over(self.ancestor, _cross(w_par, wz))
        alpha_par = self._of_parent(alpha)
        # Origin accelerations: each joint adds the rigid-body terms of its parent over the link.
        r = p - self._of_parent(p)
        inc = _cross(alpha_par, r) + _cross(w_par, _cross(w_par, r))
        a = self._over(self.ancestor, inc) - self.gravity      # gravity as an upward base acceleration
        rc = c - p
        a_c = a + _cross(alpha, rc) + _cross(w, _cross(w, rc))
        F = m[:, None] * a_c
        Nm = _matvec(Iw, alpha) + _cross(w, _matvec(Iw, w))
        # Joint torque: moments of the subtree's forces about the joint origin, along its axis.
        SF = self._over(self.subtree, F)
        SN = self._over(self.subtree, Nm + _cross(c, F))
        return _dot(z, SN - _cross(p, SF)).T
