"""The reach task, defined once for every backend and for the robot.

Pure batched PyTorch functions of tensors: command sampling, the observation (the
deployment contract: the robot builds its observation with `observe` too), the action
mapping, rewards, terminations and domain-randomization sampling. The task's step rules
(soarm/reach_task.py, which both simulators wrap) and the robot runtime call these.

Observation, in order (units as the real arm measures them, encoder-quantized):
    joint_pos        5  rad, measured arm joint angles minus the home pose
    joint_vel        5  rad/s, (measured_t - measured_{t-1}) * control_hz
    joint_goal       5  rad, the goal currently commanded minus the home pose
    fingertip        3  m, forward kinematics of the measured angles (base frame)
    target           3  m, commanded fingertip position (base frame)
    target_error     3  m, target - fingertip
    last_action      5  the previous policy output (unitless, before scaling)
With ReachCfg.obs_history = H > 0, then (obs_terms):
    past_joint_pos   5H rad, the readings of the last H observations, newest first, minus home
    past_joint_goal  5H rad, the goals observed with them, minus home
With ReachCfg.fine_error = s > 0, last:
    target_error_fine 3 tanh(target_error / s): the error near the goal at a gain the
                        normalizer keeps (target_error's spread over training is ~0.1 m, so
                        a millimetre reaches the network as 1 % of its spread)
Action: 5 values, relative joint-position targets (Isaac Lab's "relative joint position"
action): goal_t = goal_{t-1} + scale * clip(action, +-clip), kept within max_relative_target
of the measured angles and goal_margin inside the joint limits (ActionBounds); goal :=
measured at start. The commanded goal is the controller's state, so
the policy observes it. Relative targets make the policy a feedback law on the target
error: it integrates away gravity sag and friction, which absolute targets cannot do
without learning inverse kinematics to a fraction of a milliradian.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from soarm.description import RobotDescription
from soarm.dynamics import ArmDynamics
from soarm.servo import TICK, ServoParams

OBS_TERMS: tuple[tuple[str, int, str], ...] = (
    ("joint_pos", 5, "rad"),
    ("joint_vel", 5, "rad/s"),
    ("joint_goal", 5, "rad"),
    ("fingertip", 3, "m"),
    ("target", 3, "m"),
    ("target_error", 3, "m"),
    ("last_action", 5, "1"),
)
OBS_DIM = sum(n for _, n, _ in OBS_TERMS)


def obs_terms(history: int, fine_error: float = 0.0) -> tuple[tuple[str, int, str], ...]:
    """The observation's terms with `history` past control ticks appended (ReachCfg.obs_history):
    the readings and the goals of ticks t-1 .. t-history, newest first, minus the home pose;
    then, with `fine_error` > 0 (m, ReachCfg.fine_error), the saturated target error."""
    terms = OBS_TERMS
    if history:
        terms += (("past_joint_pos", 5 * history, "rad"), ("past_joint_goal", 5 * history, "rad"))
    if fine_error > 0:
        terms += (("target_error_fine", 3, "1"),)
    return terms


def obs_dim(history: int, fine_error: float = 0.0) -> int:
    return sum(n for _, n, _ in obs_terms(history, fine_error))


def term_slices(terms: tuple[tuple[str, int, str], ...]) -> dict[str, slice]:
    ends = [sum(k for _, k, _ in terms[:i + 1]) for i in range(len(terms))]
    return {name: slice(end - k, end) for (name, k, _), end in zip(terms, ends)}


# Each term's columns in the observation, e.g. obs[:, OBS_SLICES["joint_vel"]].
OBS_SLICES: dict[str, slice] = term_slices(OBS_TERMS)
ACTION_DIM = 5


# What the critic alone observes with ReachCfg.critic_physics (an asymmetric actor-critic, as
# Isaac Lab's "critic" observation group): the episode's drawn physics of the arm joints,
# in units that keep each term near 1 so the observation normalizer's eps does not flatten it.
# Never exported: the policy acts on `obs_terms` only.
PRIVILEGED_TERMS: tuple[tuple[str, int, str], ...] = (
    ("log_gain_scale", 5, "1"), ("coulomb", 5, "x servo"), ("viscous", 5, "x servo"),
    ("friction_load", 5, "x servo"), ("armature", 5, "x servo"), ("deadband", 5, "ticks"),
    ("mass_scale", 5, "1"), ("encoder_offset", 5, "ticks"), ("backlash", 5, "deg"),
    ("payload", 1, "100 g"), ("pd", 1, "1"), ("log_pd_kp", 1, "log N m/rad"), ("pd_kv", 1, "N m s/rad"),
    ("pd_damping", 1, "N m s/rad"), ("pd_force", 1, "N m"), ("latency", 1, "ticks"),
)
PRIVILEGED_DIM = sum(n for _, n, _ in PRIVILEGED_TERMS)
PRIVILEGED_SLICES: dict[str, slice] = term_slices(PRIVILEGED_TERMS)   # within those columns


def privileged_dim(cfg: ReachCfg) -> int:
    """Columns the critic observes after the policy's observation."""
    return PRIVILEGED_DIM if cfg.critic_physics else 0


