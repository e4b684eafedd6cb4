"""Markdown tables from a folder of benchmark JSON results (what docs/benchmarks.md holds).

python -m bench.report bench/results/cpu-20261130-120000
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any


def markdown(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.3f}"
    return str(value)


def _list(values: list[float]) -> str:
    return "/".join(f"{v:.0f}" for v in values) + " tok/s"


def offline(r: dict[str, Any]) -> str:
    w = r["workload"]
    rows = [["sluice LLMEngine", r["engine"]["seconds"], r["engine"]["output_tokens_per_s"]]]
    hf = "HF decode loop" if r.get("hf_reference") else "HF generate"  # results before it
    rows += [
        [f"{hf}, padded batch {h['batch_size']}", h["seconds"], h["output_tokens_per_s"]]
        for h in r["hf_runs"]
    ]
    ratio = r["ratio_engine_over_hf"]
    runs = ""
    if r.get("repeat", 1) > 1:
        every = [f"engine {_list(r['all_engine_tokens_per_s'])}"]
        every += [f"HF batch {k} {_list(v)}" for k, v in r["all_hf_tokens_per_s"].items()]
        runs = f"; best of {r['repeat']} alternating runs: " + ", ".join(every)
    return (
        f"**offline, {r['model']}** ({r['device']} {r['dtype']}, {r['threads']} torch threads; "
        f"{w['num_requests']} requests, prompts {w['prompt_len'][0]}..{w['prompt_len'][1]}, "
        f"outputs {w['output_len'][0]}..{w['output_len'][1]}, {w['output_tokens']} output "
        f"tokens, temperature {w['temperature']}, ignore_eos; engine max_num_seqs "
        f"{r['engine']['max_num_seqs']}{runs})\n\n"
        + markdown(["run", "seconds", "output tok/s"], rows)
        + (f"\n\nengine / fastest HF: **{ratio:.2f}x**" if ratio else "")
    )


def decode(r: dict[str, Any]) -> str:
    header = ["batch", "step ms", "tok/s", "roofline ms", "of roofline", "timed step", "forward"]
    header += ["schedule", "inputs", "sampling", "to host", "post", "host share"]
    rows = []
    for b in r["batches"]:
        p = b["instrumented_ms"]
        rows.append(
            [
                b["batch"],
                b["step_ms_median"],
                b["decode_tokens_per_s"],
                b["roofline_ms"],
                f"{b['roofline_fraction']:.1%}",
                p["step"],
                p["forward"],
                p["schedule"],
                p["prepare_inputs"],
                p["sampling"],
                p["to_host"],
                p["postprocess"],
                f"{p['host_fraction']:.0%}",
            ]
        )
    return (
        f"**decode, {r['model']}{', compiled' if r.get('compile') else ''}** "
        f"({r['device']} {r['dtype']}, {r['threads']} torch threads; "
        f"context {r['context']}, {r['steps']} timed steps, weights "
        f"{r['weight_bytes'] / 2**20:.1f} MiB, KV {r['kv_bytes_per_token']} B/token, measured "
        f"copy bandwidth {r['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s)\n\n"
        + markdown(header, rows)
        + "\n\nstep ms: median of plain `step()` calls. timed step and the columns after it "
        "(ms per step, means) come from steps run with timers wrapped around the engine's "
        "methods, alternating with the plain ones; host share = (timed step - forward) / timed "
        "step."
    )


def serve(r: dict[str, Any]) -> str:
    w = r["workload"]
    header = ["rate req/s", "req/s", "output tok/s", "TTFT p50", "TTFT p99", "TPOT p50"]
    header += ["TPOT p99", "ITL p50", "ITL p99", "tok/chunk", "failed", "cores: engine"]
    header += ["service", "client"]
    rows = [
        [
            p["rate"],
            p["requests_per_s"],
            p["output_tokens_per_s"],
            p["ttft"]["p50_ms"],
            p["ttft"]["p99_ms"],
            p["tpot"]["p50_ms"],
            p["tpot"]["p99_ms"],
            p["itl"]["p50_ms"],
            p["itl"]["p99_ms"],
            p["tokens_per_chunk"],
            p["failed"],
            p.get("cpu_cores", {}).get("engine", math.nan),
            p.get("cpu_cores", {}).get("service", math.nan),
            p.get("cpu_cores", {}).get("client", math.nan),
        ]
        for p in r["phases"]
    ]
    off = r["offline_engine"]
    ratio = r["ratio_served_over_offline"]
    concurrency = r["phases"][0]["max_concurrency"] if r["phases"] else "?"
    text = (
        f"**serving over gRPC, {r['model']}** ({r['device']} {r['dtype']}, engine torch threads "
        f"{r['engine_threads']}; {w['num_requests']} requests, {w['output_tokens']} output tokens, "
        f"at most {concurrency} in flight; prefix cache off; latencies in ms)\n\n"
        + markdown(header, rows)
    )
    if off and ratio:
        text += (
            f"\n\noffline engine on the same workload (max_num_seqs {concurrency}): "
            f"{off['output_tokens_per_s']:.0f} output tok/s"
            + (
                f" (runs: {_list(off['all_output_tokens_per_s'])})"
                if r.get("repeat", 1) > 1
                else ""
            )
            + f"; served / offline at rate inf (best runs): **{ratio:.2f}**"
            + (
                " (each rate-inf phase over the offline run just before it: "
                + ", ".join(f"{x:.2f}" for x in r["pair_ratios"])
                + ")"
                if r.get("pair_ratios")
                else ""
            )
            + ". cores: CPU time of each process over the phase's wall time."
        )
    return text


def prefix(r: dict[str, Any]) -> str:
    w = r["workload"]
    rows = [
        [
            "on" if side["prefix_cache"] else "off",
            f"{side['hit_ratio']:.1%}",
            f"{side['prompt_tokens_computed']:,}",
            side["ttft_mean_s"] * 1e3,
            side["ttft_p50_s"] * 1e3,
            side["ttft_p99_s"] * 1e3,
        ]
        for side in (r["cache_on"], r["cache_off"])
    ]
    header = ["prefix cache", "prompt tokens found in cache", "prefill tokens computed"]
    header += ["TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms"]
    return (
        f"**prefix cache, {r['model']}** ({r['device']} {r['dtype']}, {r['threads']} torch threads; "
        f"{w['groups']} groups x {w['waves']} waves, shared prefix {w['prefix_len']} tokens plus "
        f"1..{w['suffix_len']} private; identical outputs: {r['identical_outputs']})\n\n"
        + markdown(header, rows)
        + f"\n\nTTFT mean, off / on: **{r['ttft_mean_ratio_off_over_on']:.2f}x**"
    )


def peer_vllm(r: dict[str, Any]) -> str:
    w, same, hf = r["workload"], r["token_identity_sluice_vllm"], r.get("hf_check")
    header = ["run", "first", "sluice tok/s", "vLLM tok/s", "sluice / vLLM"]
    header += ["load s sluice / vLLM", "peak RSS MiB sluice / vLLM (process tree)"]
    rows = [
        [i, run["first"], run["sluice"]["output_tokens_per_s"], run["vllm"]["output_tokens_per_s"],
         run["ratio_sluice_over_vllm"],
         f"{run['sluice']['load_seconds']:.1f} / {run['vllm']['load_seconds']:.1f}",
         f"{run['sluice']['peak_rss_tree_mib']:.0f} / {run['vllm']['peak_rss_tree_mib']:.0f}"]
        for i, run in enumerate(r["runs"])
    ]  # fmt: skip
    checked = ""
    if hf:
        checked = (
            f"; against the HF argmax loop on the first {hf['requests']}: sluice "
            f"{hf['sluice']['identical']}, vLLM {hf['vllm']['identical']}"
        )
    return (
        f"**Sluice vs vLLM {r['vllm_version']} (CPU), {r['model']}** ({r['dtype']}, "
        f"{r['threads']} threads, KV cache {r['kv_cache_gib']} GiB, max_num_seqs "
        f"{r['max_num_seqs']}, max_num_batched_tokens {r['max_num_batched_tokens']}; "
        f"{w['num_requests']} requests, prompts {w['prompt_len'][0]}..{w['prompt_len'][1]}, "
        f"outputs {w['output_len'][0]}..{w['output_len'][1]}, greedy, ignore_eos)\n\n"
        + markdown(header, rows)
        + f"\n\nmedian sluice / vLLM: **{r['median_ratio']:.2f}x**; token-identical sequences: "
        f"{same['identical']} of {same['of']}{checked}"
    )


def summary(folders: list[Path]) -> str:
    """One row per result file of the headline numbers, to compare repeated runs."""
    rows = []
    for folder in folders:
        for path in sorted(folder.glob("*.json")):
            r = _load(path)
            if r is None or r["benchmark"] not in ("offline", "decode", "serve"):
                continue
            m = r["machine"]
            headline = ""
            if r["benchmark"] == "offline" and r.get("ratio_engine_over_hf"):
                headline = (
                    f"engine {_list(r.get('all_engine_tokens_per_s', []))}, "
                    f"engine/HF {r['ratio_engine_over_hf']:.2f}x"
                )
            elif r["benchmark"] == "decode":
                parts = [
                    f"batch {b['batch']} host {b['instrumented_ms']['host_fraction']:.0%}"
                    for b in r["batches"]
                ]
                headline = ", ".join(parts)
            elif r["benchmark"] == "serve" and r.get("ratio_served_over_offline"):
                cores = [p["cpu_cores"].get("engine", math.nan) for p in r["phases"]]
                headline = (
                    f"served/offline {r['ratio_served_over_offline']:.2f}, engine cores "
                    + "/".join(f"{c:.2f}" for c in cores)
                )
            rows.append([f"{folder.name}/{path.name}", m["date"], m.get("revision", "?")])
            rows[-1] += [m["load_avg_1m"], headline]
    return markdown(["result", "finished", "revision", "load avg", "headline"], rows)


def _load(path: Path) -> dict[str, Any] | None:
    text = path.read_text().strip()
    if not text:
        return None
    result: dict[str, Any] = json.loads(text.splitlines()[-1])
    return result


def service_ceiling(r: dict[str, Any]) -> str:
    header = ["revision", "rpc", "streams", "offered tok/s", "engine sent", "delivered tok/s"]
    header += ["tokens/message", "messages alone", "service cores", "service CPU s/1k tok"]
    header += ["delay p50 ms", "p99 ms", "max ms"]
    keys = ["revision", "rpc", "streams", "offered_tok_s", "engine_tok_s", "delivered_tok_s"]
    keys += ["tokens_per_message", "messages_alone", "service_cores"]
    keys += ["service_cpu_s_per_1k_tokens", "delay_ms_p50", "delay_ms_p99", "delay_ms_max"]
    rows = [[p[k] for k in keys] for p in r["phases"]]
    s = r["settings"]
    text = (
        f"**service ceiling** ({s['clients']} client processes, {s['max_tokens']} tokens per "
        f"request, {s['seconds']} s windows)\n\n" + markdown(header, rows)
    )
    for ratio in r.get("ratios", []):
        text += (
            f"\n\ncurrent / {s['baseline_rev']} at {ratio['streams']} streams, a step every "
            f"{ratio['step_ms']} ms: delivered **{ratio['delivered']:.2f}x**, service CPU per "
            f"token **{ratio['cpu_per_token']:.2f}x**"
        )
    return text


def gateway(r: dict[str, Any]) -> str:
    names = {"v1": "sluice.v1", "openai": "OpenAI front", "smg": "SMG"}
    header = ["path", "round", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "E2E p50 ms"]
    header += ["E2E p99 ms", "failed", "cores: engine", "service", "smg", "client"]
    rows = [
        [names[p["path"]], p["round"] + 1, p["output_tokens_per_s"]]
        + [p[k][q] for k in ("ttft", "e2el") for q in ("p50_ms", "p99_ms")]
        + [p["failed"]]
        + [p["cpu_cores"].get(k, math.nan) if k != "smg" or p["path"] == "smg" else math.nan
           for k in ("engine", "service", "smg", "client")]
        for p in r["phases"]
    ]  # fmt: skip
    w = r["workload"]
    ratios = ", ".join(f"{names[n]} **{v:.2f}**" for n, v in r["ratio_over_v1"].items())
    return (
        f"**the same streams three ways, {r['model']}** ({r['device']} {r['dtype']}; "
        f"{w['num_requests']} requests of {w['max_tokens']} tokens, {w['concurrency']} in "
        f"flight)\n\n" + markdown(header, rows) + f"\n\noutput tok/s over sluice.v1's, best "
        f"rounds: {ratios}"
    )


def speculative(r: dict[str, Any]) -> str:
    header = ["task", "mode", "batch", "method", "output tok/s", "x off", "x off per CPU-s"]
    header += ["accepted/proposed", "ids = off's"]
    keys = ["task", "mode", "batch", "method", "output_tokens_per_s", "ratio_to_off"]
    keys += ["cpu_ratio_to_off", "acceptance_rate", "same_tokens_as_off"]
    rows = [[math.nan if x[k] is None else x[k] for k in keys] for x in r["records"]]
    lookup = ", ".join(
        f"{c['task']} {c['mode']} batch {c['batch']} {c['lookup_rate']:.2f}" for c in r["cells"]
    )
    # Each task's target (absent from results written before the tasks had their own).
    models = r.get("task_models", {})
    on = "".join(f"; {task} on {Path(m).name}" for task, m in models.items())
    return (
        f"**speculative decoding, {r['model']}** ({r['device']} {r['dtype']}{on}; "
        f"{r['threads']} torch threads; {r['num_speculative_tokens']} tokens proposed at most, "
        f"speculation off above batch {r['speculative_max_batch']}; {r['max_tokens']} tokens per request, "
        f"ignore_eos; sampled at temperature {r['temperature_sampled']}; the fastest of "
        f"{r['repeat']} rounds)\n\n"
        + markdown(header, rows)
        + f"\n\ntoken ids equal off's in every cell: **{r['identical_tokens']}**; share of "
        f"off's output tokens that prompt lookup predicts: {lookup}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", type=Path, nargs="+")
    parser.add_argument("--summary", action="store_true", help="headline numbers per file")
    args = parser.parse_args(argv)
    if args.summary:
        print(summary(args.folders))
        return 0
    render = {
        "offline": offline,
        "decode": decode,
        "serve": serve,
        "prefix": prefix,
        "service_ceiling": service_ceiling,
        "peer_vllm": peer_vllm,
        "gateway": gateway,
        "speculative": speculative,
    }
    for folder in args.folders:
        for path in sorted(folder.glob("*.json")):
            result = _load(path)
            if result is None or result.get("benchmark") not in render:
                continue
            m = result["machine"]
            print(f"<!-- {path.name}: {m['date']}, load avg {m['load_avg_1m']} at the end -->")
            print(render[result["benchmark"]](result))
            print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
