"""This server against its CPU peers, as a user would compare them: `tritonllm serve`, llama.cpp's `llama-server`
(on the default model's own Q4_1 GGUF, a slot per stream, continuous batching) and vLLM's CPU build (fp32,
torch-compiled), each started here in turn on loopback, given the same streaming workload (bench/throughput.py's
load generator: the same prompts, temperature 0.7, `--max-tokens` tokens per request with EOS ignored) at each
`--streams` level after one warm-up request, and stopped before the next starts, so none shares the cores.

    bash bench/setup_peers.sh /work/peers      # builds both peers there, once
    .venv/bin/python bench/peers.py --llama-server /work/peers/llama.cpp/build/bin/llama-server \\
        --vllm-python /work/peers/vllm-venv/bin/python [--streams 1,32] [--requests-per-stream 2] \\
        [--max-tokens 128] [--in-process] [--json peers.json]

A peer whose flag is not given is skipped. The compared figure is decode tok/s at one stream (one stream's rate
once its first token is out: 1 / mean ITL) and aggregate output tok/s at more; the ratios are ours / peer.
`--in-process` adds the engine in this process (bench/throughput.py's engine_run) for stack / in-process.

`--gguf FILE` compares the servers on a GGUF file a user brings: ours serves it with `tritonllm serve --model FILE`
(its cache of that file removed first, so the start is a first start) and llama-server the same file; vLLM is left
out. Each server's start (to /health, and to its first answered request) and its peak memory are reported too: the
peak over the run of its processes' summed resident set (sampled every 0.2 s; ours: `tritonllm serve`, tritonserver,
the Python-backend stub and its watchdog, the adapter), and each process's own peak (VmHWM) by name.

`--isa avx2` runs everything on the code paths of a CPU with AVX2/FMA but no AVX-512 (most 2-core cloud boxes) on a
CPU that has more: torch's own kernels, oneDNN, MKL and fbgemm are capped at AVX2 by their environment variables,
our CPU ops are built for x86-64-v3, vLLM gets the oneDNN and MKL caps only (see vllm_peer: its own C++ ops, its
torch and its inductor code keep AVX-512), and llama-server must be a build for AVX2 (`ISA=avx2 bash
bench/setup_peers.sh` makes one in DIR/llama.cpp-avx2). Memory bandwidth and core speed stay the host's, so it
shows the code paths, not the other box."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

# bench/ is the script's directory; importing throughput puts the repository and tests/ on the path
from throughput import Run, cpu_description, engine_run, median_ms, streaming_run

from tritonllm.engine.config import EngineConfig
from tritonllm.launcher import ENGINE_ENV, answers_ok
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.model_files import converted_gguf_dir, default_gguf_path, prepare_default_model
import stack_helpers
from stack_helpers import command_line, descendant_pids, free_ports, running_stack
from tritonllm.scale_out import Child

OURS = "tritonllm serve"
IN_PROCESS = "tritonllm in-process"
PROMPT_TOKENS_PER_SLOT = 256  # make_prompts' longest prompt is ~120 tokens; llama-server's context is per slot
VLLM_MAX_MODEL_LEN = 2048
VLLM_KV_CACHE_GIB = 2
WARM_UP_TOKENS = 8
STOP_GRACE_S = 30


class ServerStartError(RuntimeError):
    pass


@dataclass(frozen=True)
class Peer:
    """How to start one peer server on loopback, and how to ask it its version."""

    name: str
    command: list[str]
    env: dict[str, str | None]  # over this process's environment; None: unset
    port: int
    version_command: list[str]


@dataclass
class Measured:
    """One server's runs, keyed by concurrent streams."""

    server: str
    version: str
    command: list[str]
    ready_s: float | None  # seconds from start to answering /health (None: in-process)
    runs: dict[int, Run] = field(default_factory=dict)
    first_answer_s: float | None = None  # seconds from start to the end of the first (warm-up) request
    memory: PeakMemory | None = None