@dataclass
class CommandCfg:
    """Targets are fingertip positions of random joint configurations (so always reachable),
    kept only inside a region in front of the arm."""
    resample_s: float = 2.0                       # one target per window
    joint_margin: float = 0.15                    # rad kept clear of each joint limit
    pan_range: float = 1.2                        # |shoulder_pan| of sampled configurations
    radius: tuple[float, float] = (0.12, 0.36)    # m, horizontal distance from the base axis
    height: tuple[float, float] = (0.04, 0.32)    # m, above the base plane
    max_bearing: float = 1.2                      # rad, |atan2(y, x)| in front of the arm

    def validate(self) -> None:
        if not self.resample_s > 0:
            raise ValueError("command.resample_s: must be positive")
        if not (0 <= self.radius[0] < self.radius[1] and self.height[0] < self.height[1]):
            raise ValueError("command.radius/height: need [low, high] with low < high")


@dataclass
class RewardCfg:
    position_l2: float = -1.0          # * |target - fingertip| (m)
    position_tanh: float = 0.5         # * (1 - tanh(err / tanh_coarse))
    position_fine: float = 1.0         # * (1 - tanh(err / tanh_fine))
    tanh_coarse: float = 0.1           # m
    tanh_fine: float = 0.01            # m
    action_rate: float = -0.01         # * |a_t - a_{t-1}|^2
    joint_vel: float = -0.001          # * |measured joint velocity|^2
    end_ticks: int = 10                # control ticks at each target window's end that position_end pays on
    # weight * (1 - tanh(err / tanh_end)) on each window's last end_ticks: the error each window
    # is judged on, rewarded on a scale between tanh_fine's and tanh_coarse's, so that an arm
    # stuck a centimetre or two off (a soft or loaded drive) still gains by closing in where
    # position_fine is flat and position_tanh barely slopes. Bounded, so that a window far off
    # is not worth ending early (a linear price taught the policy to fall: docs/transfer.md, T).
    position_end: float = 0.0
    tanh_end: float = 0.03             # m
    # weight * |measured - home| (rad) per named arm joint (Isaac Lab's joint_deviation_l1).
    # Five joints place a 3-D point, so the arm has redundant directions that nothing else
    # prices; relative targets integrate any bias of the policy into drift along them.
    joint_deviation: dict[str, float] = field(default_factory=lambda: {"wrist_roll": -0.1})
    # weight * rad inside the soft limits, summed over the arm joints (Isaac Lab's
    # joint_pos_limits); the soft limits lie limit_margin inside each joint's limits. On the
    # arm a joint at its stop is where the safety clamp acts and the servo heats.
    joint_limit: float = 0.0
    limit_margin: float = 0.15         # rad
    floor: float = -5.0                # once, when the fingertip goes below floor_height
    floor_height: float = 0.0          # m

    def validate(self) -> None:
        if not self.limit_margin >= 0:
            raise ValueError("reward.limit_margin: must not be negative")
        if self.end_ticks < 1:
            raise ValueError("reward.end_ticks: must be at least 1")
        if not min(self.tanh_coarse, self.tanh_fine, self.tanh_end) > 0:
            raise ValueError("reward.tanh_coarse/tanh_fine/tanh_end: must be positive (m)")


