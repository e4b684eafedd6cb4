#!/usr/bin/env bash
# The GPU suite, for one H200 (under 9 minutes): the GPU tests first (the fast path against the
# reference, compiled: $OUT/gpu-tests.txt), then the fused sampler, then on random-weight
# checkpoints of real shapes, generated on the device (not carried): decode step time against
# the bandwidth roofline, serving over gRPC, offline vs HF; last the service's ceiling. Prints
# as it goes; JSON per benchmark under $OUT. Run from the checkout on a machine with one CUDA GPU:
#   bash bench/run_gpu.sh                 # BUDGET_S=500 by default: later steps are skipped
#   ONLY="gpu-tests checkpoints decode-qwen2.5-0.5b" bash bench/run_gpu.sh   # a rerun of some
# Needs torch with CUDA, Triton and transformers installed. Sluice's other dependencies and
# pytest may come as wheels in .whl/ (scripts/device_wheels.sh downloads them): when present
# they are installed into /tmp/site first, without an index, for a machine with no network.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
BUDGET_S=${BUDGET_S:-500}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1
export SLUICE_BENCH_CACHE=${SLUICE_BENCH_CACHE:-/tmp/sluice-bench}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD:$PWD/proto:$PWD/clients/python
else
  export PYTHONPATH=$PWD:$PWD/proto:$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" - <<'PYEOF' || exit 1
import torch, transformers, grpc, structlog  # noqa: F401  fail fast on a missing dependency
assert torch.cuda.is_available(), "no CUDA device"
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"grpc {grpc.__version__}, {torch.cuda.get_device_name()}", flush=True)
PYEOF
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader || true

failed=()
chosen() { [[ -z ${ONLY:-} || " $ONLY " == *" $1 "* ]]; }
step() {  # step NAME SECONDS MODULE ARGS...: skipped when the budget cannot cover SECONDS
  local name=$1 need=$2 start=$SECONDS left
  shift 2
  chosen "$name" || return 0
  left=$((BUDGET_S - SECONDS))
  if ((left < need / 2)); then
    echo "== $name: skipped, ${left} s of the budget left" >&2
    failed+=("$name(skipped)")
    return
  fi
  ((need > left)) && need=$left
  echo "== $name (limit ${need} s): $PY -m $*" >&2
  if timeout -k 10 "$need" "$PY" -m "$@" >"$OUT/$name.json"; then
    echo "== $name: ok, $((SECONDS - start)) s" >&2
  else
    echo "== $name: FAILED (rc $?) after $((SECONDS - start)) s" >&2
    failed+=("$name")
  fi
}

# Compiled on CUDA: the Triton attention, layer and sampler kernels, CUDA graphs, torch.compile,
# the kernel count of a graphed step.
GPU_TESTS=(tests/engine/execution/test_gpu_fast_path.py
  tests/engine/layers/test_layer_kernels.py tests/engine/layers/test_fused_layer.py
  tests/engine/layers/test_grouped_gemm_kernel.py tests/engine/execution/test_moe_graph_step.py
  tests/engine/lora/test_lora_kernel.py tests/bench/test_kernel_count.py
  tests/engine/attention/test_attention_triton.py tests/engine/execution/test_cuda_graph.py
  tests/engine/sampling/test_fused_sampler.py tests/engine/sampling/test_sampling.py)
if chosen gpu-tests; then
  echo "== gpu-tests (limit 240 s): pytest ${GPU_TESTS[*]}" >&2
  start=$SECONDS
  if timeout -k 10 240 "$PY" -m pytest -q -p no:cacheprovider "${GPU_TESTS[@]}" >"$OUT/gpu-tests.txt" 2>&1; then
    echo "== gpu-tests: ok, $((SECONDS - start)) s" >&2
  else
    echo "== gpu-tests: FAILED after $((SECONDS - start)) s; $OUT/gpu-tests.txt ends:" >&2
    failed+=(gpu-tests)
  fi
  tail -n 15 "$OUT/gpu-tests.txt" >&2
fi

# In order of what the next run must not miss (the first two runs, 2026-11-30, measured the
# sampler, the service's ceiling and qwen2.5-0.5b's decode, offline and served rates): the
# sampler, the decode step eager and compiled, the larger shapes, then the rest again.
# The fused sampler against the torch one on a Llama 3 vocabulary (fails on a different token).
step sampler 90 bench.sampler.fused --device cuda --batches 64 256 --vocab 128256 --variants
CK="bench.checkpoints --dtype bfloat16 --device cuda"
DEV="--device cuda --dtype bfloat16"
step checkpoints 60 $CK qwen2.5-0.5b
rm -f "$OUT/checkpoints.json"
step kernels-qwen2.5-0.5b 30 bench.decode --shape qwen2.5-0.5b --device cuda --count-kernels \
  --count-rows 64
step decode-qwen2.5-0.5b 60 bench.decode --shape qwen2.5-0.5b $DEV --batches 1 8 64 256
# The same step torch.compiled: eager, it launches ~1,000 kernels (about 43 per layer).
step decode-qwen2.5-0.5b-overlap 60 bench.decode --shape qwen2.5-0.5b $DEV --batches 1 8 64 256 \
  --overlap-steps
