#!/usr/bin/env bash
# The GPU checks in one call, for a machine with a CUDA GPU that is held for a few minutes only: the CUDA
# tests, then the GPU benchmarks (inference from NVMe and from host memory, activation checkpointing,
# bench_gpu's overhead and ratio sections). Every step runs under its own cap and under one wall-clock
# budget shared by all; a step the budget cannot fit is skipped and said so. Logs and the benchmarks' JSON
# and tables end up in OUT_DIR/gpu_check.tgz, the one-line outcome of each step in OUT_DIR/summary.txt.
#
#   python setup.py build_ext --inplace          # the extensions for this machine's Python, first
#   scripts/gpu_check.sh OUT_DIR [BUDGET_S]       # BUDGET_S: default 540
#
# Environment: PYTHON (default python3), ZO_TEST_IO_DIR (the NVMe folder, default /var/tmp).
set -u
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [BUDGET_S]}
budget=${2:-540}
py=${PYTHON:-python3}
nvme=${ZO_TEST_IO_DIR:-/var/tmp}
end=$(($(date +%s) + budget))
logs="$out/logs"
mkdir -p "$logs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 ZO_TEST_IO_DIR="$nvme"

# step NAME CAP_S CMD...: CMD under CAP_S seconds, or what is left of the budget if that is less
step() {
	local name=$1 cap=$2
	shift 2
	local left=$((end - $(date +%s) - 15))
	((left < cap)) && cap=$left
	if ((cap < 30)); then
		echo "$name: skipped, ${left} s of the budget left" | tee -a "$out/summary.txt"
		return
	fi
	local t0
	t0=$(date +%s)
	timeout -k 5 "$cap" "$@" >"$logs/$name.log" 2>&1
	local rc=$?
	echo "$name: rc $rc in $(($(date +%s) - t0)) s (cap $cap s)" | tee -a "$out/summary.txt"
	tail -n 15 "$logs/$name.log"
}

{
	nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
	nproc
	free -g | head -2
	df -h "$nvme" .
	"$py" -c "import sys, torch, transformers, accelerate; print(sys.version.split()[0], torch.__version__, \
torch.version.cuda, transformers.__version__, accelerate.__version__)"
	"$py" -c "import offload._aio, offload._cpu_optim; print('extensions import')"
} >"$logs/env.log" 2>&1
cat "$logs/env.log"

ckpt="$nvme/zo-gpu-check-ckpt-1b"
# the benchmarks' checkpoint is written (CPU and disk) while the tests use the GPU
"$py" -c "from benchmarks.bench_inference import write_checkpoint as w; w('$ckpt', '1b', 'fp32')" \
	>"$logs/checkpoint.log" 2>&1 &
writer=$!

step cuda_tests 200 "$py" -m pytest -q -m "" -k cuda -p no:cacheprovider -o addopts="" -ra tests \
	--junitxml="$logs/cuda_tests.xml"
wait "$writer"
echo "checkpoint: rc $?" | tee -a "$out/summary.txt"

inf=(-m benchmarks.bench_inference --size 1b --device cuda --batch 4 --new-tokens 8 --checkpoint "$ckpt"
	--nvme-path "$nvme")
step inference_nvme 170 "$py" "${inf[@]}"
step inference_cpu 110 "$py" "${inf[@]}" --param-tier cpu
step activations 110 "$py" -m benchmarks.bench_activations --preset 1.3b --device cuda \
	--contenders torch,ours-cpu --rounds 1 --nvme-path "$nvme"
left=$((end - $(date +%s) - 40))
step bench_gpu $((left + 20)) "$py" -m benchmarks.bench_gpu --sections overhead,ratio --budget-s "$left" \
	--nvme-path "$nvme"

rm -rf "$ckpt"
cp -r benchmarks/out "$out/bench_out" 2>/dev/null
tar czf "$out/gpu_check.tgz" -C "$out" logs bench_out 2>/dev/null && rm -rf "$logs" "$out/bench_out"
cat "$out/summary.txt"