@dataclass
class RandomizationCfg:
    """Drawn for each environment at every episode start (Isaac Lab's reset events)."""
    # Firmware loop-gain multiplier, drawn log-uniform: unit-to-unit spread, the P register
    # (LeRobot writes 16, the factory 32) and drives stiffer or softer than our servo model.
    gain_scale: tuple[float, float] = (0.85, 1.15)
    friction_scale: tuple[float, float] = (0.5, 1.5)
    mass_scale: tuple[float, float] = (0.9, 1.1)
    encoder_offset_ticks: int = 3               # uniform integer calibration error, +-ticks
    latency_ticks: tuple[int, int] = (0, 1)     # control ticks an env's goals reach the servos late, uniform
    backlash_deg: tuple[float, float] = (0.0, 0.0)   # free play of each gearbox, uniform
    payload_kg: tuple[float, float] = (0.0, 0.0)     # point mass held at the fingertip, uniform
    start_noise: float = 0.15                   # rad around home at episode start
    # A share of the arms driven by ideal position actuators (soarm.sim.implicit_pd: MuJoCo's
    # `position`, Isaac Lab's implicit actuator), as the published models of this arm are,
    # instead of the STS3215 model; one drive per arm, the same on every joint. Its damping
    # c = 2 * ratio * sqrt(kp * armature) is split between the actuator (kv, inside the force
    # limit: a stiff, fast servo) and the joint (outside it: a slow, rate-limited one).
    pd_share: float = 0.0
    pd_kp: tuple[float, float] = (5.0, 1000.0)          # N m/rad, log-uniform
    pd_damping_ratio: tuple[float, float] = (0.2, 0.8)  # uniform
    pd_kv_share: tuple[float, float] = (0.0, 1.0)       # of c inside the force limit, uniform
    pd_force: tuple[float, float] = (2.5, 4.0)          # N m, uniform
    # rad/s; > 0 caps the joint's share of the damping at force / this, the rest acting inside
    # the limit: a drive whose joint damping held it far below any servo's speed (0.4 rad/s at
    # kp 800) made an arm no policy could reach with.
    pd_min_top_speed: float = 0.0
    # Training only: this share of new episodes replays the physics and latency of a hard
    # episode, one of the worst quarter (by mean window error) of those ending in the same
    # step: the few arms that set the randomized row's tail are rare in the draw
    # (docs/transfer.md, Z). 0 draws every episode afresh.
    hard_replay: float = 0.0
    # Training draws around the task's `arm` (True) or around the servo model (False). The
    # transfer suite's randomized row draws around the task's arm either way.
    centre_on_arm: bool = False

    def validate(self) -> None:
        for name in ("gain_scale", "friction_scale", "mass_scale", "latency_ticks", "backlash_deg", "payload_kg",
                     "pd_kp", "pd_damping_ratio", "pd_kv_share", "pd_force"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"randomization.{name}: need [low, high] with 0 <= low <= high, got {[lo, hi]}")
        for name in ("gain_scale", "pd_kp"):
            if not getattr(self, name)[0] > 0:
                raise ValueError(f"randomization.{name}: must be positive (it is drawn log-uniform)")
        if not 0 <= self.pd_share <= 1 or self.pd_kv_share[1] > 1:
            raise ValueError("randomization.pd_share/pd_kv_share: shares must lie in [0, 1]")
        if not 0 <= self.hard_replay < 1:
            raise ValueError(f"randomization.hard_replay: a share in [0, 1), got {self.hard_replay}")
        if self.encoder_offset_ticks < 0 or self.start_noise < 0 or self.pd_min_top_speed < 0:
            raise ValueError("randomization.encoder_offset_ticks/start_noise/pd_min_top_speed: must not be negative")


