"""Sluice benchmarks, in folders by concern; docs/benchmarks.md holds the numbers.

Run them from the repository root as modules (`python -m bench.throughput.offline ...`); each
prints one JSON object on stdout and a short table on stderr. `bench/run_cpu.sh`,
`bench/run_gpu.sh` and `bench/smoke.sh` run the suites.

At the top, what the folders share: `common` (threads, the machine, the output format),
`checkpoints` (random-weight checkpoints of real shapes, the model flags), `workload` (the
nano-vllm workload), `hf_reference` (the HF decode loop), `report` (markdown from results),
`decode` (decode step time; its modes live in step/) and `speculative` (speculative decoding
against none; its prompts in `speculative_prompts`). The folders: throughput/ (offline, prefix
cache, LoRA, fast path), step/ (where a decode step's time goes), sampler/, cpu/ (the CPU
compute path), service/ (serving over gRPC), ceiling/ (one service process's ceiling), text/
(detokenization, stop strings), structured/, rl/ (RL outputs, weight sync, Sleep), peers/
(against vLLM) and soak/.

May import: engine, service, sluice_client, tests.support. A folder imports the top-level
modules and, where its __init__ says so, another folder; of the top-level modules only `decode`
imports a folder (step/: its modes, op count and timers).
"""
