#!/usr/bin/env bash
# Run the megatron_tc pipeline (convert -> select -> stats -> init -> stage1 -> stage2 -> eval ->
# export) that a YAML config names. Launching only: every decision lives in tools/distill.py.
#
#   bash launch/distill.sh [CONFIG] [key=value ...]      (no CONFIG: configs/quickstart.yaml)
#
# Modes, chosen from the environment:
#   workstation  plain shell: starts the `deepspeed` launcher over the local GPUs (or NPROC gloo
#                ranks on CPU, default 2, OMP_NUM_THREADS = cores / ranks), each rank re-entering
#                this script. NPROC=N or --num_gpus N picks the number of ranks.
#   per-rank     RANK and LOCAL_RANK already set (`deepspeed --no_python [--hostfile F]
#                launch/distill.sh ...`, torchrun --no-python, or the workstation mode above):
#                runs one rank of `python tools/distill.py`.
#   slurm        inside a Slurm job step (`srun bash launch/distill.sh ...`): one rank per task;
#                RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from SLURM_*.
#   --print-env  prints the environment the current mode would give a rank, and exits.
#   --free-port  prints a TCP port free on this host (the sbatch script shares it as MASTER_PORT).
#
# NVLink multicast (NVLS) is left as the environment has it. MEGATRON_TC_DISABLE_NVLS=1 turns it off
# for every rank (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1), e.g.
# on hosts whose GPUs are partitioned or shared, where multicast objects cannot be created.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SELF="$ROOT/launch/distill.sh"
PYTHON="${PYTHON:-python}"

if [[ "${MEGATRON_TC_DISABLE_NVLS:-0}" == 1 ]]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# First host of a Slurm node list: "gpu-[003-005,9],cpu1" -> "gpu-003".
first_slurm_host() {
  local list="$1"
  local first=""
  if command -v scontrol >/dev/null 2>&1; then
    first="$(scontrol show hostnames "$list" 2>/dev/null | head -n 1 || true)"
  fi
  if [[ -n "$first" ]]; then echo "$first"; return; fi
  local prefix="${list%%[,\[]*}"
  local rest="${list:${#prefix}}"
  if [[ "$rest" == \[* ]]; then
    local inner="${rest#\[}"
    local suffix="${inner#*\]}"
    inner="${inner%%\]*}"
    suffix="${suffix%%,*}"
    echo "${prefix}${inner%%[,-]*}${suffix}"
  else
    echo "$prefix"
  fi
}

# Tasks on this node: SLURM_NTASKS_PER_NODE, else the first entry of "4(x2),3".
slurm_local_world_size() {
  if [[ -n "${SLURM_NTASKS_PER_NODE:-}" ]]; then echo "$SLURM_NTASKS_PER_NODE"; return; fi
  local tasks="${SLURM_STEP_TASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}"
  tasks="${tasks%%,*}"
  echo "${tasks%%(*}"
}

# Export the per-rank variables torch.distributed / DeepSpeed read, from SLURM_*.
derive_slurm_env() {
  local nodelist="${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}}"
  if [[ -z "$nodelist" ]]; then
    echo "distill.sh: SLURM_JOB_NODELIST is not set; run inside an allocation (srun ...)" >&2
    return 1
  fi
  export RANK="$SLURM_PROCID"
  export LOCAL_RANK="${SLURM_LOCALID:-0}"
  export WORLD_SIZE="${SLURM_NTASKS:-${SLURM_NPROCS:-1}}"
  export LOCAL_WORLD_SIZE="$(slurm_local_world_size)"
  export NODE_RANK="${SLURM_NODEID:-0}"
  export MASTER_ADDR="${MASTER_ADDR:-$(first_slurm_host "$nodelist")}"
  # launch/slurm/distill.sbatch exports a port found free on the first node; a bare `srun` gets one
  # derived from the job id (the same on every task, but not checked for being free).
  export MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
}

# A TCP port nothing listens on now: the kernel's pick for port 0 (what torchrun does for a
# single-node rendezvous); a clash needs another program to bind it in the moment before rank 0 does.
# Without a working $PYTHON (--print-env on a bare host): a random port of the usual range.
free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])' 2>/dev/null \
    || echo $((29500 + RANDOM % 1000))
}

detect_mode() {
  if [[ -n "${RANK:-}" && -n "${LOCAL_RANK:-}" ]]; then
    echo per-rank
  elif [[ -n "${SLURM_JOB_ID:-}" && -n "${SLURM_PROCID:-}" && -n "${SLURM_STEP_ID:-${SLURM_STEPID:-}}" ]]; then
    echo slurm
  else
    echo workstation
  fi
}

