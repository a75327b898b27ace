#!/usr/bin/env bash
# What a GPU host checks (issue 24), in one run that fits a short lease: the tests that need CUDA,
# then the large-batch benchmarks, most wanted first. Each step has a time limit of its own, so
# a lease that ends early still leaves the steps done so far.
#
#   bench/gpu_checks.sh [OUTDIR]        # default: $OUT, else bench/out/gpu
#   PYTHON=.venv/bin/python bench/gpu_checks.sh
#   GPU_CHECKS_BUDGET_S=560 GPU_CHECKS_SKIP="tests epoch_costs_gpu_8" bench/gpu_checks.sh
#
# Writes OUTDIR/<step>.txt (the whole output) and OUTDIR/summary.txt (each step's exit status,
# time and last lines). Where CUDA is missing, the tests skip and the GPU benchmarks say so.
# The steps' limits add up to more than one 10-minute command: a step that could run past
# GPU_CHECKS_BUDGET_S (default 560) seconds from the start is skipped and named in the summary,
# and a second run with GPU_CHECKS_SKIP (step names) does the rest.
set -u

out=${1:-${OUT:-bench/out/gpu}}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}"
summary="$out/summary.txt"
: > "$summary"

budget=${GPU_CHECKS_BUDGET_S:-560}
skip=" ${GPU_CHECKS_SKIP:-} "
began=$(date +%s)

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 started rc
    shift 2
    if [[ "$skip" == *" $name "* ]]; then
        echo "== $name: skipped (GPU_CHECKS_SKIP)" >> "$summary"
        return
    fi
    if (( $(date +%s) - began + limit > budget )); then
        echo "== $name: skipped, could run past the ${budget} s budget (run again with GPU_CHECKS_SKIP)" \
            >> "$summary"
        return
    fi
    echo "== $name (limit ${limit}s): $*" >> "$summary"
    started=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.txt" 2>&1
    rc=$?
    echo "   exit $rc after $(( $(date +%s) - started )) s$([ "$rc" = 124 ] && echo ' (time limit)')" \
        >> "$summary"
    tail -n 6 "$out/$name.txt" | sed 's/^/   | /' >> "$summary"
}

{
    date -u
    nproc
    "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
} > "$out/host.txt" 2>&1

# The GPU paths' tests: pinned slabs, CUDA's descriptors told apart by the leak guard.
step tests 150 "$py" -m pytest tests -k "pin or cuda or slab" -q -p no:cacheprovider
# Issue 24's 16-core targets: per-epoch workers pinned and copied to the GPU (>= 1.8x torch),
# a new loader per epoch (>= 1.2x), gpu_copy with 4 workers (>= 1.8x).
step epoch_costs_gpu_8 120 "$py" -m bench.epoch_costs --num-workers 8 --gpu-copy
step gpu_copy_4 90 "$py" -m bench.run --workload gpu_copy --num-workers 4 --repeats 3
step epoch_costs_8 90 "$py" -m bench.epoch_costs --num-workers 8
# What a fresh pinned loader's first epoch pays for its slabs: fresh pages, page-locking, copies.
step pin_costs 40 "$py" -m bench.pin_costs --threads 1,18
# Without persistent loaders alive beside them (their workers share the main process's pages, which
# then stay in small pages): what a script with one per-epoch loader sees, forks in huge pages.
step epoch_costs_8_per_epoch 60 "$py" -m bench.epoch_costs --num-workers 8 --scenario per-epoch \
    --scenario new-loader
step epoch_costs_gpu_4 60 "$py" -m bench.epoch_costs --num-workers 4 --gpu-copy \
    --scenario per-epoch --scenario persistent
# Where a new set of workers spends its time when eight are forked: with the main process's memory
# gathered into huge pages (PIPELOAD_HUGE_HEAP's default with CPUs to spare), then without.
step worker_churn_8 45 "$py" -m bench.worker_churn --num-workers 8 --epochs 6
step worker_churn_8_small_pages 45 "$py" -m bench.worker_churn --num-workers 8 --epochs 6 --huge-heap off
# What writing samples into their rows as they are fetched is worth with eight workers.
step sample_rows_8 60 "$py" -m bench.sample_rows --num-workers 8 --sizes-kib 64,600 --items 4096
# Economic mode's main process with many item workers: pieces cut by the rule against fine ones,
# then its CPU a JPEG sample (issue 24: the next limit on small items with 16 cores).
step piece_sizes 40 "$py" -m bench.piece_sizes --workers 2,8,14
step process_time 40 "$py" -m bench.process_time --rounds 1 --workers 2,8,14
# Where eight new workers' CPU goes, by kernel path (only where perf is installed).
if command -v perf > /dev/null; then
    step perf_split_8 60 "$py" -m bench.perf_split --num-workers 8 --epochs 6
fi

cat "$summary"
