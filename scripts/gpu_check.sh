#!/usr/bin/env bash
# The GPU checks in one call, sized for a GPU held for a few minutes (default budget 450 s, under 8 minutes
# on an H100/H200): the CUDA tests, then benchmarks/bench_gpu.py's four sections - the largest model per
# configuration against plain torch (capacity), TFLOPS at sequence 2048 with activation checkpointing for a
# model larger than the GPU's memory (tflops), offload overhead against plain torch with and without
# zero_offload.delayed_update (overhead), offload_optimizer.ratio 0 / 0.5 / 1 (ratio). Every step runs under
# its own cap and under the one wall-clock budget; a step the budget cannot fit is skipped and said so.
# Logs and the benchmarks' JSON and tables end up in OUT_DIR/gpu_check.tgz, the one-line outcome of each
# step in OUT_DIR/summary.txt. GPU_CHECK_EXTRA=1 adds the inference and activation benchmarks (longer).
#
#   python setup.py build_ext --inplace          # the extensions for this machine's Python, first
#   scripts/gpu_check.sh OUT_DIR [BUDGET_S]       # BUDGET_S: default 450
#   GPU_CHECK_DRY_RUN=1 scripts/gpu_check.sh OUT  # no GPU: print each step's cap and command, run nothing
#
# Environment: PYTHON (default python3), ZO_TEST_IO_DIR (the NVMe folder, default /var/tmp).
set -u
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [BUDGET_S]}
budget=${2:-450}
py=${PYTHON:-python3}
nvme=${ZO_TEST_IO_DIR:-/var/tmp}
dry=${GPU_CHECK_DRY_RUN:-0}
extra=${GPU_CHECK_EXTRA:-0}
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
	if [[ $dry == 1 ]]; then
		echo "$name: cap $cap s: $*" | tee -a "$out/summary.txt"
		return
	fi
	local t0
	t0=$(date +%s)
	timeout -k 5 "$cap" "$@" >"$logs/$name.log" 2>&1
	local rc=$?
	echo "$name: rc $rc in $(($(date +%s) - t0)) s (cap $cap s)" | tee -a "$out/summary.txt"
	tail -n 15 "$logs/$name.log"
}

if [[ $dry != 1 ]]; then
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
fi

step cuda_tests 150 "$py" -m pytest -q -m "" -k cuda -p no:cacheprovider -o addopts="" -ra tests \
	--junitxml="$logs/cuda_tests.xml"

# bench_gpu shares what is left among its sections (capacity, tflops, overhead with the delayed update,
# ratio); 30 s stay for packing the results
left=$((end - $(date +%s) - 30))
((extra == 1)) && left=$((left / 2))
step bench_gpu $((left + 10)) "$py" -m benchmarks.bench_gpu --sections overhead,ratio,tflops,capacity \
	--budget-s "$left" --nvme-path "$nvme"

if ((extra == 1)); then
	ckpt="$nvme/zo-gpu-check-ckpt-1b"
	step checkpoint 60 "$py" -c "from benchmarks.bench_inference import write_checkpoint as w; w('$ckpt', '1b', 'fp32')"
	inf=(-m benchmarks.bench_inference --size 1b --device cuda --batch 4 --new-tokens 8 --checkpoint "$ckpt"
		--nvme-path "$nvme")
	step inference_nvme 120 "$py" "${inf[@]}"
	step activations 90 "$py" -m benchmarks.bench_activations --preset 1.3b --device cuda \
		--contenders torch,ours-cpu --rounds 1 --nvme-path "$nvme"
	rm -rf "$ckpt"
fi

[[ $dry == 1 ]] && exit 0
cp -r benchmarks/out "$out/bench_out" 2>/dev/null
tar czf "$out/gpu_check.tgz" -C "$out" logs bench_out 2>/dev/null && rm -rf "$logs" "$out/bench_out"
cat "$out/summary.txt"
