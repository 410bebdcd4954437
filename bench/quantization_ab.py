"""An HF checkpoint quantized at load (--quantization) against as it is: each quantization's load in a fresh process
(seconds; resident memory before, at its peak and after: the model's load and format choice, no KV cache), then
decode tok/s in this process, each quantization one engine, the rounds alternating them.

    .venv/bin/python bench/quantization_ab.py [MODEL_DIR] [--quantizations none,q8_0,q4_0,q4_1] [--streams 1]

MODEL_DIR: an HF checkpoint; by default the default model's prepared directory without its GGUF blocks (its dense
float32 safetensors: the shipped Q4_1 file's weights, dequantized). Each run is bench/throughput.py's engine_run
(temperature 0.7, EOS ignored; decode tok/s: the streams' tokens per step over the steps' time)."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

from tritonllm.engine.config import EngineConfig  # noqa: E402
from tritonllm.engine.core.model_runner import load_model, return_freed_memory  # noqa: E402
from tritonllm.engine.llm_engine import LLMEngine  # noqa: E402
from tritonllm.model_files import prepare_default_model  # noqa: E402
from throughput import cpu_description, engine_run  # noqa: E402


def resident_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024


def measure_load(model_dir: Path, quantization: str) -> dict:
    """One load of the model (weights, format chosen and built): seconds and resident MiB before, at peak, after."""
    before = resident_mib()
    started = time.perf_counter()
    model, described = load_model(EngineConfig(quantization=quantization), model_dir, torch.device("cpu"))
    return_freed_memory()  # as the engine does after its load
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": seconds, "before": before, "peak": peak, "after": resident_mib(), "format": described}


def hf_checkpoint_of_default_model() -> Path:
    """The default model's directory without its GGUF blocks: links to its config, tokenizer and safetensors."""
    prepared = prepare_default_model()
    linked = Path(tempfile.mkdtemp(prefix="hf-checkpoint-"))
    for path in prepared.iterdir():
        if path.is_file():  # (the blocks are in a directory)
            (linked / path.name).symlink_to(path)
    return linked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path, nargs="?")
    parser.add_argument("--quantizations", default="none,q8_0,q4_0,q4_1", help="the first is the baseline")
    parser.add_argument("--streams", default="1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--load-only", metavar="QUANTIZATION", help=argparse.SUPPRESS)  # one measured load, as JSON
    args = parser.parse_args()
    model_dir = args.model_dir or hf_checkpoint_of_default_model()
    if args.load_only:
        print(json.dumps(measure_load(model_dir, args.load_only)))
        return
    quantizations = args.quantizations.split(",")
    print(cpu_description())
    for quantization in quantizations:
        result = subprocess.run([sys.executable, __file__, str(model_dir), "--load-only", quantization],
                                capture_output=True, text=True, check=True)
        load = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"{quantization}: load {load['seconds']:.1f} s, resident MiB {load['before']:.0f} before, "
              f"{load['peak']:.0f} peak, {load['after']:.0f} after: {load['format']}", flush=True)
    streams = [int(s) for s in args.streams.split(",")]
    engines = {q: LLMEngine(EngineConfig(model_path=str(model_dir), quantization=q, max_num_seqs=max(streams)))
               for q in quantizations}
    rates = {(q, s): [] for q in quantizations for s in streams}
    for level in streams:
        for engine in engines.values():  # warm-up: first-use costs out of the timings
            engine_run(engine, level, 8)
        for round_ in range(args.rounds):
            for quantization, engine in engines.items():
                rate = engine_run(engine, level, args.tokens).decode_rate * level
                rates[quantization, level].append(rate)
                print(f"round {round_} streams {level} {quantization}: {rate:.1f} decode tok/s", flush=True)
    print(f"\n{model_dir}, {args.tokens} tokens a request, median of {args.rounds} alternating runs:")
    for level in streams:
        base = statistics.median(rates[quantizations[0], level])
        cells = [f"{q} {statistics.median(rates[q, level]):.1f} ({statistics.median(rates[q, level]) / base:.2f}x)"
                 for q in quantizations]
        print(f"  {level} streams: " + ", ".join(cells))


if __name__ == "__main__":
    main()