count_gpus() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

# The GPUs a workstation run may use: CUDA_VISIBLE_DEVICES's indices when it is set (empty: none),
# else 0..N-1 of the GPUs nvidia-smi lists. Prints them comma-separated.
visible_gpus() {
  local gpus="$1" ids=() id
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    IFS=',' read -r -a ids <<< "$CUDA_VISIBLE_DEVICES"
    for id in "${ids[@]}"; do
      if ! [[ "$id" =~ ^[0-9]+$ ]]; then
        echo "launch/distill.sh: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES: give GPU indices (e.g. 0,2); the" \
             "launcher passes them to DeepSpeed's --include, which takes no UUIDs or MIG names" >&2
        return 1
      fi
    done
  else
    for (( id = 0; id < gpus; id++ )); do ids+=("$id"); done
  fi
  (IFS=','; echo "${ids[*]}")
}

print_env() {
  local name
  for name in MODE RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE NODE_RANK MASTER_ADDR MASTER_PORT \
              OMP_NUM_THREADS NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS; do
    echo "$name=${!name:-}"
  done
}

run_rank() {
  # `deepspeed` without --no_local_rank appends --local_rank=N; LOCAL_RANK already says it.
  local args=() a
  for a in "$@"; do [[ "$a" == --local_rank=* ]] || args+=("$a"); done
  cd "$ROOT"
  # this checkout's package, also when it is not pip-installed (or another copy is)
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  exec "$PYTHON" "$ROOT/tools/distill.py" "${args[@]}"
}

main() {
  local print=0
  if [[ "${1:-}" == "--print-env" ]]; then print=1; shift; fi
  if [[ "${1:-}" == "--free-port" ]]; then free_port; return; fi
  MODE="$(detect_mode)"
  case "$MODE" in
    slurm)
      derive_slurm_env
      export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"
      ;;
    per-rank)
      export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
      ;;
    workstation)
      local nproc=""
      if [[ "${1:-}" == "--num_gpus" ]]; then nproc="$2"; shift 2; fi
      local gpus; gpus="$(count_gpus)"
      local devices=""
      if (( gpus > 0 )); then
        devices="$(visible_gpus "$gpus")" || exit 2
        gpus=$(( ${#devices} ? $(tr -cd ',' <<< "$devices" | wc -c) + 1 : 0 ))
      fi
      local cores; cores="$(nproc 2>/dev/null || echo 1)"
      nproc="${nproc:-${NPROC:-}}"
      if [[ -z "$nproc" ]]; then
        # GPUs: one rank each. CPU: two gloo ranks (data-parallel statistics, layers aligned in
        # parallel, data-parallel ZeRO over both) beat one rank whose small kernels use two threads poorly.
        if (( gpus > 0 )); then nproc="$gpus"; elif (( cores >= 2 )); then nproc=2; else nproc=1; fi
      fi
      if (( gpus == 0 )); then
        # Gloo ranks share the cores; more threads than cores per rank only thrash.
        export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / nproc > 0 ? cores / nproc : 1 ))}"
        export LOCAL_SIZE="$nproc"  # DeepSpeed's CPU accelerator counts "devices" from it
      fi
      local port="${MASTER_PORT:-$(free_port)}"
      if (( gpus > 0 && nproc > gpus )); then
        echo "launch/distill.sh: $nproc ranks asked for (NPROC or --num_gpus) but $gpus GPU(s) are visible" \
             "(${devices}); ask for at most $gpus, or run on CPU with CUDA_VISIBLE_DEVICES=" >&2
        exit 2
      fi
      # with CUDA_VISIBLE_DEVICES the ranks get those GPUs by index (DeepSpeed's --num_gpus would
      # take 0..N-1 whatever is visible)
      local where=(--num_gpus "$nproc")
      if (( gpus > 0 )) && [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        where=(--include "localhost:$(cut -d, -f"1-$nproc" <<< "$devices")")
      fi
      if (( print )); then
        NPROC="$nproc" MASTER_PORT="$port" print_env; echo "NPROC=$nproc"; echo "DEVICES=${where[*]}"; return
      fi
      # The `deepspeed` console script when it is on PATH (an activated venv), else the same
      # launcher through the interpreter that will run the ranks.
      local launcher=(deepspeed)
      command -v deepspeed >/dev/null 2>&1 || launcher=("$PYTHON" -m deepspeed.launcher.runner)
      exec "${launcher[@]}" --no_python --no_local_rank "${where[@]}" --master_port "$port" "$SELF" "$@"
      ;;
  esac
  if (( print )); then print_env; return; fi
  run_rank "$@"
}

main "$@"
