"""This server against its CPU peers, as a user would compare them: `tritonllm serve`, llama.cpp's `llama-server`
(on the default model's own Q4_1 GGUF, a slot per stream, continuous batching) and vLLM's CPU build
(torch-compiled; `--vllm-dtype`, auto: bfloat16 on a CPU with bf16 hardware, AMX or AVX512-BF16, float32 elsewhere
and with `--isa avx2`), each started here in turn on loopback, given the same streaming workload
(bench/throughput.py's load generator: the same prompts, temperature 0.7, `--max-tokens` tokens per request with
EOS ignored) at each `--streams` level after one warm-up request, and stopped before the next starts, so none shares
the cores.

    bash bench/setup_peers.sh /work/peers      # builds both peers there, once
    .venv/bin/python bench/peers.py --llama-server /work/peers/llama.cpp/build/bin/llama-server \\
        --vllm-python /work/peers/vllm-venv/bin/python [--streams 1,32] [--requests-per-stream 2] \\
        [--max-tokens 128] [--prompt-tokens 512,2048,8000] [--vllm-dtype auto] [--in-process] [--json peers.json]

A peer whose flag is not given is skipped. The compared figure is decode tok/s at one stream (one stream's rate
once its first token is out: 1 / mean ITL) and aggregate output tok/s at more; the ratios are ours / peer.
`--in-process` adds the engine in this process (bench/throughput.py's engine_run) for stack / in-process.

`--prompt-tokens 512,2048,8000` measures long prompts too (after the `--streams` runs; `--streams 0` skips those):
on each server, after a warm-up prompt of the shortest length, one streamed `/v1/completions` request at a time,
three per length, each prompt exactly that many token ids of the default model's tokenizer (sent as a list of ints,
so no server tokenizes: random ordinary tokens, drawn once from a fixed seed, the same prompts on every server), one
output token, EOS ignored; TTFT is the time to the first streamed choice, prefill tok/s the prompt tokens over the
median TTFT, and the ratio ours / peer of median TTFT. No prompt shares its first token with another, so no server
finds a cached prefix (llama-server is also sent `cache_prompt: false`); a request whose usage counts other prompt
tokens, or does not count cached ones (vLLM is started with --enable-prompt-tokens-details), or counts any, is an
error. The servers' contexts hold the longest prompt (llama-server's KV is then unified: one slot may take the
whole context).

`--gguf FILE` compares the servers on a GGUF file a user brings: ours serves it with `tritonllm serve --model FILE`
(its cache of that file removed first, so the start is a first start) and llama-server the same file; vLLM and
`--prompt-tokens` are left out. Each server's start (to /health, and to its first answered request) and its peak
memory are reported too: the peak over the run of its processes' summed resident set (sampled every 0.2 s; ours:
`tritonllm serve`, tritonserver, the Python-backend stub and its watchdog, the adapter), and each process's own peak
(VmHWM) by name.

Where llama-server is compared, the two servers' KV caches hold the same tokens (llama-server's context: a slot's
share of it per stream) in the same dtype: ours `--kv-cache-dtype`, float16 unless told (llama-server's own default,
f16) or float32, given to llama-server as `--cache-type-k/-v`; ours' `--kv-cache-memory` is those tokens' bytes.
Without llama-server ours keeps `--kv-cache-dtype auto` and a 1 GiB KV cache (a GGUF's: llama-server's tokens).

`--hf DIR` serves that HF checkpoint (ours and vLLM; e.g. bench/users_models.py's) instead of the default model;
`--quantization` is ours' option of that name (the checkpoint quantized at load).

With `--gguf` or `--hf`, the memory roofline of one stream is printed: the bytes a decode step reads (every weight
tensor of the file once, the embedding table only where it is also the LM head) against the read bandwidth measured
here at start (the best of a few sums over a 1 GiB array with `--threads` threads), and each server's one-stream
decode rate as a share of it (not ours with `--quantization`: it reads its own blocks then).

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
import random
import signal
import statistics
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
from transformers import AutoTokenizer

# bench/ is the script's directory; importing throughput puts the repository and tests/ on the path
from throughput import Run, cpu_description, engine_run, median_ms, streaming_run

from tritonllm.engine.config import EngineConfig
from tritonllm.launcher import ENGINE_ENV, answers_ok
from tritonllm.engine.layers.linear import cpu_has_bf16
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.gguf_file import read_gguf
from tritonllm.model_files import converted_gguf_dir, default_gguf_path, prepare_default_model
import stack_helpers
from stack_helpers import command_line, descendant_pids, free_ports, running_stack
from tritonllm.scale_out import Child

OURS = "tritonllm serve"
IN_PROCESS = "tritonllm in-process"
PROMPT_TOKENS_PER_SLOT = 256  # make_prompts' longest prompt is ~120 tokens; llama-server's context is per slot
VLLM_MAX_MODEL_LEN = 2048  # raised to the longest --prompt-tokens prompt's needs
VLLM_KV_CACHE_GIB = 2
WARM_UP_TOKENS = 8
PROMPTS_PER_LENGTH = 3
PREFILL_OUTPUT_TOKENS = 1
PREFILL_SEED = 44
STOP_GRACE_S = 30
LLAMA_SERVER_KV_TYPES = {"float16": "f16", "float32": "f32"}  # our --kv-cache-dtype → llama-server's cache type


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
    request_extras: dict = field(default_factory=dict)  # added to each long-prompt request's body
    dtype: str | None = None  # the compute dtype it was started with, where we chose it


@dataclass
class Prefill:
    """One prompt length's TTFTs on one server, a request at a time."""

    prompt_tokens: int
    ttft: list[float] = field(default_factory=list)  # seconds, of the requests that counted
    errors: int = 0  # requests that failed, or whose usage did not count what was sent (see first_token_s)

    @property
    def ttft_p50(self) -> float:
        return statistics.median(self.ttft) if self.ttft else float("nan")

    @property
    def rate(self) -> float:
        """Prompt tokens per second at the median TTFT."""
        return self.prompt_tokens / self.ttft_p50


