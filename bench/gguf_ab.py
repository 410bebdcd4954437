"""A GGUF served in several weight formats, in-process, alternating: decode tok/s at each streams level, e.g. a
Q4_K_M file dequantized (float16: what a file without blocks the kernels run gets) against its own blocks (int4).

    .venv/bin/python bench/gguf_ab.py FILE.gguf [--formats float16,int4] [--streams 1,32] [--rounds 3]

Each format is one engine in this process (the conversion is cached), each run bench/throughput.py's engine_run
(temperature 0.7, EOS ignored; decode tok/s: the streams' tokens per step over the steps' time); the rounds alternate the formats, so the host's drift falls on all of them. Prints
each run, then the median per format and level and the ratios to the first format."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from tritonllm.engine.config import EngineConfig  # noqa: E402
from tritonllm.engine.llm_engine import LLMEngine  # noqa: E402
from tritonllm.model_files import resolve_model_path  # noqa: E402
from throughput import cpu_description, engine_run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--formats", default="float16,int4", help="weight formats, the first the baseline")
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    model_dir = resolve_model_path(args.gguf)
    streams = [int(s) for s in args.streams.split(",")]
    formats = args.formats.split(",")
    engines = {}
    for weight_format in formats:
        engines[weight_format] = LLMEngine(EngineConfig(model_path=str(model_dir), weight_format=weight_format,
                                                        max_num_seqs=max(streams)))
        print(f"{weight_format}: {engines[weight_format].core.runner.weight_format}", flush=True)
    print(cpu_description())
    rates = {(f, s): [] for f in formats for s in streams}
    for level in streams:
        for engine in engines.values():  # warm-up: first-use costs (oneDNN, allocations) out of the timings
            engine_run(engine, level, 8)
        for round_ in range(args.rounds):
            for weight_format, engine in engines.items():
                run = engine_run(engine, level, args.tokens)
                rates[weight_format, level].append(run.decode_rate * level)  # every stream's tokens of a step
                print(f"round {round_} streams {level} {weight_format}: {run.decode_rate * level:.1f} decode tok/s "
                      f"({run.rate:.1f} with the prefill)", flush=True)
    print(f"\n{args.gguf.name}, {args.tokens} tokens a request, median of {args.rounds} alternating runs:")
    for level in streams:
        base = statistics.median(rates[formats[0], level])
        cells = [f"{f} {statistics.median(rates[f, level]):.1f} ({statistics.median(rates[f, level]) / base:.2f}x)"
                 for f in formats]
        print(f"  {level} streams: " + ", ".join(cells))


if __name__ == "__main__":
    main()