@dataclass(frozen=True)
class ActionBounds:
    """How an action becomes the next goal (`action_to_goal`): the task's `action`, and what a
    policy file's contract says it was trained with."""
    scale: float = 0.05                         # rad of goal change per control step at action 1
    clip: float = 1.0                           # |action| clipped to this before scaling
    # rad: the goal is kept within this of the measured angle (LeRobot's max_relative_target).
    # Relative targets otherwise wind up on a joint slower than its goals (a stalled, loaded
    # or heavily damped drive) and overshoot by the wound-up lead when it catches up. None: off.
    max_relative_target: float | None = None
    # rad: goals are kept this far inside each arm joint's limits (soft limits on the command, as
    # Isaac Lab's soft_joint_pos_limit_factor): a joint held at its stop is where the servo
    # stalls and heats, and where the robot's safety clamp acts.
    goal_margin: float = 0.0

    def validate(self) -> None:
        if not (self.scale > 0 and self.clip > 0):
            raise ValueError("action.scale/action.clip: must be positive")
        if self.max_relative_target is not None and not self.max_relative_target > 0:
            raise ValueError("action.max_relative_target: must be positive (or null for none)")
        if not 0 <= self.goal_margin <= 0.5:
            raise ValueError("action.goal_margin: must be in 0..0.5 rad")


@dataclass
class ReachCfg:
    control_hz: float = 30.0
    substeps: int = 6                           # physics steps per control step (physics_dt = 1/180 s)
    episode_s: float = 8.0
    action: ActionBounds = field(default_factory=ActionBounds)
    # Past control ticks the policy observes (readings and goals, obs_terms): what a policy
    # needs to tell a soft arm from a stiff one before it has moved. 0: the present only.
    obs_history: int = 0
    # m; > 0 appends tanh(target_error / fine_error) to the observation (obs_terms): the last
    # millimetres at a gain the network can resolve. 0: not observed.
    fine_error: float = 0.0
    # The critic also observes the episode's drawn physics (PRIVILEGED_TERMS); the policy does not.
    critic_physics: bool = False
    servo: str = "servo/sts3215_7v4.yaml"       # relative to configs/
    # The project's model of the arm (soarm/arm_params.py: `soarm sysid`'s arm.yaml, relative to
    # configs/ or absolute): the emulator's plant, `soarm arm-check`'s default, the transfer
    # suite's nominal row, and training's centre where `randomization.centre_on_arm`
    # (`draw_physics`). None: the servo model alone.
    arm: str | None = None
    command: CommandCfg = field(default_factory=CommandCfg)
    reward: RewardCfg = field(default_factory=RewardCfg)
    randomization: RandomizationCfg = field(default_factory=RandomizationCfg)

    def validate(self) -> None:
        if not 1 <= self.control_hz <= 1000:
            raise ValueError("control_hz: must be in 1..1000")
        if not 1 <= self.substeps <= 100:
            raise ValueError("substeps: must be in 1..100 physics steps per control step")
        if not 0 <= self.obs_history <= 30:
            raise ValueError("obs_history: must be in 0..30 control ticks")
        if not 0 <= self.fine_error <= 1:
            raise ValueError("fine_error: must be in 0..1 m (0: not observed)")
        if not self.episode_s >= self.command.resample_s:
            raise ValueError("episode_s: must hold at least one target window")
        if self.reward.end_ticks > self.window_steps:
            raise ValueError(f"reward.end_ticks: {self.reward.end_ticks} is longer than a target window "
                             f"({self.window_steps} ticks)")

    @property
    def physics_dt(self) -> float:
        """s per physics step: every plant of this task (training, the emulator, identification) steps this."""
        return 1.0 / (self.control_hz * self.substeps)

    @property
    def episode_steps(self) -> int:
        return round(self.episode_s * self.control_hz)

    @property
    def window_steps(self) -> int:
        return round(self.command.resample_s * self.control_hz)