@dataclass(frozen=True)
class LongPrompts:
    """The long prompts every server gets, as token ids: a warm-up one, then PROMPTS_PER_LENGTH per length."""

    warm_up: list[int]
    by_length: dict[int, list[list[int]]]


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
    dtype: str | None = None
    prefills: dict[int, Prefill] = field(default_factory=dict)  # by prompt tokens


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
                known = self.process_peaks.get(pid)
                self.process_peaks[pid] = (known[0] if known else self._name(pid, status["Name"].strip()), hwm)
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


# A decode step reads the embedding table as the LM head only where the two are one tensor (GGUF names, HF names).
EMBEDDINGS = ("token_embd.weight", "model.embed_tokens.weight")
HEADS = ("output.weight", "lm_head.weight")
BANDWIDTH_BYTES = 2**30
BANDWIDTH_REPEATS = 5


def tensor_bytes(model: Path) -> dict[str, int]:
    """Each weight tensor's bytes as stored: a GGUF file's tensors, or an HF directory's safetensors files'."""
    if model.is_file():
        return {tensor.name: tensor.n_bytes for tensor in read_gguf(model).tensors()}
    sizes = {}
    for path in sorted(model.glob("*.safetensors")):
        with path.open("rb") as file:
            header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
        sizes.update({name: entry["data_offsets"][1] - entry["data_offsets"][0] for name, entry in header.items()
                      if name != "__metadata__"})
    return sizes


def bytes_read_per_token(sizes: dict[str, int]) -> int:
    """What one stream's decode step reads: every tensor once, but an embedding table that is not the LM head too
    (a row of it)."""
    untied = any(name in sizes for name in HEADS)
    return sum(size for name, size in sizes.items() if not (untied and name in EMBEDDINGS))


