"""SO-ARM101 reach in Isaac Lab (direct workflow): the configuration.

Everything task-side comes from configs/task/reach.yaml through soarm.reach.ReachCfg, the
file the embedded simulator trains on: control rate, physics step, episode and target
windows, action scale, rewards, domain randomization. This class only adds what Isaac Lab
needs around it: the scene (our URDF converted to USD, one servo actuator per joint) and
Newton's MuJoCo-Warp solver.
"""

from __future__ import annotations

from isaaclab.envs import DirectRLEnvCfg
from isaaclab.scene import InteractiveSceneCfg
from isaaclab.sim import SimulationCfg
from isaaclab.utils import configclass
from isaaclab_newton.physics import MJWarpSolverCfg, NewtonCfg

from soarm import CONFIG_DIR, config
from soarm.description import load_robot
from soarm.reach import ACTION_DIM, OBS_DIM, ReachCfg, obs_dim, privileged_dim
from soarm.training.isaac.asset import articulation_cfg, usd_path


@configclass
class SO101SceneCfg(InteractiveSceneCfg):
    robot = None                                 # set in SO101ReachEnvCfg.__post_init__


@configclass
class SO101ReachEnvCfg(DirectRLEnvCfg):
    task_file: str = str(CONFIG_DIR / "task" / "reach.yaml")
    device: str = "cuda:0"
    # Placeholders: __post_init__ takes them from the task file.
    decimation: int = 1
    episode_length_s: float = 1.0
    action_space: int = ACTION_DIM
    observation_space: int = OBS_DIM
    state_space: int = 0
    compute_final_obs: bool = False              # the task hands over its own (reach_env.py)
    scene: SO101SceneCfg = SO101SceneCfg(num_envs=4096, env_spacing=1.0, replicate_physics=True)
    # use_newton_actuators=False: Newton runs only its own actuator types natively; ours is
    # an explicit model that Isaac Lab evaluates on the host every physics step.
    sim: SimulationCfg = SimulationCfg(
        use_newton_actuators=False,
        physics=NewtonCfg(solver_cfg=MJWarpSolverCfg(integrator="implicitfast", njmax=16, nconmax=8)))

    def __post_init__(self):
        task = config.load(ReachCfg, self.task_file)
        dt = task.physics_dt                                  # as the embedded simulator steps
        self.decimation, self.episode_length_s = task.substeps, task.episode_s
        self.observation_space = obs_dim(task.obs_history, task.fine_error)
        self.state_space = self.observation_space + privileged_dim(task) if task.critic_physics else 0
        self.sim.dt, self.sim.render_interval, self.sim.device = dt, task.substeps, self.device
        self.sim.physics.use_cuda_graph = self.device.startswith("cuda")
        self.scene.robot = articulation_cfg(load_robot(), usd_path(), task.servo, dt)