class PeakMemory:
    """A server's processes' memory from its start: the peak of their summed resident set, sampled, and each
    process's own peak (VmHWM), by process name. A thread samples every process this one started (one server at a
    time runs) until stopped."""

    INTERVAL_S = 0.2

    def __init__(self):
        self.peak_rss = 0  # bytes
        self.process_peaks: dict[int, tuple[str, int]] = {}  # pid → (name, VmHWM bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            total = 0
            for pid in descendant_pids(os.getpid()):
                try:
                    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                                  if ":" in line)
                    rss, hwm = (int(status[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM"))
                except (OSError, KeyError, ValueError):  # ended, or a zombie
                    continue
                total += rss
                self.process_peaks[pid] = (self._name(pid, status["Name"].strip()), hwm)
            self.peak_rss = max(self.peak_rss, total)

    @staticmethod
    def _name(pid: int, name: str) -> str:
        """A Python process by what it runs (`-m tritonllm serve`, a script's name), another by its own name."""
        if not name.startswith("python"):
            return name
        args = command_line(pid)[1:]
        if "-m" in args:
            return " ".join(args[args.index("-m") + 1:][:2])
        return Path(args[0]).name if args else name

    def stop(self) -> "PeakMemory":
        self._stop.set()
        self._thread.join()
        return self

    def by_name(self) -> dict[str, int]:
        """Each process name's summed VmHWM."""
        peaks: dict[str, int] = {}
        for name, hwm in self.process_peaks.values():
            peaks[name] = peaks.get(name, 0) + hwm
        return peaks


def compared_rate(run: Run, streams: int) -> float:
    """The figure the ratios compare: decode tok/s for one stream, aggregate output tok/s for several."""
    return run.decode_rate if streams == 1 else run.rate


def first_cpus(threads: int) -> str:
    """The first `threads` CPUs this process may use, as the one range vLLM's thread binding takes."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    if cpus != list(range(cpus[0], cpus[0] + len(cpus))):
        raise SystemExit(f"the CPUs {cpus} are not one range, which VLLM_CPU_OMP_THREADS_BIND needs")
    return f"{cpus[0]}-{cpus[-1]}"


def peer_version(command: list[str]) -> str:
    """The last line a peer prints about its version (llama-server prints it on stderr, after its backends)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown ({error})"
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return next((line for line in reversed(lines) if "version" in line), lines[-1] if lines else "unknown")


def served_model(url: str) -> str:
    return httpx.get(f"{url}/models", timeout=10).json()["data"][0]["id"]


@contextmanager
def running_peer(peer: Peer, log_dir: Path, ready_timeout_s: float) -> Iterator[Child]:
    """The peer in its own process group until the block exits, once it answers /health.
    The whole group is stopped whatever happens (vLLM's engine runs in a child process)."""
    env = {name: value for name, value in {**os.environ, **peer.env}.items() if value is not None}
    child = Child(peer.name, peer.command, log_dir / f"{peer.name}.log", {**env, "HF_HUB_OFFLINE": "1"})
    child.start()
    try:
        print(f"{peer.name}: starting (log: {child.log_path})", flush=True)
        while not answers_ok(f"http://127.0.0.1:{peer.port}/health"):
            if not child.running():
                raise ServerStartError(child.exit_report())
            if time.monotonic() - child.started_at > ready_timeout_s:
                raise ServerStartError(f"{peer.name} did not answer /health within {ready_timeout_s:.0f} s")
            time.sleep(1)
        ready_s = time.monotonic() - child.started_at
        print(f"{peer.name}: ready after {ready_s:.0f} s", flush=True)
        yield child
    finally:
        child.terminate()
        child.wait_stopped(STOP_GRACE_S)
        try:  # what the server left behind in its group (its leader has exited)
            os.killpg(child.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def measure(url: str, label: str, levels: list[int], requests_per_stream: int, max_tokens: int,
            measured: Measured, started: float) -> None:
    """The runs at each level into `measured`, after a warm-up request whose end is the first answer."""
    model = served_model(url)
    asyncio.run(streaming_run(url, model, 1, 1, WARM_UP_TOKENS, label))
    measured.first_answer_s = time.monotonic() - started
    measured.runs = {n: asyncio.run(streaming_run(url, model, n, requests_per_stream, max_tokens, label))
                     for n in levels}


def llama_server_context(slots: int, max_tokens: int) -> int:
    """Tokens of llama-server's KV cache (its context, shared by the slots)."""
    return slots * (PROMPT_TOKENS_PER_SLOT + max_tokens)


def kv_memory_for(gguf: Path, tokens: int, kv_cache_dtype: str) -> int:
    """Bytes of our KV cache for as many tokens as llama-server's holds, in our KV dtype (auto: float32)."""
    import gguf as gguf_package

    fields = gguf_package.GGUFReader(gguf).fields
    arch = fields["general.architecture"].contents()
    layers, heads, kv_heads, width = (fields[f"{arch}.{name}"].contents() for name in (
        "block_count", "attention.head_count", "attention.head_count_kv", "embedding_length"))
    head_dim = fields[f"{arch}.attention.key_length"].contents() if f"{arch}.attention.key_length" in fields \
        else width // heads
    return tokens * 2 * layers * kv_heads * head_dim * (2 if kv_cache_dtype == "float16" else 4)


def measure_ours(args: argparse.Namespace, levels: list[int], model: Path, log_dir: Path) -> Measured:
    """model: a model directory, or with --gguf the file (its cached preparation removed first: a first start),
    then with a KV cache of as many tokens as llama-server's."""
    kv_memory = (kv_memory_for(model, llama_server_context(max(levels), args.max_tokens), args.kv_cache_dtype)
                 if model.is_file() else 2**30)
    options = ["--weight-format", args.weight_format, "--kv-cache-dtype", args.kv_cache_dtype, "--max-num-seqs",
               str(max(levels)), "--kv-cache-memory", str(kv_memory)]
    measured = Measured(OURS, "this checkout", ["tritonllm", "serve", "--model", str(model), *options], None)
    if model.is_file():
        shutil.rmtree(converted_gguf_dir(model).parent, ignore_errors=True)
    stack_helpers.STACK_START_TIMEOUT_S = args.ready_timeout  # a first start from a GGUF converted it (minutes)
    print(f"{OURS}: starting (logs: {log_dir / 'tritonllm'})", flush=True)
    (log_dir / "tritonllm").mkdir()
    started, memory = time.monotonic(), PeakMemory()
    with running_stack(model, log_dir / "tritonllm", *options) as process:
        measured.ready_s = time.monotonic() - started
        print(f"{OURS}: ready after {measured.ready_s:.0f} s", flush=True)
        try:
            measure(process.stack.base_url, OURS, levels, args.requests_per_stream, args.max_tokens, measured,
                    started)
        finally:
            measured.memory = memory.stop()
    return measured


def llama_server_peer(binary: Path, gguf: Path, slots: int, max_tokens: int, threads: int) -> Peer:
    """A GGUF (ours: the default model's own), a slot per stream, continuous batching."""
    port = free_ports(1)[0]
    command = [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(slots), "--ctx-size", str(llama_server_context(slots, max_tokens)),
               "--cont-batching", "--threads", str(threads), "--threads-batch", str(threads)]
    return Peer("llama-server", command, {}, port, [str(binary), "--version"])


def vllm_peer(python: Path, model_dir: Path, threads: int) -> Peer:
    """The HF-format checkpoint our server loads, in fp32 (vLLM's CPU build torch-compiles it at start). Never
    with ATEN_CPU_CAPABILITY (which `--isa avx2` sets): with it at avx2, vLLM 0.32 streamed tokens that decode to
    no text (its own AVX-512 ops beside AVX2 torch), so its torch and inductor code keep their ISA; oneDNN and MKL
    stay capped."""
    port = free_ports(1)[0]
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", str(VLLM_MAX_MODEL_LEN)]
    env = {"VLLM_CPU_OMP_THREADS_BIND": first_cpus(threads), "VLLM_USE_AOT_COMPILE": "0",
           "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB), "ATEN_CPU_CAPABILITY": None}
    return Peer("vllm", command, env, port, [str(python), "-c", "import vllm; print('version', vllm.__version__)"])


def measure_peer(peer: Peer, args: argparse.Namespace, levels: list[int], log_dir: Path) -> Measured:
    measured = Measured(peer.name, peer_version(peer.version_command), peer.command, None)
    memory = PeakMemory()
    with running_peer(peer, log_dir, args.ready_timeout) as child:
        measured.ready_s = time.monotonic() - child.started_at
        try:
            measure(f"http://127.0.0.1:{peer.port}/v1", peer.name, levels, args.requests_per_stream, args.max_tokens,
                    measured, child.started_at)
        finally:
            measured.memory = memory.stop()
    return measured


def measure_in_process(args: argparse.Namespace, levels: list[int], model_dir: Path) -> Measured:
    engine = LLMEngine(EngineConfig(model_path=str(model_dir), weight_format=args.weight_format,
                                    kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=max(levels)))
    engine_run(engine, 1, WARM_UP_TOKENS)
    runner = engine.core.runner
    measured = Measured(IN_PROCESS, f"weights {runner.weight_format}, KV cache {runner.kv_dtype}", [], None)
    measured.runs = {n: engine_run(engine, n, args.max_tokens) for n in levels}
    return measured


# What caps each library at AVX2/FMA/F16C (read when each first runs, so set before this process uses torch).
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "TRITONLLM_CPU_MARCH": "x86-64-v3"}


def print_table(results: list[Measured], levels: list[int]) -> None:
    print(f"\n{'server':<22} {'streams':>7} {'decode tok/s':>13} {'aggregate':>10} {'TTFT p50':>9} "
          f"{'ITL p50':>8} {'errors':>6}")
    for n in levels:
        for result in results:
            run = result.runs[n]
            print(f"{result.server:<22} {n:>7} {run.decode_rate:>13.1f} {run.rate:>10.1f} "
                  f"{median_ms(run.ttft):>7.0f}ms {median_ms(run.itl):>6.1f}ms {run.errors:>6}")
    measured = [result for result in results if result.memory is not None]
    if measured:
        print(f"\n{'server':<22} {'ready':>7} {'1st answer':>10} {'peak RSS':>9}  per process (VmHWM)")
        for result in measured:
            processes = ", ".join(f"{name} {hwm / 2**20:.0f}" for name, hwm in result.memory.by_name().items())
            print(f"{result.server:<22} {result.ready_s:>6.1f}s {result.first_answer_s:>9.1f}s "
                  f"{result.memory.peak_rss / 2**20:>6.0f}MiB  {processes} MiB")


def ratios(results: list[Measured], levels: list[int]) -> dict[str, dict[int, float]]:
    """ours / each other result, on the compared figure of each level (NaN where the other produced nothing)."""
    ours = next(r for r in results if r.server == OURS)
    return {other.server: {n: compared_rate(ours.runs[n], n) / compared_rate(other.runs[n], n)
                           if compared_rate(other.runs[n], n) else float("nan") for n in levels}
            for other in results if other is not ours}


def as_json(result: Measured) -> dict:
    return {"server": result.server, "version": result.version, "command": result.command,
            "ready_s": result.ready_s, "first_answer_s": result.first_answer_s,
            "peak_rss_bytes": result.memory and result.memory.peak_rss,
            "process_peak_bytes": result.memory and result.memory.by_name(),
            "runs": {str(n): {"decode_tok_s": run.decode_rate, "aggregate_tok_s": run.rate,
                              "ttft_p50_ms": median_ms(run.ttft), "itl_p50_ms": median_ms(run.itl),
                              "tokens": run.tokens, "seconds": run.seconds, "errors": run.errors}
                     for n, run in result.runs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", type=Path, help="the llama-server binary (bench/setup_peers.sh builds it)")
    parser.add_argument("--vllm-python", type=Path, help="the python of a venv with vllm-cpu (setup_peers.sh)")
    parser.add_argument("--in-process", action="store_true", help="also run the engine in this process")
    parser.add_argument("--gguf", type=Path, help="serve this GGUF file (ours and llama-server; no vLLM)")
    parser.add_argument("--streams", default="1,32", help="concurrent streams, comma-separated")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (EOS ignored)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="CPU threads for every server (default: torch's, one per physical core)")
    parser.add_argument("--weight-format", default="auto", help="ours: --weight-format")
    parser.add_argument("--kv-cache-dtype", default="auto", help="ours: --kv-cache-dtype")
    parser.add_argument("--ready-timeout", type=float, default=1200,
                        help="seconds a server may take to answer /health (vLLM compiles the model at start)")
    parser.add_argument("--log-dir", type=Path, help="the servers' logs (default: a new temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument("--isa", choices=["native", "avx2"], default="native",
                        help="avx2: every server on AVX2-only code paths (see above)")
    args = parser.parse_args()
    # the in-process engine runs here: this process gets the stack's engine environment from its start
    wanted = {**{name: os.environ.get(name, value) for name, value in ENGINE_ENV.items()},
              **(AVX2_ONLY if args.isa == "avx2" else {})}
    if any(os.environ.get(name) != value for name, value in wanted.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **wanted})
    levels = [int(n) for n in args.streams.split(",")]
    # A plain `kill` ends this run like Ctrl-C: through the `finally` blocks that stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # our stack's torch threads (it inherits the environment)
    torch.set_num_threads(args.threads)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="tritonllm-peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.gguf and (args.vllm_python or args.in_process):
        raise SystemExit("--gguf compares ours with llama-server only (no --vllm-python, no --in-process)")
    model_dir = None if args.gguf else prepare_default_model()
    print(f"CPU: {cpu_description()}; code paths: {args.isa}; load average {os.getloadavg()}")

    results = [measure_ours(args, levels, args.gguf.resolve() if args.gguf else model_dir, log_dir)]
    peers = []  # each built just before it starts, so its port is still free then
    if args.llama_server:
        gguf = args.gguf or default_gguf_path()
        peers.append(lambda: llama_server_peer(args.llama_server, gguf, max(levels), args.max_tokens, args.threads))
    else:
        print("llama-server: skipped (no --llama-server; bench/setup_peers.sh builds one)")
    if args.vllm_python:
        peers.append(lambda: vllm_peer(args.vllm_python, model_dir, args.threads))
    else:
        print("vllm: skipped (no --vllm-python; bench/setup_peers.sh installs vllm-cpu)")
    failed = {}
    for make_peer in peers:
        peer = make_peer()
        try:
            results.append(measure_peer(peer, args, levels, log_dir))
        except ServerStartError as error:
            print(f"{peer.name}: did not start, left out: {error}")
            failed[peer.name] = str(error)
    if args.in_process:
        results.append(measure_in_process(args, levels, model_dir))

    print(f"\n{args.max_tokens} tokens per request (EOS ignored), temperature 0.7, streaming; "
          f"{args.requests_per_stream} requests per stream; {args.threads} threads per server")
    for result in results:
        ready = f", ready after {result.ready_s:.0f} s" if result.ready_s is not None else ""
        print(f"  {result.server}: {result.version}{ready}" + (f"\n    {' '.join(result.command)}"
                                                               if result.command else ""))
    print_table(results, levels)
    compared = ratios(results, levels)
    if compared:
        print("\nours / peer (1 stream: decode tok/s; more: aggregate tok/s)")
        for other, by_level in compared.items():
            print(f"  {other:<22}" + "".join(f"  {n} stream{'s' if n > 1 else ''} {ratio:.2f}x"
                                             for n, ratio in by_level.items()))
    print(f"\nload average after: {os.getloadavg()}; logs: {log_dir}")
    if args.json:
        args.json.write_text(json.dumps({
            "cpu": cpu_description(), "isa": args.isa, "max_tokens": args.max_tokens, "streams": levels,
            "requests_per_stream": args.requests_per_stream, "threads": args.threads,
            "results": [as_json(result) for result in results], "failed": failed,
            "ratios_ours_over": {other: {str(n): ratio for n, ratio in by_level.items()}
                                 for other, by_level in compared.items()},
        }, indent=2))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the servers are stopped by then
        sys.exit(130)