def read_bandwidth() -> float:
    """Bytes per second this process's torch threads read from memory: the best of a few sums over an array far
    larger than the caches."""
    data = torch.ones(BANDWIDTH_BYTES // 4)
    best = float("inf")
    for _ in range(BANDWIDTH_REPEATS):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return BANDWIDTH_BYTES / best


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


def long_prompts(lengths: list[int], model: Path) -> LongPrompts:
    """Random ordinary tokens (no added or special one) of the model's vocabulary (a model directory's, or a GGUF
    file's own), each prompt's first token its own, so no prompt shares a prefix with another (the warm-up one
    included) and no server finds one in its cache."""
    tokenizer = (AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name) if model.suffix == ".gguf"
                 else AutoTokenizer.from_pretrained(model))
    ordinary = sorted(set(range(len(tokenizer))) - set(tokenizer.added_tokens_decoder))
    sizes = [min(lengths)] + [length for length in lengths for _ in range(PROMPTS_PER_LENGTH)]
    rng = random.Random(PREFILL_SEED)
    prompts = [[first, *rng.choices(ordinary, k=size - 1)] for first, size in
               zip(rng.sample(ordinary, len(sizes)), sizes)]
    return LongPrompts(prompts[0], {length: prompts[1 + i * PROMPTS_PER_LENGTH:1 + (i + 1) * PROMPTS_PER_LENGTH]
                                    for i, length in enumerate(lengths)})


def first_token_s(url: str, model: str, prompt: list[int], extras: dict) -> float:
    """Seconds from sending one streamed completion of `prompt` to its first choice; ValueError when the server's
    usage counts other prompt tokens than sent, or does not say how many were cached, or any was."""
    body = {"model": model, "prompt": prompt, "max_tokens": PREFILL_OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extras}
    first, usage = None, None
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/completions", json=body, timeout=1800) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    if first is None or usage is None:
        raise ValueError(f"no choice or no usage streamed (usage {usage})")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if usage["prompt_tokens"] != len(prompt) or cached != 0:
        raise ValueError(f"sent {len(prompt)} prompt tokens, usage: {usage}")
    return first


def measure_prefills(url: str, model: str, label: str, prompts: LongPrompts, extras: dict) -> dict[int, Prefill]:
    """Each length's prompts, one request at a time, after the warm-up prompt."""
    first_token_s(url, model, prompts.warm_up, extras)
    prefills = {}
    for length, of_length in prompts.by_length.items():
        prefill = prefills[length] = Prefill(length)
        for prompt in of_length:
            try:
                prefill.ttft.append(first_token_s(url, model, prompt, extras))
                print(f"{label}: {length} prompt tokens, TTFT {prefill.ttft[-1]:.2f} s", flush=True)
            except (httpx.HTTPError, ValueError) as error:
                print(f"{label}: {length} prompt tokens, request failed: {error!r}", flush=True)
                prefill.errors += 1
    return prefills


def measure(url: str, label: str, levels: list[int], args: argparse.Namespace, prompts: LongPrompts | None,
            measured: Measured, started: float, extras: dict | None = None) -> None:
    """The runs at each level, then the long prompts', into `measured`, after a warm-up request whose end is the
    first answer. extras: added to each long-prompt request's body."""
    model = served_model(url)
    asyncio.run(streaming_run(url, model, 1, 1, WARM_UP_TOKENS, label))
    measured.first_answer_s = time.monotonic() - started
    measured.runs = {n: asyncio.run(streaming_run(url, model, n, args.requests_per_stream, args.max_tokens, label))
                     for n in levels}
    if prompts:
        measured.prefills = measure_prefills(url, model, label, prompts, extras or {})


def longest_sequence(prompt_lengths: list[int]) -> int:
    """Tokens of the longest long-prompt request, its output included (0: none)."""
    return max(prompt_lengths) + PREFILL_OUTPUT_TOKENS if prompt_lengths else 0


