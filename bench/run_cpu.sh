#!/usr/bin/env bash
# The CPU benchmark suite (docs/benchmarks.md) on random-weight checkpoints built on first use.
#   bash bench/run_cpu.sh            # the full suite: 268 s measured on 2 idle cores
#                                    # (docs/benchmarks.md), 8 min 42 s on 2 busy ones
#   bash bench/run_cpu.sh --smoke    # the CI smoke (bench/smoke.sh): 136-202 s measured on 2
#                                    # cores at a load average of 5-11; exits 1 if one fails
# One JSON file per benchmark under $OUT (default bench/results/cpu-<mode>-<time>), tables on
# stderr; `python -m bench.report $OUT` renders the markdown of docs/benchmarks.md.
# Timings on a shared 2-core machine are noisy: the load average is printed and recorded; every
# ratio is between runs of the same invocation.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
MODE=full
[[ ${1:-} == --smoke ]] && MODE=smoke
OUT=${OUT:-bench/results/cpu-$MODE-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1
# Engine and HF run at the same torch thread count: 1 by default. With 2 threads on 2 cores,
# torch's OpenMP pool collapses (10-100x slower) whenever anything else runs on the machine,
# which on a shared machine is most of the time. The serving benchmark's engine process also
# gets 1 thread: the service process and the load generator need the other core.
THREADS=${THREADS:-1}

failed=()
run() { # run NAME MODULE ARGS...: stdout (one JSON object) to $OUT/NAME.json
  local name=$1 start=$SECONDS
  shift
  echo "== $name: $PY -m $*" >&2
  if "$PY" -m "$@" >"$OUT/$name.json" &&
    "$PY" -c 'import json, sys; json.loads(open(sys.argv[1]).read())' "$OUT/$name.json"; then
    echo "== $name: ok, $((SECONDS - start)) s" >&2
  else
    echo "== $name: FAILED after $((SECONDS - start)) s" >&2
    failed+=("$name")
  fi
}

echo "== $MODE CPU suite into $OUT; $(nproc) cores; load average: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
TINY=$("$PY" -m bench.checkpoints tiny) || exit 1

if [[ $MODE == smoke ]]; then
  # The serving benchmark reuses the offline engine rate of the same workload and settings
  # (one torch process fewer: most of the smoke's time is interpreter and torch start-up).
  run offline bench.throughput.offline --shape tiny --num-requests 8 --scale 0.05 --hf-batch-sizes 8 \
    --max-num-seqs 4 --threads 1
  # prefill in 16-token chunks: the first requests decode while the last ones still prefill
  run decode bench.decode --shape tiny --batches 1 8 --context 32 --steps 4 --bandwidth-mib 32 \
    --max-num-batched-tokens 16 --threads 1
  rate=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["engine"]["output_tokens_per_s"])' \
    "$OUT/offline.json" 2>/dev/null)
  run serve bench.service.serve --shape tiny --num-requests 8 --scale 0.05 --rates inf 20 \
    --max-concurrency 4 --threads 1 ${rate:+--offline-rate "$rate"}
  run prefix bench.throughput.prefix --shape tiny --groups 2 --waves 2 --prefix-len 64 --max-tokens 2 \
    --threads 1
  # 18 s of mixed traffic: a checkpoint update, an inline update, then an engine kill -9.
  run soak bench.soak.run --minutes 0.3 --update-every 8 --kill-every 15
  # The service in front of an instant stand-in engine, over GenerateStream (about 8 s).
  run service_ceiling bench.ceiling.run --streams 16 --step-ms 10 --low-streams 2 \
    --seconds 1 --warmup 0.5 --clients 1 --rpc stream
  # The same streams through sluice.v1, the OpenAI front and SMG, where present (about 6 s).
  run gateway bench.service.gateway --shape tiny --num-requests 16 --concurrency 8 --max-tokens 8 \
    --repeat 1 --threads 1
  # Detokenization per token, tables against DecodeStream (about 2 s).
  run detokenize bench.text.detokenize --vocab 2000 --corpus-mb 0.3 --tokens 2000 --repeat 1 \
    --load-vocab 5000
  # Prompt scoring beside prefill, SAMPLED logprobs and supports beside PROCESSED (about 3 s).
  run rl_outputs bench.rl.outputs --shape tiny --num-requests 8 --scale 0.05 --repeat 1 \
    --threads 1
  # A batch under a JSON schema beside the same batch free (about 5 s: xgrammar's import).
  run structured bench.structured.batch --shape tiny --batch 8 --max-tokens 16 --repeat 1 --threads 1
  # A batch over 1, 4 and 8 LoRA adapters beside the base model (about 6 s: peft's import).
  run lora bench.throughput.lora --shape tiny --batch 8 --prompt-len 16 --max-tokens 8 --repeat 1 --threads 1
  # Decode attention of a sliding-window layer beside a full one, the C kernel (about 1 s).
  run window_attention bench.cpu.window_attention --context 256 --window 32 --rows 2 --layers 1 \
    --heads 8 --kv-heads 2 --iters 2 --sinks --threads 1
  # Speculative decoding: each method beside off on copy and free prompts, the tiny model its
  # own draft (the demo and its draft would be trained first; about 5 CPU-seconds).
  run speculative bench.speculative --shape tiny --draft-model "$TINY" --batches 1 4 \
    --min-requests 4 --max-tokens 8 --passage-words 8 --threads 1
else
  # --repeat: engine and HF runs alternate and each side's best counts; likewise the serving
  # benchmark's offline reference runs and its rate-inf phases (a busy machine only slows runs).
  run offline bench.throughput.offline --shape tiny --scale 0.5 --hf-batch-sizes 16 64 --repeat 2 \
    --threads "$THREADS"
  run decode bench.decode --shape tiny --batches 1 8 64 256 --context 256 --steps 20 \
    --threads "$THREADS"
  run serve bench.service.serve --shape tiny --scale 0.5 --rates inf 8 4 --max-concurrency 64 \
    --repeat 3 --threads "$THREADS"
  run prefix bench.throughput.prefix --shape tiny --groups 8 --waves 4 --prefix-len 512 --threads "$THREADS"
  run service_ceiling bench.ceiling.run --seconds 4 --warmup 1.5
  run service_ceiling_stream bench.ceiling.run --seconds 4 --warmup 1.5 --rpc stream
  run gateway bench.service.gateway --shape tiny --num-requests 128 --concurrency 64 \
    --max-tokens 64 --repeat 3 --threads "$THREADS"
  run detokenize bench.text.detokenize
  run rl_outputs bench.rl.outputs --shape tiny --scale 0.5 --repeat 2 --threads "$THREADS"
  run structured bench.structured.batch --shape tiny --batch 32 --max-tokens 256 --repeat 3 \
    --threads "$THREADS"
  run lora bench.throughput.lora --shape tiny --batch 32 --prompt-len 64 --max-tokens 128 --repeat 3 \
    --threads "$THREADS"
  run window_attention bench.cpu.window_attention --context 4096 --window 128 --rows 8 \
    --threads "$THREADS"
  # On the demo model, its draft and its copy model, each trained on first use
  # (docs/architecture.md).
  run speculative bench.speculative --methods ngram suffix draft --batches 1 8 64 --repeat 3 \
    --threads "$THREADS"
fi

echo "== done in ${SECONDS} s; load average: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
if ((${#failed[@]})); then
  echo "== FAILED: ${failed[*]}" >&2
  exit 1
fi
