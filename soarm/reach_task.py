"""The reach task's step rules, once for every backend.

A backend (the embedded simulator, training/env.py; Isaac Lab, training/isaac/reach_env.py)
owns only its physics. Each control step it asks the task for the goals to apply, steps its
physics, and hands back what the arm reads; the task does the rest:

    goals = task.act(actions)                       # action -> goal, through each env's latency
    ... the backend applies `goals` and steps its physics ...
    out = task.finish_step(reading, joint_angles)   # rewards, ends, windows, statistics, and
                                                    # out.start: the next episodes' draws
    ... the backend applies out.start where out.done and places those arms ...
    task.reset(out.done, reading, out.start)        # goal := present, the new target, counters
    obs = task.observe(reading)

Random draws are made every step for every environment and kept where one restarts (the
masked form, free of host syncs), so a backend that resets by ids only on steps where some
episode ended draws the same numbers as one that resets by mask on every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from soarm import CONFIG_DIR, config
from soarm.description import RobotDescription
from soarm.dynamics import ArmDynamics
from soarm.episode_stats import EpisodeStats
from soarm.arm_params import load_arm
from soarm.reach import (ACTION_DIM, ReachCfg, action_to_goal, delay_goals, deviation_weights, draw_latency,
                         draw_physics, draw_targets, full_pose, limit_clearance, max_latency, observe, privileged,
                         privileged_dim, push, rewards, sample_targets, terminations, uniform, window_tail)
from soarm.servo import ServoConfig


@dataclass
class TaskState:
    """What the task carries from one control step to the next, per environment."""
    target: torch.Tensor           # [N, 3] m, the commanded fingertip position
    last_action: torch.Tensor      # [N, A] the policy's previous output
    goal: torch.Tensor             # [N, A] rad, the arm goal the policy commands now
    goals_in_flight: torch.Tensor  # [N, L + 1, A] rad, the latest goals, newest first (delay_goals)
    latency: torch.Tensor          # [N] long, control ticks this env's goals reach the servos late
    last_reading: torch.Tensor     # [N, A] rad, the encoder reading the latest observation was made from
    steps: torch.Tensor            # [N] long, control steps into the episode
    past_readings: torch.Tensor    # [N, H, A] rad, the readings of the last H observations, newest first
    past_goals: torch.Tensor       # [N, H, A] rad, the goals commanded at those observations
    privileged: torch.Tensor       # [N, P] the episode's physics as the critic sees it (P = 0: it does not)
    error_sum: torch.Tensor        # [N] m, the episode's fingertip errors summed over its window ends
    windows: torch.Tensor          # [N] the episode's window ends so far

    @classmethod
    def zeros(cls, num_envs: int, num_actions: int, max_latency: int, history: int, privileged: int,
              device) -> TaskState:
        f = dict(device=device, dtype=torch.float32)
        arm = lambda: torch.zeros(num_envs, num_actions, **f)           # noqa: E731
        count = lambda: torch.zeros(num_envs, dtype=torch.long, device=device)   # noqa: E731
        past = lambda: torch.zeros(num_envs, history, num_actions, **f)  # noqa: E731
        return cls(target=torch.zeros(num_envs, 3, **f), last_action=arm(), goal=arm(),
                   goals_in_flight=torch.zeros(num_envs, max_latency + 1, num_actions, **f), latency=count(),
                   last_reading=arm(), steps=count(), past_readings=past(), past_goals=past(),
                   privileged=torch.zeros(num_envs, privileged, **f), error_sum=torch.zeros(num_envs, **f),
                   windows=torch.zeros(num_envs, **f))

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class EpisodeStart:
    """What a new episode draws, for every environment (used where one restarts)."""
    physics: dict[str, torch.Tensor]   # soarm.sim.Physics fields, [N, J] (payload [N, 1])
    joint_angles: torch.Tensor         # [N, J] rad, the start pose
    target: torch.Tensor               # [N, 3] m, the first target


@dataclass
class StepOutcome:
    """One control step's result, [N] each unless noted."""
    reward: torch.Tensor
    terminated: torch.Tensor       # the fingertip went below the floor, or the physics blew up
    truncated: torch.Tensor        # the episode's time ran out
    window_error: torch.Tensor     # m, the fingertip error where a target window ended, NaN elsewhere
    final_obs: torch.Tensor        # [N, obs_dim + P] what each env observed as this step ended (before resets)
    start: EpisodeStart            # the episodes that start where `done` (latencies already set)

    @property
    def done(self) -> torch.Tensor:
        return self.terminated | self.truncated