def llama_server_context(slots: int, max_tokens: int, prompt_lengths: list[int]) -> int:
    """Tokens of llama-server's KV cache (its context, shared by the slots), enough for the longest prompt too, in
    whole blocks of ours (which then holds as many: a sequence takes whole blocks)."""
    tokens = max(slots * (PROMPT_TOKENS_PER_SLOT + max_tokens), longest_sequence(prompt_lengths))
    return -(-tokens // EngineConfig.block_size) * EngineConfig.block_size


def vllm_dtype(requested: str, isa: str) -> str:
    """auto: bfloat16 on a CPU with bf16 hardware (AMX or AVX512-BF16), float32 elsewhere and on AVX2 code paths
    (each peer at its best dtype on that CPU: issue 44)."""
    if requested != "auto":
        return requested
    return "bfloat16" if cpu_has_bf16() and isa == "native" else "float32"


def kv_memory_for(gguf: Path, tokens: int, kv_cache_dtype: str) -> int:
    """Bytes of our KV cache for as many tokens as llama-server's holds, in our KV dtype (auto: float32)."""
    metadata = read_gguf(gguf).metadata
    arch = metadata["general.architecture"]
    layers, heads, kv_heads, width = (metadata[f"{arch}.{name}"] for name in (
        "block_count", "attention.head_count", "attention.head_count_kv", "embedding_length"))
    head_dim = metadata.get(f"{arch}.attention.key_length", width // heads)
    return tokens * 2 * layers * kv_heads * head_dim * (2 if kv_cache_dtype == "float16" else 4)


def measure_ours(args: argparse.Namespace, levels: list[int], prompts: LongPrompts | None, model: Path,
                 log_dir: Path) -> Measured:
    """model: a model directory, or with --gguf the file (its cached preparation removed first: a first start);
    its KV cache as many tokens as llama-server's where that is compared or the model is a GGUF, else 1 GiB (23k
    float32 tokens of the default model)."""
    slots = max(levels, default=1)
    kv_gguf = model if model.is_file() else default_gguf_path() if args.llama_server else None
    kv_memory = (kv_memory_for(kv_gguf, llama_server_context(slots, args.max_tokens, args.prompt_tokens),
                               args.kv_cache_dtype) if kv_gguf else 2**30)
    options = ["--weight-format", args.weight_format, "--kv-cache-dtype", args.kv_cache_dtype, "--max-num-seqs",
               str(slots), "--kv-cache-memory", str(kv_memory),
               *(["--quantization", args.quantization] if args.quantization else []),
               *(["--prefill-dtype", args.prefill_dtype] if args.prefill_dtype else []),
               *(["--decode-dtype", args.decode_dtype] if args.decode_dtype else [])]
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
            measure(process.stack.base_url, OURS, levels, args, prompts, measured, started)
        finally:
            measured.memory = memory.stop()
    return measured


def llama_server_peer(binary: Path, gguf: Path, slots: int, max_tokens: int, threads: int,
                      prompt_lengths: list[int], kv_cache_dtype: str) -> Peer:
    """A GGUF (ours: the default model's own), a slot per stream, continuous batching, its KV cache in our
    `kv_cache_dtype`; with long prompts, a unified KV cache (any one slot may take the whole context) and no prompt
    cache for them."""
    port = free_ports(1)[0]
    command = [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(slots), "--ctx-size", str(llama_server_context(slots, max_tokens, prompt_lengths)),
               "--cont-batching", "--threads", str(threads), "--threads-batch", str(threads),
               "--cache-type-k", LLAMA_SERVER_KV_TYPES[kv_cache_dtype],
               "--cache-type-v", LLAMA_SERVER_KV_TYPES[kv_cache_dtype],
               *(["--kv-unified"] if prompt_lengths else [])]
    return Peer("llama-server", command, {}, port, [str(binary), "--version"], {"cache_prompt": False})


def vllm_peer(python: Path, model_dir: Path, threads: int, dtype: str, prompt_lengths: list[int]) -> Peer:
    """The HF-format checkpoint our server loads, in `dtype` (see vllm_dtype; vLLM's CPU build torch-compiles it at
    start), its context long enough for the longest prompt, its usage counting cached prompt tokens. Never with
    ATEN_CPU_CAPABILITY (which `--isa avx2` sets): with it at avx2, vLLM 0.32 streamed tokens that decode to no text
    (its own AVX-512 ops beside AVX2 torch), so its torch and inductor code keep their ISA; oneDNN and MKL stay
    capped."""
    port = free_ports(1)[0]
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
               "--max-model-len", str(max(VLLM_MAX_MODEL_LEN, longest_sequence(prompt_lengths))),
               *(["--enable-prompt-tokens-details"] if prompt_lengths else [])]  # usage's cached tokens
    env = {"VLLM_CPU_OMP_THREADS_BIND": first_cpus(threads), "VLLM_USE_AOT_COMPILE": "0",
           "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB), "ATEN_CPU_CAPABILITY": None}
    return Peer("vllm", command, env, port, [str(python), "-c", "import vllm; print('version', vllm.__version__)"],
                dtype=dtype)


def measure_peer(peer: Peer, args: argparse.Namespace, levels: list[int], prompts: LongPrompts | None,
                 log_dir: Path) -> Measured:
    measured = Measured(peer.name, peer_version(peer.version_command), peer.command, None, dtype=peer.dtype)
    memory = PeakMemory()
    with running_peer(peer, log_dir, args.ready_timeout) as child:
        measured.ready_s = time.monotonic() - child.started_at
        try:
            measure(f"http://127.0.0.1:{peer.port}/v1", peer.name, levels, args, prompts, measured,
                    child.started_at, peer.request_extras)
        finally:
            measured.memory = memory.stop()
    return measured


def measure_in_process(args: argparse.Namespace, levels: list[int], model_dir: Path) -> Measured:
    engine = LLMEngine(EngineConfig(model_path=str(model_dir), weight_format=args.weight_format,
                                    kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=max(levels),
                                    quantization=args.quantization or "none",
                                    prefill_dtype=args.prefill_dtype or "auto",
                                    decode_dtype=args.decode_dtype or "float32"))
    engine_run(engine, 1, WARM_UP_TOKENS)
    runner = engine.core.runner
    measured = Measured(IN_PROCESS, f"weights {runner.weight_format}, KV cache {runner.kv_dtype}", [], None)
    measured.runs = {n: engine_run(engine, n, args.max_tokens) for n in levels}
    return measured


# What caps each library at AVX2/FMA/F16C (read when each first runs, so set before this process uses torch).
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "TRITONLLM_CPU_MARCH": "x86-64-v3"}


def server_label(result: Measured) -> str:
    return f"{result.server} {result.dtype}" if result.dtype else result.server


def print_table(results: list[Measured], levels: list[int]) -> None:
    if levels:
        print(f"\n{'server':<22} {'streams':>7} {'decode tok/s':>13} {'aggregate':>10} {'TTFT p50':>9} "
              f"{'ITL p50':>8} {'errors':>6}")
    for n in levels:
        for result in results:
            run = result.runs[n]
            print(f"{server_label(result):<22} {n:>7} {run.decode_rate:>13.1f} {run.rate:>10.1f} "
                  f"{median_ms(run.ttft):>7.0f}ms {median_ms(run.itl):>6.1f}ms {run.errors:>6}")
    measured = [result for result in results if result.memory is not None]
    if measured:
        print(f"\n{'server':<22} {'ready':>7} {'1st answer':>10} {'peak RSS':>9}  per process (VmHWM)")
        for result in measured:
            processes = ", ".join(f"{name} {hwm / 2**20:.0f}" for name, hwm in result.memory.by_name().items())
            print(f"{server_label(result):<22} {result.ready_s:>6.1f}s {result.first_answer_s:>9.1f}s "
                  f"{result.memory.peak_rss / 2**20:>6.0f}MiB  {processes} MiB")


def print_prefill_table(results: list[Measured], lengths: list[int]) -> None:
    print(f"\n{'prompt tokens':>13} {'server':<22} {'TTFT p50':>9} {'TTFT min-max':>15} {'prefill tok/s':>13} "
          f"{'errors':>6}")
    for length in lengths:
        for result in results:
            prefill = result.prefills[length]
            spread = f"{min(prefill.ttft):.2f}-{max(prefill.ttft):.2f}s" if prefill.ttft else "-"
            print(f"{length:>13} {server_label(result):<22} {prefill.ttft_p50:>8.2f}s {spread:>15} "
                  f"{prefill.rate:>13.0f} {prefill.errors:>6}")


def prefill_ratios(results: list[Measured], lengths: list[int]) -> dict[str, dict[int, float]]:
    """ours / each peer, on median TTFT (below 1: ours is first sooner)."""
    ours = next(r for r in results if r.server == OURS)
    return {server_label(other): {length: ours.prefills[length].ttft_p50 / other.prefills[length].ttft_p50
                                  for length in lengths}
            for other in results if other is not ours}


def ratios(results: list[Measured], levels: list[int]) -> dict[str, dict[int, float]]:
    """ours / each other result, on the compared figure of each level (NaN where the other produced nothing)."""
    ours = next(r for r in results if r.server == OURS)
    return {other.server: {n: compared_rate(ours.runs[n], n) / compared_rate(other.runs[n], n)
                           if compared_rate(other.runs[n], n) else float("nan") for n in levels}
            for other in results if other is not ours}


def as_json(result: Measured) -> dict:
    return {"server": result.server, "version": result.version, "dtype": result.dtype, "command": result.command,
            "ready_s": result.ready_s, "first_answer_s": result.first_answer_s,
            "peak_rss_bytes": result.memory and result.memory.peak_rss,
            "process_peak_bytes": result.memory and result.memory.by_name(),
            "runs": {str(n): {"decode_tok_s": run.decode_rate, "aggregate_tok_s": run.rate,
                              "ttft_p50_ms": median_ms(run.ttft), "itl_p50_ms": median_ms(run.itl),
                              "tokens": run.tokens, "seconds": run.seconds, "errors": run.errors}
                     for n, run in result.runs.items()},
            "prefills": {str(length): {"ttft_s": prefill.ttft, "ttft_p50_s": prefill.ttft_p50,
                                       "prefill_tok_s": prefill.rate, "errors": prefill.errors}
                         for length, prefill in result.prefills.items()}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked; `levels` and `prompt_tokens` as lists of ints."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", type=Path, help="the llama-server binary (bench/setup_peers.sh builds it)")
    parser.add_argument("--vllm-python", type=Path, help="the python of a venv with vllm-cpu (setup_peers.sh)")
    parser.add_argument("--in-process", action="store_true", help="also run the engine in this process")
    parser.add_argument("--gguf", type=Path, help="serve this GGUF file (ours and llama-server; no vLLM)")
    parser.add_argument("--hf", type=Path, help="serve this HF checkpoint directory (ours and vLLM; no llama-server)")
    parser.add_argument("--quantization", help="ours: --quantization (an HF checkpoint quantized at load)")
    parser.add_argument("--streams", default="1,32", help="concurrent streams, comma-separated (0: no such runs)")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (EOS ignored)")
    parser.add_argument("--prompt-tokens", default="",
                        help="long-prompt TTFT at these prompt lengths, comma-separated (default: none; see above)")
    parser.add_argument("--vllm-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="vLLM's --dtype (auto: bfloat16 on bf16 hardware, float32 elsewhere and with --isa avx2)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="CPU threads for every server (default: torch's, one per physical core)")
    parser.add_argument("--weight-format", default="auto", help="ours: --weight-format")
    parser.add_argument("--prefill-dtype", help="ours: --prefill-dtype (default: its own, auto)")
    parser.add_argument("--decode-dtype", help="ours: --decode-dtype (default: its own, float32)")
    parser.add_argument("--kv-cache-dtype", help="ours: --kv-cache-dtype, and llama-server's KV cache type (default: "
                                                 "float16 with --llama-server, else auto)")
    parser.add_argument("--ready-timeout", type=float, default=1200,
                        help="seconds a server may take to answer /health (vLLM compiles the model at start)")
    parser.add_argument("--log-dir", type=Path, help="the servers' logs (default: a new temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument("--isa", choices=["native", "avx2"], default="native",
                        help="avx2: every server on AVX2-only code paths (see above)")
    args = parser.parse_args(argv)
    args.levels = [int(n) for n in args.streams.split(",") if int(n)]
    args.prompt_tokens = [int(n) for n in args.prompt_tokens.split(",") if n]
    if not args.levels and not args.prompt_tokens:
        parser.error("nothing to measure: --streams 0 and no --prompt-tokens")
    if args.gguf and (args.hf or args.vllm_python or args.in_process):
        parser.error("--gguf compares ours with llama-server only (no --hf, --vllm-python, --in-process)")
    if args.hf and args.llama_server:
        parser.error("--hf serves a checkpoint to ours and vLLM; llama-server takes its GGUF with --gguf")
    if args.in_process and not args.levels:
        parser.error("--in-process measures the --streams levels only")
    args.kv_cache_dtype = args.kv_cache_dtype or ("float16" if args.llama_server else "auto")
    if args.llama_server and args.kv_cache_dtype not in LLAMA_SERVER_KV_TYPES:
        parser.error("with --llama-server both KV caches are alike: --kv-cache-dtype "
                     f"{' or '.join(LLAMA_SERVER_KV_TYPES)}")
    return args


def main() -> None:
    args = parse_args()
    # the in-process engine runs here: this process gets the stack's engine environment from its start
    wanted = {**{name: os.environ.get(name, value) for name, value in ENGINE_ENV.items()},
              **(AVX2_ONLY if args.isa == "avx2" else {})}
    if any(os.environ.get(name) != value for name, value in wanted.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **wanted})
    levels = args.levels
    # A plain `kill` ends this run like Ctrl-C: through the `finally` blocks that stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # our stack's torch threads (it inherits the environment)
    torch.set_num_threads(args.threads)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="tritonllm-peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model_dir = None if args.gguf else (args.hf.resolve() if args.hf else prepare_default_model())
    prompts = long_prompts(args.prompt_tokens, args.gguf.resolve() if args.gguf else model_dir) if args.prompt_tokens \
        else None
    print(f"CPU: {cpu_description()}; code paths: {args.isa}; load average {os.getloadavg()}")
    roofline = None
    if args.gguf or args.hf:
        file_bytes, bandwidth = bytes_read_per_token(tensor_bytes(args.gguf or args.hf)), read_bandwidth()
        roofline = bandwidth / file_bytes
        print(f"memory roofline, one stream: {file_bytes / 1e9:.3f} GB read per token at {bandwidth / 1e9:.1f} GB/s "
              f"(measured, {args.threads} threads) = {roofline:.1f} tok/s")

    results = [measure_ours(args, levels, prompts, args.gguf.resolve() if args.gguf else model_dir, log_dir)]
    peers = []  # each built just before it starts, so its port is still free then
    if args.llama_server:
        gguf = args.gguf or default_gguf_path()
        peers.append(lambda: llama_server_peer(args.llama_server, gguf, max(levels, default=1), args.max_tokens,
                                               args.threads, args.prompt_tokens, args.kv_cache_dtype))
    else:
        print("llama-server: skipped (no --llama-server; bench/setup_peers.sh builds one)")
    if args.vllm_python:
        dtype = vllm_dtype(args.vllm_dtype, args.isa)
        peers.append(lambda: vllm_peer(args.vllm_python, model_dir, args.threads, dtype, args.prompt_tokens))
    else:
        print("vllm: skipped (no --vllm-python; bench/setup_peers.sh installs vllm-cpu)")
    failed = {}
    for make_peer in peers:
        peer = make_peer()
        try:
            results.append(measure_peer(peer, args, levels, prompts, log_dir))
        except ServerStartError as error:
            print(f"{peer.name}: did not start, left out: {error}")
            failed[peer.name] = str(error)
    if args.in_process:
        results.append(measure_in_process(args, levels, model_dir))

    if levels:
        print(f"\n{args.max_tokens} tokens per request (EOS ignored), temperature 0.7, streaming; "
              f"{args.requests_per_stream} requests per stream; {args.threads} threads per server")
    for result in results:
        ready = f", ready after {result.ready_s:.0f} s" if result.ready_s is not None else ""
        print(f"  {server_label(result)}: {result.version}{ready}" + (f"\n    {' '.join(result.command)}"
                                                                      if result.command else ""))
    print_table(results, levels)
    compared = ratios(results, levels) if levels else {}
    if compared:
        print("\nours / peer (1 stream: decode tok/s; more: aggregate tok/s)")
        for other, by_level in compared.items():
            print(f"  {other:<22}" + "".join(f"  {n} stream{'s' if n > 1 else ''} {ratio:.2f}x"
                                             for n, ratio in by_level.items()))
    if roofline and 1 in levels:
        print(f"\none stream against the memory roofline ({roofline:.1f} tok/s): " + ", ".join(
            f"{server_label(result)} {result.runs[1].decode_rate / roofline:.0%}" for result in results
            if not (args.quantization and result.server == OURS)))  # (ours then reads its own blocks, not the file)
    prefilled = [result for result in results if result.prefills]  # (not the in-process engine)
    compared_prefills = prefill_ratios(prefilled, args.prompt_tokens) if prompts else {}
    if prompts:
        print(f"\nlong prompts: {PROMPTS_PER_LENGTH} per length, one request at a time, {PREFILL_OUTPUT_TOKENS} "
              f"output token, token-id prompts; {args.threads} threads per server")
        print_prefill_table(prefilled, args.prompt_tokens)
        print("\nours / peer, median TTFT (below 1: ours first sooner)" if compared_prefills else "")
        for other, by_length in compared_prefills.items():
            print(f"  {other:<22}" + "".join(f"  {length} tokens {ratio:.2f}x" for length, ratio in by_length.items()))
    print(f"\nload average after: {os.getloadavg()}; logs: {log_dir}")
    if args.json:
        args.json.write_text(json.dumps({
            "cpu": cpu_description(), "isa": args.isa, "roofline_tok_s": roofline, "max_tokens": args.max_tokens,
            "streams": levels,
            "requests_per_stream": args.requests_per_stream, "threads": args.threads,
            "prompt_tokens": args.prompt_tokens, "prompts_per_length": PROMPTS_PER_LENGTH,
            "vllm_dtype": vllm_dtype(args.vllm_dtype, args.isa) if args.vllm_python else None,
            "results": [as_json(result) for result in results], "failed": failed,
            "ratios_ours_over": {other: {str(n): ratio for n, ratio in by_level.items()}
                                 for other, by_level in compared.items()},
            "prefill_ttft_ratios_ours_over": {other: {str(length): ratio for length, ratio in by_length.items()}
                                              for other, by_length in compared_prefills.items()},
        }, indent=2))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the servers are stopped by then
        sys.exit(130)