step decode-qwen2.5-0.5b-compiled 120 bench.decode --shape qwen2.5-0.5b $DEV --batches 1 8 64 256 \
  --compile
step checkpoints-more 150 $CK llama-3-8b qwen3-0.6b llama-3.2-1b
rm -f "$OUT/checkpoints-more.json"
step decode-llama-3-8b 90 bench.decode --shape llama-3-8b $DEV --batches 1 8 64 256
step decode-qwen3-0.6b 45 bench.decode --shape qwen3-0.6b $DEV --batches 1 64 256
step decode-llama-3.2-1b 45 bench.decode --shape llama-3.2-1b $DEV --batches 1 64 256
# Speculative decoding (issue 46): off, ngram and suffix in one run, on copy-heavy and free
# demo-corpus prompts, greedy and sampled, at batch 1 and 64 (above --speculative-max-batch: off
# per step). Random weights: acceptance is what this model happens to repeat. No draft: there
# is no draft shape of Qwen2.5-0.5B (the demo's draft is on the CPU suite).
# Alone: ONLY="checkpoints speculative-qwen2.5-0.5b" bash bench/run_gpu.sh
step speculative-qwen2.5-0.5b 150 bench.speculative --shape qwen2.5-0.5b $DEV --methods ngram suffix \
  --batches 1 64
step serve-qwen2.5-0.5b 100 bench.service.serve --shape qwen2.5-0.5b $DEV --scale 0.5 --rates inf 16 \
  --max-concurrency 64
step offline-qwen2.5-0.5b 200 bench.throughput.offline --shape qwen2.5-0.5b $DEV --hf-batch-sizes 256 \
  --kv-cache-gib 16
# Structured output on a 152k vocabulary: a batch under a JSON schema beside the same batch
# free (needs xgrammar: scripts/device_wheels.sh fetches it).
step structured-qwen2.5-0.5b 90 bench.structured.batch --shape qwen2.5-0.5b $DEV --batch 32 \
  --max-tokens 128 --repeat 2
# Mixture of experts (issue 29): Qwen3-30B-A3B's layer shape with 4 of its 48 layers (about 3B
# parameters, 6 GB in bfloat16), the grouped-GEMM experts beside a per-expert loop and HF, one run.
# Alone: ONLY="gpu-tests checkpoints-moe offline-qwen3-30b-a3b-4l" bash bench/run_gpu.sh
step checkpoints-moe 90 $CK qwen3-30b-a3b-4l
rm -f "$OUT/checkpoints-moe.json"
step offline-qwen3-30b-a3b-4l 150 bench.throughput.offline --shape qwen3-30b-a3b-4l $DEV --scale 0.25 \
  --hf-batch-sizes 64 --kv-cache-gib 16 --moe-loop
# Gemma 3 (issue 45): Gemma-3-4B's text layers with 6 of its 34 (five sliding of 1024, one
# full; about 1.2B parameters, 0.67B of them the 262k-row embedding). Prompts of 100-1024 and
# outputs of 100-1024 tokens: the later steps attend past the window. HF at batch 16: its
# prefill's logits over 262k ids for every prompt position are 8.6 GB at that batch.
# Alone: ONLY="checkpoints-gemma3 offline-gemma-3-4b-6l" bash bench/run_gpu.sh
step checkpoints-gemma3 120 $CK gemma-3-4b-6l
rm -f "$OUT/checkpoints-gemma3.json"
step offline-gemma-3-4b-6l 200 bench.throughput.offline --shape gemma-3-4b-6l $DEV --num-requests 64 \
  --hf-batch-sizes 16 --kv-cache-gib 16 --temperature 0
# gpt-oss (issue 45): gpt-oss-20b's layers with 4 of its 24 (two sliding of 128, two full;
# about 4.4B parameters, 8.7 GB in bfloat16, experts unquantized), greedy, HF beside it. Prompts
# and outputs of 100-1024 tokens: most steps attend past the window. HF at batch 16: its
# prefill's logits over 201k ids are 6.6 GB at that batch. No --moe-loop: the bench's
# per-expert loop has no expert biases.
# Alone: ONLY="checkpoints-gpt-oss offline-gpt-oss-20b-4l" bash bench/run_gpu.sh
step checkpoints-gpt-oss 120 $CK gpt-oss-20b-4l
rm -f "$OUT/checkpoints-gpt-oss.json"
step offline-gpt-oss-20b-4l 200 bench.throughput.offline --shape gpt-oss-20b-4l $DEV --num-requests 64 \
  --hf-batch-sizes 16 --kv-cache-gib 16 --temperature 0
# The service's ceiling in front of an instant stand-in engine (no GPU needed, the host's cores).
CEIL="bench.ceiling.run --streams 256 --step-ms 5 2.5 --clients 8 --seconds 4"
step service-ceiling 45 $CEIL
step service-ceiling-stream 45 $CEIL --rpc stream
step service-ceiling-interval 45 $CEIL --stream-interval 0.05

"$PY" -m bench.report "$OUT" >"$OUT/report.md" 2>&1 || true
cat "$OUT/report.md"
echo "== done in ${SECONDS} s; results in $OUT" >&2
if ((${#failed[@]})); then
  echo "== FAILED or skipped: ${failed[*]}" >&2
  exit 1
fi