# ---------------------------------------------------------------- the contract
def full_pose(dyn: ArmDynamics, arm_q: torch.Tensor) -> torch.Tensor:
    """All joint angles [N, J] from arm angles [N, 5], the gripper at its hold angle."""
    r = dyn.robot
    q = torch.full((arm_q.shape[0], dyn.J), r.gripper_hold, device=arm_q.device, dtype=arm_q.dtype)
    q[:, r.arm_index] = arm_q
    return q


def observe(dyn: ArmDynamics, arm_q: torch.Tensor, arm_q_prev: torch.Tensor, goal: torch.Tensor,
            target: torch.Tensor, last_action: torch.Tensor, control_hz: float,
            past_q: torch.Tensor | None = None, past_goal: torch.Tensor | None = None,
            fine_error: float = 0.0) -> torch.Tensor:
    """The policy observation [N, obs_dim] from encoder readings (rad), the commanded arm
    goal (rad), the target and the last action; with a history, the past readings and goals
    [N, H, A] (rad, newest first); with `fine_error` (m), the saturated error (obs_terms)."""
    home = torch.as_tensor(dyn.robot.home, device=arm_q.device, dtype=arm_q.dtype)
    tip = dyn.fingertip(full_pose(dyn, arm_q))
    vel = (arm_q - arm_q_prev) * control_hz
    terms = [arm_q - home, vel, goal - home, tip, target, target - tip, last_action]
    if past_q is not None and past_q.shape[1]:
        terms += [(past_q - home).flatten(1), (past_goal - home).flatten(1)]
    if fine_error > 0:
        terms.append(torch.tanh((target - tip) / fine_error))
    return torch.cat(terms, dim=-1)


