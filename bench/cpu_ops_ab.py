"""Before/after of a change to the CPU ops: the engine in this process, with the ops of a git revision's
CPU ops (tritonllm/kernels/cpu, or kernels/cpu before the namespace) and of this checkout's swapped between runs, alternating (the host's drift between separate
processes can exceed the change), at each streams level; prints each run and the medians.

    .venv/bin/python bench/cpu_ops_ab.py --before b5d3932 [--model FILE.gguf] [--streams 1,32] [--rounds 4] [--tokens 128]
        [--weight-format int4-q8] [--decode-dtype int8]
    TRITONLLM_CPU_MARCH=x86-64-v3 .venv/bin/python bench/cpu_ops_ab.py --before ...   # both built for AVX2

Everything but the ops (model, scheduler, sampler's torch parts) is this checkout's, so a revision whose ops take
other arguments cannot be compared this way; the workload is bench/throughput.py's engine_run (temperature 0.7,
EOS ignored; int4 weights unless --weight-format names another format)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tritonllm.engine.config import EngineConfig  # noqa: E402
from tritonllm.engine.llm_engine import LLMEngine  # noqa: E402
from tritonllm.model_files import prepare_default_model, resolve_model_path  # noqa: E402
from tritonllm.kernels import cpu  # noqa: E402
from throughput import engine_run  # noqa: E402


def built_ops(revision: str | None, directory: Path):
    """The CPU ops of `revision`'s C sources (None: this checkout's), built into `directory` and opened."""
    source_dir = cpu.SOURCE_DIR
    if revision is not None:
        source_dir = directory / "src"
        source_dir.mkdir()
        for folder in ("tritonllm/kernels/cpu/", "kernels/cpu/"):  # where the sources were, then and now
            names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", revision, folder], check=True,
                                   capture_output=True, text=True).stdout.split()
            for name in (name for name in names if name.endswith((".c", ".h"))):
                (source_dir / Path(name).name).write_bytes(subprocess.run(
                    ["git", "-C", str(ROOT), "show", f"{revision}:{name}"], check=True, capture_output=True).stdout)
    path = cpu.build(directory / "build", source_dir)
    if path is None:
        raise SystemExit("no C compiler: the CPU ops cannot be built")
    return cpu.open_library(path, older=revision is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the git revision whose CPU ops are 'before'")
    parser.add_argument("--model", type=Path, help="a GGUF or HF checkpoint (default: the shipped model)")
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each build per streams level")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--weight-format", default="int4", help="the engine's weight_format (int4-q8: the int8 ops)")
    parser.add_argument("--decode-dtype", default="float32", help="the engine's decode_dtype")
    args = parser.parse_args()
    model = resolve_model_path(args.model) if args.model else prepare_default_model()
    engine = LLMEngine(EngineConfig(model_path=str(model), weight_format=args.weight_format,
                                    decode_dtype=args.decode_dtype,
                                    max_num_seqs=max(int(s) for s in args.streams.split(","))))
    with tempfile.TemporaryDirectory() as before_dir, tempfile.TemporaryDirectory() as after_dir:
        builds = {f"before ({args.before})": built_ops(args.before, Path(before_dir)),
                  "after (this checkout)": built_ops(None, Path(after_dir))}
        print(f"{torch.get_num_threads()} torch threads, ops built for -march={cpu.MARCH}")
        for streams in map(int, args.streams.split(",")):
            rates: dict[str, list[float]] = {name: [] for name in builds}
            engine_run(engine, streams, 8)  # warm-up
            for _ in range(args.rounds):
                for name, library in builds.items():
                    cpu._library = library  # every op the engine calls goes through this module's library
                    run = engine_run(engine, streams, args.tokens)
                    rates[name].append(run.rate)
                    print(f"  {streams:>2} streams, {name}: {run.rate:7.1f} tok/s, ITL p50 "
                          f"{statistics.median(run.itl) * 1e3:.2f} ms", flush=True)
            medians = [statistics.median(values) for values in rates.values()]
            print(f"{streams} streams: median {medians[0]:.1f} -> {medians[1]:.1f} tok/s "
                  f"({medians[1] / medians[0]:.2f}x)")


if __name__ == "__main__":
    main()
