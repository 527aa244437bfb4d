"""Episode and target-window statistics of the reach task, accumulated on the device.

Kept by the reach task (soarm/reach_task.py) for both backends, so the trainer logs the same
quantities whichever simulator produced them: `record` every step adds sums without
host syncs; `pop` turns them into means once per iteration (one sync).
"""

from __future__ import annotations

import torch


class EpisodeStats:
    def __init__(self, num_envs: int, device: torch.device):
        self.ret = torch.zeros(num_envs, device=device)             # running return per env
        self.terms: dict[str, torch.Tensor] = {}                    # running reward terms per env
        self.sums: dict[str, torch.Tensor] = {}

    def record(self, terms: dict[str, torch.Tensor], reward, dist, window_end, done, terminated, truncated,
               length) -> None:
        """One step: `dist` the fingertip error, counted where a target window ended;
        `length` the episode length, counted where an episode ended (`done`)."""
        for k, v in terms.items():
            self.terms[k] = self.terms.get(k, torch.zeros_like(v)) + v
        self.ret += reward
        we, d = window_end.float(), done.float()
        add = {
            "windows": we.sum(),
            "error_sum": (dist * we).sum(),
            "success_1cm": ((dist < 0.01).float() * we).sum(),
            "success_5mm": ((dist < 0.005).float() * we).sum(),
            "episodes": d.sum(),
            "return_sum": (self.ret * d).sum(),
            "length_sum": (length.float() * d).sum(),
            "terminated": terminated.float().sum(),
            "truncated": truncated.float().sum(),
        }
        for k, v in self.terms.items():
            add["term/" + k] = (v * d).sum()
        for k, v in add.items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def reset(self, mask: torch.Tensor) -> None:
        """Start new episodes where `mask` [N] is true."""
        self.ret = torch.where(mask, 0.0, self.ret)
        for k in self.terms:
            self.terms[k] = torch.where(mask, 0.0, self.terms[k])

    def pop(self) -> dict[str, float]:
        """Means over the windows and episodes completed since the last call (one host sync)."""
        s = {k: float(v) for k, v in self.sums.items()}
        self.sums = {}
        w, e = max(s.get("windows", 0.0), 1.0), max(s.get("episodes", 0.0), 1.0)
        out = {"episodes": s.get("episodes", 0.0)}
        if s.get("windows"):
            out.update(fingertip_error=s["error_sum"] / w, success_1cm=s["success_1cm"] / w,
                       success_5mm=s["success_5mm"] / w)
        if s.get("episodes"):
            out.update(mean_return=s["return_sum"] / e, episode_length=s["length_sum"] / e,
                       terminated=s["terminated"] / e, truncated=s["truncated"] / e)
            out.update({k: v / e for k, v in s.items() if k.startswith("term/")})
        return out

    def state_dict(self) -> dict:
        return {"ret": self.ret, "terms": dict(self.terms)}

    def load_state_dict(self, state: dict) -> None:
        """Onto this instance's device (a checkpoint is read on the CPU)."""
        device = self.ret.device
        self.ret, self.terms = state["ret"].to(device), {k: v.to(device) for k, v in state["terms"].items()}