def arm_limits(robot: RobotDescription, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(lower, upper) [A] of the arm joints (rad)."""
    idx = robot.arm_index
    return (torch.as_tensor(robot.lower[idx], device=device, dtype=dtype),
            torch.as_tensor(robot.upper[idx], device=device, dtype=dtype))


def action_to_goal(dyn: ArmDynamics, action: torch.Tensor, goal: torch.Tensor, measured: torch.Tensor,
                   bounds: ActionBounds) -> torch.Tensor:
    """The next arm goal [N, 5] (rad) from the current goal, the measured angles the policy
    observed and policy actions [N, 5]."""
    lo, hi = arm_limits(dyn.robot, action.device, action.dtype)
    lo, hi = lo + bounds.goal_margin, hi - bounds.goal_margin
    goal = goal + bounds.scale * torch.clamp(action, -bounds.clip, bounds.clip)
    if bounds.max_relative_target is not None:
        lead = bounds.max_relative_target
        goal = torch.clamp(goal, measured - lead, measured + lead)
    return torch.clamp(goal, lo, hi)


def push(line: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`x` [N, A] in front of the line `line` [N, L, A] (newest first), the oldest dropped; a
    line of length 0 (no history) stays empty."""
    return torch.cat((x[:, None], line[:, :-1]), dim=1) if line.shape[1] else line


def delay_goals(line: torch.Tensor, goal: torch.Tensor, delay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Latency: push this step's arm goal [N, A] into each env's delay line [N, D, A] (newest
    first) and return (the goal that reaches the servos now, `delay` [N] ticks old; the line)."""
    line = push(line, goal)
    applied = line.gather(1, delay[:, None, None].expand(-1, 1, line.shape[-1])).squeeze(1)
    return applied, line


def check_action(action: torch.Tensor) -> None:
    """NaN or infinite actions are a bug upstream: refuse them rather than simulate garbage."""
    if not bool(torch.isfinite(action).all()):
        raise ValueError("action contains NaN or inf; refusing to step the simulation")


# ---------------------------------------------------------------- commands
def sample_targets(dyn: ArmDynamics, cfg: CommandCfg, n: int, gen: torch.Generator) -> torch.Tensor:
    """n reachable fingertip targets [n, 3]: FK of random configurations inside the region."""
    r = dyn.robot
    idx = r.arm_index
    lo = torch.as_tensor(r.lower[idx] + cfg.joint_margin, dtype=dyn.dtype)
    hi = torch.as_tensor(r.upper[idx] - cfg.joint_margin, dtype=dyn.dtype)
    lo[0], hi[0] = -cfg.pan_range, cfg.pan_range
    out = torch.empty(n, 3, dtype=dyn.dtype)
    todo = torch.arange(n)
    for _ in range(50):
        m = 4 * len(todo)
        u = torch.rand(m, len(idx), generator=gen, dtype=dyn.dtype)
        tip = dyn.fingertip(full_pose(dyn, (lo + u * (hi - lo)).to(dyn.device))).cpu()
        ok = in_region(tip, cfg)
        good = tip[ok][: len(todo)]
        out[todo[: len(good)]] = good
        todo = todo[len(good):]
        if len(todo) == 0:
            return out.to(dyn.device)
    raise RuntimeError("command region too small: could not sample reachable targets")


def draw_targets(pool: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """n targets from a pool sampled once by `sample_targets`: a gather per draw instead
    of forward kinematics of fresh configurations."""
    idx = torch.randint(0, len(pool), (n,), generator=gen)
    return pool[idx.to(pool.device)]


def in_region(p: torch.Tensor, cfg: CommandCfg) -> torch.Tensor:
    radius = torch.hypot(p[:, 0], p[:, 1])
    bearing = torch.atan2(p[:, 1], p[:, 0]).abs()
    return ((radius >= cfg.radius[0]) & (radius <= cfg.radius[1]) & (p[:, 2] >= cfg.height[0])
            & (p[:, 2] <= cfg.height[1]) & (bearing <= cfg.max_bearing))


# ---------------------------------------------------------------- terminations
def terminations(cfg: RewardCfg, tip: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(terminated [N], below_floor [N]): an episode ends when the fingertip goes below the
    floor or the physics blew up (non-finite joints)."""
    below = tip[:, 2] < cfg.floor_height
    return below | ~torch.isfinite(q).all(-1), below


# ---------------------------------------------------------------- rewards
def deviation_weights(robot: RobotDescription, cfg: RewardCfg, device) -> torch.Tensor:
    """The joint_deviation weights as a vector over the arm joints [A], names checked."""
    unknown = sorted(set(cfg.joint_deviation) - set(robot.arm_joints))
    if unknown:
        raise ValueError(f"reward.joint_deviation: '{unknown[0]}' is not an arm joint "
                         f"({', '.join(robot.arm_joints)})")
    return torch.tensor([cfg.joint_deviation.get(n, 0.0) for n in robot.arm_joints], device=device)


def limit_clearance(robot: RobotDescription, arm_q: torch.Tensor) -> torch.Tensor:
    """Distance (rad) of each arm joint [N, A] to its nearer limit; negative beyond it."""
    lo, hi = arm_limits(robot, arm_q.device, arm_q.dtype)
    return torch.minimum(arm_q - lo, hi - arm_q)


def rewards(cfg: RewardCfg, *, error: torch.Tensor, action: torch.Tensor, last_action: torch.Tensor,
            joint_pos: torch.Tensor, joint_vel: torch.Tensor, clearance: torch.Tensor, deviation: torch.Tensor,
            below_floor: torch.Tensor, tail: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-term rewards [N] (already weighted); their sum is the step reward. `joint_pos`
    is measured minus home, `clearance` the measured `limit_clearance`, `deviation` the
    `deviation_weights`, `tail` [N] bool: this tick is one of its window's last `end_ticks`."""
    dist = error.norm(dim=-1)
    speed = joint_vel.square().sum(-1)
    return {
        "position_l2": cfg.position_l2 * dist,
        "position_tanh": cfg.position_tanh * (1 - torch.tanh(dist / cfg.tanh_coarse)),
        "position_fine": cfg.position_fine * (1 - torch.tanh(dist / cfg.tanh_fine)),
        "action_rate": cfg.action_rate * (action - last_action).square().sum(-1),
        "joint_vel": cfg.joint_vel * speed,
        "position_end": cfg.position_end * (1 - torch.tanh(dist / cfg.tanh_end)) * tail.to(dist.dtype),
        "joint_deviation": joint_pos.abs() @ deviation,
        "joint_limit": cfg.joint_limit * (cfg.limit_margin - clearance).clamp(min=0).sum(-1),
        "floor": cfg.floor * below_floor.to(error.dtype),
    }


def window_tail(steps: torch.Tensor, cfg: ReachCfg) -> torch.Tensor:
    """[N] bool: the tick being scored, the episode's `steps`-th (from 0), is one of its target
    window's last `reward.end_ticks`; the last of them is the window's end."""
    return steps % cfg.window_steps >= cfg.window_steps - cfg.reward.end_ticks


def uniform(gen: torch.Generator, shape, bounds: tuple[float, float], device, dtype) -> torch.Tensor:
    lo, hi = bounds
    return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=dtype).to(device)


def log_uniform(gen: torch.Generator, shape, bounds: tuple[float, float], device, dtype) -> torch.Tensor:
    lo, hi = bounds
    return torch.exp(uniform(gen, shape, (math.log(lo), math.log(hi)), device, dtype))


def draw_physics(gen: torch.Generator, cfg: RandomizationCfg, servo: ServoParams, n: int, J: int, device,
                 dtype=torch.float32, centre: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One draw of the randomized physical parameters (soarm.sim.Physics fields) for n arms,
    around the servo model's values, or around an identified arm (`centre`: its
    ArmParams.rows, [J] each): the drawn multipliers multiply its values, its armature,
    load-dependent friction and dead-band replace the servo model's, and the drawn backlash
    range's midpoint moves onto its play (never below 0)."""
    rnd = lambda bounds: uniform(gen, (n, J), bounds, device, dtype)  # noqa: E731
    per_arm = lambda x: x.expand(n, J)                                # noqa: E731
    base = centre or {"gain_scale": 1.0, "coulomb": servo.friction_coulomb, "viscous": servo.friction_viscous,
                      "mass_scale": 1.0, "friction_load": servo.friction_load, "armature": servo.armature,
                      "deadband": servo.deadband_ticks, "stiction": 0.0}
    fixed = lambda name: torch.as_tensor(base[name], device=device, dtype=dtype).expand(n, J).clone()  # noqa: E731
    drawn = {"gain_scale": base["gain_scale"] * log_uniform(gen, (n, J), cfg.gain_scale, device, dtype),
             "coulomb": base["coulomb"] * rnd(cfg.friction_scale),
             "viscous": base["viscous"] * rnd(cfg.friction_scale),
             "mass_scale": base["mass_scale"] * rnd(cfg.mass_scale),
             "encoder_offset": tick_offsets(gen, (n, J), cfg.encoder_offset_ticks, device, dtype),
             "backlash": rnd(tuple(math.radians(b) for b in cfg.backlash_deg)),
             "payload": uniform(gen, (n, 1), cfg.payload_kg, device, dtype),
             # Not randomized, but drawn as the servo model's so that an identified arm can move them.
             "friction_load": fixed("friction_load"), "armature": fixed("armature"), "deadband": fixed("deadband"),
             "stiction": fixed("stiction")}
    if centre is not None:
        mid = math.radians(sum(cfg.backlash_deg) / 2)
        drawn["backlash"] = torch.clamp(drawn["backlash"] + centre["backlash"] - mid, min=0.0)
    kp = log_uniform(gen, (n, 1), cfg.pd_kp, device, dtype)
    c = 2 * uniform(gen, (n, 1), cfg.pd_damping_ratio, device, dtype) * torch.sqrt(kp * servo.armature)
    inside = uniform(gen, (n, 1), cfg.pd_kv_share, device, dtype)
    pd = uniform(gen, (n, 1), (0.0, 1.0), device, dtype) < cfg.pd_share
    force = uniform(gen, (n, 1), cfg.pd_force, device, dtype)
    outside = (1 - inside) * c
    if cfg.pd_min_top_speed > 0:
        outside = torch.minimum(outside, force / cfg.pd_min_top_speed)
    drawn.update(pd=per_arm(pd), pd_kp=per_arm(kp), pd_kv=per_arm(c - outside), pd_damping=per_arm(outside),
                 pd_force=per_arm(force))
    # An ideal position drive stands for a published model's actuator, which has no gearbox; and
    # a stiff one closed on the output through play limit-cycles whatever its goal (kp ~600-900
    # N m/rad over 1 deg: 1-2 mm of fingertip jitter at a held goal), which no policy can undo.
    drawn["backlash"] = torch.where(drawn["pd"], 0.0, drawn["backlash"])
    return drawn


def privileged(physics: dict[str, torch.Tensor], latency: torch.Tensor, servo, arm: torch.Tensor) -> torch.Tensor:
    """The critic's view of each env's drawn physics [N, PRIVILEGED_DIM] (PRIVILEGED_TERMS),
    from `draw_physics`'s fields [N, J] ([N, 1] payload) and the latency [N] (ticks)."""
    ratio = lambda x, ref: x / ref if ref else x     # noqa: E731 - a servo model without the term
    j = {k: v[:, arm].float() for k, v in physics.items() if k != "payload"}
    one = lambda name: j[name][:, :1]                 # noqa: E731 - one drive per arm, the same on every joint
    terms = {"log_gain_scale": j["gain_scale"].log(), "coulomb": ratio(j["coulomb"], servo.friction_coulomb),
             "viscous": ratio(j["viscous"], servo.friction_viscous),
             "friction_load": ratio(j["friction_load"], servo.friction_load),
             "armature": ratio(j["armature"], servo.armature), "deadband": j["deadband"],
             "mass_scale": j["mass_scale"], "encoder_offset": j["encoder_offset"] / TICK,
             "backlash": torch.rad2deg(j["backlash"]), "payload": physics["payload"] * 10.0, "pd": one("pd"),
             "log_pd_kp": one("pd_kp").log(), "pd_kv": one("pd_kv"), "pd_damping": one("pd_damping"),
             "pd_force": one("pd_force"), "latency": latency[:, None].float()}
    return torch.cat([terms[name] for name, _, _ in PRIVILEGED_TERMS], dim=-1)


def draw_latency(gen: torch.Generator, cfg: RandomizationCfg, n: int, device,
                 centre: int | None = None) -> torch.Tensor:
    """Each env's goal latency in control ticks [n] (long), uniform over cfg.latency_ticks, or
    that range moved so that its midpoint is an identified arm's latency (`centre`, ticks)."""
    lo, hi = cfg.latency_ticks
    drawn = torch.randint(lo, hi + 1, (n,), generator=gen).to(device)
    return drawn if centre is None else torch.clamp(drawn + centre - round((lo + hi) / 2), min=0)


def max_latency(cfg: RandomizationCfg, centre: int | None = None) -> int:
    """The most control ticks `draw_latency` returns: how long a goal line must be."""
    lo, hi = cfg.latency_ticks
    return hi if centre is None else max(0, hi + centre - round((lo + hi) / 2))


def tick_offsets(gen: torch.Generator, shape, max_ticks: int, device, dtype) -> torch.Tensor:
    ticks = torch.randint(-max_ticks, max_ticks + 1, shape, generator=gen)
    return (ticks * TICK).to(device=device, dtype=dtype)