class ReachTask:
    def __init__(self, cfg: ReachCfg, robot: RobotDescription, num_envs: int, device, seed: int = 0,
                 targets: torch.Tensor | None = None):
        """`targets` [K, 3]: hand these out in order instead of random ones (evaluation)."""
        self.cfg, self.robot, self.num_envs = cfg, robot, num_envs
        self.device = torch.device(device)
        self.dyn = ArmDynamics(robot, self.device)
        self.servo = config.load(ServoConfig, CONFIG_DIR / cfg.servo)
        # The task's arm, checked; the randomization centres on it where the task says so: its
        # rows [J], its latency.
        arm = None if cfg.arm is None else load_arm(cfg.arm, robot, cfg.servo)
        arm = arm if cfg.randomization.centre_on_arm else None
        self.centre = None if arm is None else arm.rows(robot, self.device)
        self.centre_latency = None if arm is None else arm.latency_ticks
        self.gen = torch.Generator().manual_seed(seed)
        self.arm = torch.tensor(robot.arm_index, device=self.device)
        self.home = torch.as_tensor(robot.home, device=self.device, dtype=torch.float32)
        self.deviation = deviation_weights(robot, cfg.reward, self.device)
        self.target_pool = sample_targets(self.dyn, cfg.command, max(65536, 4 * num_envs), self.gen)
        self.given_targets = None if targets is None else torch.as_tensor(targets, dtype=torch.float32,
                                                                          device=self.device)
        self.handed_out = 0                              # given targets handed out so far
        self.replay = cfg.randomization.hard_replay if targets is None else 0.0
        self.physics: dict[str, torch.Tensor] | None = None   # each env's episode physics (kept where replay is on)
        self.state = TaskState.zeros(num_envs, ACTION_DIM, max_latency(cfg.randomization, self.centre_latency),
                                     cfg.obs_history, privileged_dim(cfg), self.device)
        self.episodes = EpisodeStats(num_envs, self.device)
        self._action = self.state.last_action            # this step's action, between act and finish_step

    @property
    def max_backlash(self) -> float:
        """rad: the most gearbox play a draw can give (the embedded simulator sizes for it)."""
        play = math.radians(self.cfg.randomization.backlash_deg[1])
        return play + (0.0 if self.centre is None else float(self.centre["backlash"].max()))

    # ------------------------------------------------------------------ step
    def act(self, actions: torch.Tensor) -> torch.Tensor:
        """The arm goals [N, A] (rad) that reach the servos this step: the policy's relative
        targets from the goal it commands, `latency` ticks late."""
        s, cfg = self.state, self.cfg
        s.goal = action_to_goal(self.dyn, actions, s.goal, s.last_reading, cfg.action)
        applied, s.goals_in_flight = delay_goals(s.goals_in_flight, s.goal, s.latency)
        self._action = actions
        return applied

    def finish_step(self, reading: torch.Tensor, joint_angles: torch.Tensor) -> StepOutcome:
        """After the physics: `reading` [N, A] what the encoders read (rad), `joint_angles`
        [N, J] the true angles (the fingertip is scored where it is, not where it reads).
        New targets where a window ended inside an episode; a restart draws its own, and the
        randomization of the episodes that start where one ended."""
        s, cfg = self.state, self.cfg
        tip = self.dyn.fingertip(full_pose(self.dyn, joint_angles[:, self.arm]))
        error = s.target - tip
        terminated, below = terminations(cfg.reward, tip, joint_angles)
        terms = rewards(cfg.reward, error=error, action=self._action, last_action=s.last_action,
                        joint_pos=reading - self.home, joint_vel=(reading - s.last_reading) * cfg.control_hz,
                        clearance=limit_clearance(self.robot, reading), deviation=self.deviation, below_floor=below,
                        tail=window_tail(s.steps, cfg))
        reward = torch.stack(list(terms.values())).sum(0)
        s.last_action = self._action
        final_obs = self.observation(reading)
        s.steps = s.steps + 1
        truncated = (s.steps >= cfg.episode_steps) & ~terminated
        done = terminated | truncated
        window_end = (s.steps % cfg.window_steps == 0) | done
        dist = error.norm(dim=-1)
        s.error_sum = s.error_sum + torch.where(window_end, dist, 0.0)
        s.windows = s.windows + window_end.float()
        self.episodes.record(terms, reward, dist, window_end, done, terminated, truncated, s.steps)
        new_window = window_end & ~done
        s.target = torch.where(new_window[:, None], self._next_targets(new_window), s.target)
        return StepOutcome(reward=reward, terminated=terminated, truncated=truncated,
                           window_error=torch.where(window_end, dist, torch.nan), final_obs=final_obs,
                           start=self.draw_episodes(done))

    def observation(self, reading: torch.Tensor) -> torch.Tensor:
        """The networks' input [N, obs_dim + P] from this reading (rad), without moving on: the
        policy's observation, then what only the critic sees (soarm.reach.PRIVILEGED_TERMS)."""
        s = self.state
        obs = observe(self.dyn, reading, s.last_reading, s.goal, s.target, s.last_action, self.cfg.control_hz,
                      s.past_readings, s.past_goals, self.cfg.fine_error)
        return torch.cat((obs, s.privileged), dim=-1) if self.cfg.critic_physics else obs

    def observe(self, reading: torch.Tensor) -> torch.Tensor:
        """The observation the policy acts on next; the next velocity differences against it
        and the next history starts with it."""
        s = self.state
        obs = self.observation(reading)
        s.past_readings, s.past_goals = push(s.past_readings, reading), push(s.past_goals, s.goal)
        s.last_reading = reading
        return obs

    # ----------------------------------------------------------------- reset
    def draw_episodes(self, mask: torch.Tensor) -> EpisodeStart:
        """A new episode's randomization (Isaac Lab's reset events), start pose and first
        target, drawn for every env; each env's latency is set where `mask`. The backend
        applies the physics and the pose there, then calls `reset`."""
        n, rand, dev = self.num_envs, self.cfg.randomization, self.device
        physics = draw_physics(self.gen, rand, self.servo.params, n, len(self.robot.names), dev, torch.float32,
                               self.centre)
        latency = draw_latency(self.gen, rand, n, dev, self.centre_latency)
        if self.replay and self.physics is not None:
            physics, latency = self._replay_hard(mask, physics, latency)
        s = self.state
        s.latency = torch.where(mask, latency, s.latency)
        if self.replay:                                  # the record only replay reads
            self.physics = physics if self.physics is None else {
                k: torch.where(mask[:, None], v, self.physics[k]) for k, v in physics.items()}
        noise = (-rand.start_noise, rand.start_noise)
        arm_q = self.home + uniform(self.gen, (n, len(self.home)), noise, dev, torch.float32)
        return EpisodeStart(physics=physics, joint_angles=full_pose(self.dyn, arm_q), target=self._next_targets(mask))

    def _replay_hard(self, mask: torch.Tensor, physics: dict[str, torch.Tensor], latency: torch.Tensor):
        """Where `mask`, a share `replay` of the new episodes take the physics and latency of
        one of the worst quarter of the episodes ending now (those with a window end), by mean
        window error; without a host sync."""
        s, n, dev = self.state, self.num_envs, self.device
        ended = mask & (s.windows > 0)
        error = torch.where(ended, s.error_sum / s.windows.clamp(min=1), -torch.inf)
        worst = torch.argsort(error, descending=True)
        hard = (ended.sum() + 3) // 4
        pick = worst[(uniform(self.gen, (n,), (0.0, 1.0), dev, torch.float32) * hard).long().clamp(max=n - 1)]
        use = mask & (hard > 0) & (uniform(self.gen, (n,), (0.0, 1.0), dev, torch.float32) < self.replay)
        replayed = {k: torch.where(use[:, None], self.physics[k][pick], v) for k, v in physics.items()}
        return replayed, torch.where(use, s.latency[pick], latency)

    def reset(self, mask: torch.Tensor, reading: torch.Tensor, start: EpisodeStart) -> None:
        """Start the task where `mask` [N], the arms placed and reading `reading` [N, A]:
        torque on holds where the arm is (goal := present), the drawn target, counters zeroed."""
        s, m = self.state, mask[:, None]
        s.target = torch.where(m, start.target, s.target)
        s.last_action = torch.where(m, 0.0, s.last_action)
        s.goal = torch.where(m, reading, s.goal)
        s.goals_in_flight = torch.where(mask[:, None, None], reading[:, None], s.goals_in_flight)
        s.last_reading = torch.where(m, reading, s.last_reading)
        s.past_readings = torch.where(mask[:, None, None], reading[:, None], s.past_readings)
        s.past_goals = torch.where(mask[:, None, None], reading[:, None], s.past_goals)
        s.steps = torch.where(mask, 0, s.steps)
        s.error_sum = torch.where(mask, 0.0, s.error_sum)
        s.windows = torch.where(mask, 0.0, s.windows)
        if self.cfg.critic_physics:
            drawn = privileged(start.physics, s.latency, self.servo.params, self.arm)
            s.privileged = torch.where(m, drawn, s.privileged)
        self.episodes.reset(mask)

    def restart_targets(self) -> None:
        """Given targets start over from the first (a full reset)."""
        self.handed_out = 0

    def stagger(self, quantum: int) -> None:
        """Spread episode starts over the episode length in steps of `quantum` (the rollout
        length), so time-outs do not all land in the same iteration."""
        slots = max(1, self.cfg.episode_steps // quantum)
        k = torch.randint(0, slots, (self.num_envs,), generator=self.gen)
        self.state.steps = (k * quantum).to(self.device)

    def _next_targets(self, mask: torch.Tensor) -> torch.Tensor:
        """New targets [N, 3], used where `mask`. Given targets are handed out in order, one
        per window that ends, to the environments that need one (in env order)."""
        if self.given_targets is not None:
            rank = torch.cumsum(mask.long(), 0) - 1
            idx = (self.handed_out + rank.clamp(min=0)) % len(self.given_targets)
            self.handed_out += int(mask.sum())
            return self.given_targets[idx]
        return draw_targets(self.target_pool, self.num_envs, self.gen)

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "episodes": self.episodes.state_dict(), "state": self.state.as_dict(),
                "handed_out": self.handed_out, "physics": self.physics}

    def load_state_dict(self, state: dict) -> None:
        held = state["state"]["target"].shape[0]
        if held != self.num_envs:
            raise ValueError(f"task state holds {held} environments, this task has {self.num_envs}")
        self.gen.set_state(state["gen"])
        self.episodes.load_state_dict(state["episodes"])
        self.state = TaskState(**{k: v.to(self.device) for k, v in state["state"].items()})
        self.handed_out = state["handed_out"]
        physics = state["physics"]
        self.physics = None if physics is None else {k: v.to(self.device) for k, v in physics.items()}
