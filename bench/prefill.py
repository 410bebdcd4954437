"""Long prompts in-process (no Triton): TTFT and prefill tok/s of one prompt at each length, with the share of that
time in prefill attention, and the ITL of running decode streams (a stationary load: each replaced by a new one as
it ends) while a long prompt arrives. With --before, a git revision's CPU ops and this checkout's are swapped
between runs, alternating (the host's drift between separate processes can exceed the change), as
bench/cpu_ops_ab.py does; with --prefill-dtypes float32,bfloat16 an engine of each prefill dtype runs,
alternating.

    .venv/bin/python bench/prefill.py [--lengths 512,2048,8000] [--rounds 2] [--before main]
    .venv/bin/python bench/prefill.py --prefill-dtypes float32,bfloat16 [--model FILE.gguf]
    .venv/bin/python bench/prefill.py --lengths 0 --streams 8 --arrival 8000   # ITL while an 8k prompt prefills
    .venv/bin/python bench/prefill.py --lengths 0 --streams 8 --max-decode-slowdowns 0,2   # unpaced, then paced
    OMP_NUM_THREADS=1 .venv/bin/python bench/prefill.py --op --before main --torch   # the attention op alone

--op times the prefill attention op alone over a prompt's chunks (max_num_batched_tokens each, the default model's
9 query heads, 3 KV heads, head size 64, one layer times 30), in wall and process CPU time: on one thread, CPU time
is the op's own work even on a busy host; --torch adds torch's scaled_dot_product_attention (the reference op: K/V
gathered from the paged cache, then its CPU kernel) as a candidate.

Prompts are random token ids, new each run (prefix caching never hits); the model is the default one (8,192
positions: 8,000 prompt tokens leave room for the output) unless --model names another (a GGUF file or a model
directory)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from tritonllm import kernels  # noqa: E402
from tritonllm.engine.layers import attention  # noqa: E402
from tritonllm.engine.config import EngineConfig  # noqa: E402
from tritonllm.engine.llm_engine import LLMEngine, Request  # noqa: E402
from tritonllm.interface.parameters import SamplingParams  # noqa: E402
from tritonllm.kernels import cpu  # noqa: E402
from tritonllm.kernels.prefill_attention import prefill_attention_reference  # noqa: E402
from tritonllm.model_files import prepare_default_model, resolve_model_path  # noqa: E402
from cpu_ops_ab import built_ops  # noqa: E402

_prompts = torch.Generator().manual_seed(0)


def random_prompt(tokens: int) -> list[int]:
    return torch.randint(1000, 40000, (tokens,), generator=_prompts).tolist()


class AttentionClock:
    """Wall time inside the engine's prefill attention ops (float32: through the kernels module; bfloat16 prompts:
    the layers' own import)."""

    def __init__(self):
        self.seconds = 0.0
        kernels.prefill_attention = self._timed(kernels.prefill_attention)
        attention.prefill_attention_bf16 = self._timed(attention.prefill_attention_bf16)

    def _timed(self, op):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return op(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timed


def ttft(engine: LLMEngine, tokens: int, clock: AttentionClock) -> tuple[float, float]:
    """One request of `tokens` prompt tokens: (seconds to its first token, of them in prefill attention)."""
    clock.seconds = 0.0
    engine.add_request(Request(f"prefill-{tokens}-{time.monotonic_ns()}", random_prompt(tokens),
                               SamplingParams(max_tokens=1, temperature=0.0)))
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started, clock.seconds


STREAM_TOKENS = 128  # a decode stream's output before a new one takes its place


def itl_during_arrival(engine: LLMEngine, streams: int, arrival: int, steps: int) -> tuple[list[float], list[float]]:
    """`streams` decoding streams, their step times over `steps` steps alone, then while a prompt of `arrival`
    tokens prefills (until its first token). The load is stationary: a stream that ends (after STREAM_TOKENS
    tokens, the first ones staggered) is replaced by a new one of 64 prompt tokens, so the contexts stay within
    the same range however long the prompt takes and both phases time the same work (streams that decoded on
    for the prompt's minutes would slow down by their own growth)."""
    def start(tokens: int) -> None:
        engine.add_request(Request(f"stream-{time.monotonic_ns()}", random_prompt(64),
                                   SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)))

    def timed_step() -> tuple[float, list]:
        started = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - started
        for output in outputs:
            if output.finished and output.request_id.startswith("stream-"):
                start(STREAM_TOKENS)
        return seconds, outputs

    for i in range(streams):
        start(STREAM_TOKENS * (i + 1) // streams)
    for _ in range(STREAM_TOKENS + 16):  # every stream replaced once: the staggered steady state
        timed_step()
    alone = [timed_step()[0] for _ in range(steps)]
    long_id = f"arrival-{time.monotonic_ns()}"
    engine.add_request(Request(long_id, random_prompt(arrival), SamplingParams(max_tokens=1, temperature=0.0)))
    during = []
    while True:
        seconds, outputs = timed_step()
        during.append(seconds)
        if any(o.request_id == long_id for o in outputs):
            break
    engine.abort_all()
    engine.step()
    return alone, during


def attention_op_seconds(tokens: int, chunk: int, op) -> tuple[float, float]:
    """(wall, CPU) seconds of one layer's prefill attention over a `tokens` prompt in chunks of `chunk`, times the
    default model's 30 layers."""
    heads, kv_heads, head_dim, block_size, layers = 9, 3, 64, 16, 30
    blocks = -(-tokens // block_size)
    k_cache, v_cache = (torch.randn(blocks, block_size, kv_heads, head_dim) for _ in range(2))
    table = torch.randperm(blocks).view(1, blocks)
    wall = cpu_seconds = 0.0
    for start in range(0, tokens, chunk):
        length = min(chunk, tokens - start)
        q = torch.randn(length, heads, head_dim)
        lens = [torch.tensor([n], dtype=torch.int32) for n in (0, length, start + length)]
        started, cpu_started = time.perf_counter(), time.process_time()
        op(q, k_cache, v_cache, *lens, table, head_dim ** -0.5)
        wall += time.perf_counter() - started
        cpu_seconds += time.process_time() - cpu_started
    return wall * layers, cpu_seconds * layers


def percentile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048,8000", help="prompt tokens (0: none)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each build per length")
    parser.add_argument("--before", help="a git revision whose CPU ops run alternately with this checkout's")
    parser.add_argument("--streams", type=int, default=0, help="decode streams for the ITL measurement (0: none)")
    parser.add_argument("--arrival", type=int, default=8000, help="prompt tokens arriving while they decode")
    parser.add_argument("--steps", type=int, default=2 * STREAM_TOKENS, help="decode steps timed before the arrival")
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    parser.add_argument("--max-decode-slowdowns", default=str(EngineConfig.max_decode_slowdown),
                        help="an engine of each, alternating (e.g. 0,2: the token budget alone, then paced)")
    parser.add_argument("--weight-format", default="auto")
    parser.add_argument("--model", type=Path, help="a GGUF file or model directory (default: the default model)")
    parser.add_argument("--prefill-dtypes", default="float32", help="an engine of each, alternating (e.g. "
                                                                     "float32,bfloat16)")
    parser.add_argument("--op", action="store_true", help="time the prefill attention op alone (no engine)")
    parser.add_argument("--torch", action="store_true", help="with --op: torch's reference op too")
    args = parser.parse_args()
    if args.op:
        return op_main(args)
    model = resolve_model_path(args.model) if args.model else prepare_default_model()
    dtypes, slowdowns = args.prefill_dtypes.split(","), [float(s) for s in args.max_decode_slowdowns.split(",")]
    engines = {", ".join([f"{dtype} prompts"] * (len(dtypes) > 1) + [f"slowdown {slowdown:g}"] * (len(slowdowns) > 1)):
               LLMEngine(EngineConfig(model_path=str(model), weight_format=args.weight_format, prefill_dtype=dtype,
                                      max_num_batched_tokens=args.max_num_batched_tokens,
                                      max_decode_slowdown=slowdown))
               for dtype in dtypes for slowdown in slowdowns}
    clock = AttentionClock()
    print(f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, weights "
          f"{next(iter(engines.values())).core.runner.weight_format}, ops -march={cpu.MARCH}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}, max_decode_slowdown {args.max_decode_slowdowns}",
          flush=True)
    with tempfile.TemporaryDirectory() as before_dir, tempfile.TemporaryDirectory() as after_dir:
        builds = {"this checkout": cpu._library}
        if args.before:
            builds = {f"before ({args.before})": built_ops(args.before, Path(before_dir)),
                      "after (this checkout)": built_ops(None, Path(after_dir))}
        runs_of = {(f"{name}, {label}" if len(engines) > 1 else name): (library, engine)
                   for name, library in builds.items() for label, engine in engines.items()}
        for engine in engines.values():
            ttft(engine, 64, clock)  # warm-up
        for tokens in (int(n) for n in args.lengths.split(",") if int(n)):
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in runs_of}
            for _ in range(args.rounds):
                for name, (library, engine) in runs_of.items():
                    cpu._library = library
                    seconds, in_attention = ttft(engine, tokens, clock)
                    results[name].append((seconds, in_attention))
                    print(f"  {tokens} tokens, {name}: TTFT {seconds:.2f} s ({tokens / seconds:.0f} tok/s), "
                          f"prefill attention {in_attention:.2f} s ({in_attention / seconds:.0%})", flush=True)
            for name, runs in results.items():
                seconds = statistics.median(s for s, _ in runs)
                in_attention = statistics.median(a for _, a in runs)
                print(f"{tokens} tokens, {name}: median TTFT {seconds:.2f} s, {tokens / seconds:.0f} tok/s, "
                      f"attention {in_attention:.2f} s", flush=True)
        if args.streams:
            for name, (library, engine) in runs_of.items():
                cpu._library = library
                alone, during = itl_during_arrival(engine, args.streams, args.arrival, args.steps)
                print(f"{args.streams} streams, {name}: ITL alone p50 {statistics.median(alone) * 1e3:.1f} ms, "
                      f"p99 {percentile(alone, 0.99) * 1e3:.1f} ms; while {args.arrival} tokens prefill "
                      f"({len(during)} steps, {sum(during):.1f} s) p50 {statistics.median(during) * 1e3:.1f} ms, "
                      f"p99 {percentile(during, 0.99) * 1e3:.1f} ms ({percentile(during, 0.99) / statistics.median(alone):.2f}x "
                      f"the p50 alone), max {max(during) * 1e3:.1f} ms", flush=True)


def library_op(library):
    """The prefill attention op through a built library of the CPU ops."""
    def op(*args):
        cpu._library = library
        return cpu.prefill_attention(*args)
    return op


def op_main(args: argparse.Namespace) -> None:
    print(f"{torch.get_num_threads()} threads, ops -march={cpu.MARCH}, chunks of {args.max_num_batched_tokens}")
    with tempfile.TemporaryDirectory() as before_dir, tempfile.TemporaryDirectory() as after_dir:
        ops = {"this checkout": library_op(built_ops(None, Path(after_dir)))}
        if args.before:
            ops = {f"before ({args.before})": library_op(built_ops(args.before, Path(before_dir))),
                   "after (this checkout)": ops["this checkout"]}
        if args.torch:
            ops["torch sdpa (reference)"] = prefill_attention_reference
        for tokens in (int(n) for n in args.lengths.split(",") if int(n)):
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in ops}
            for _ in range(args.rounds):
                for name, op in ops.items():
                    results[name].append(attention_op_seconds(tokens, args.max_num_batched_tokens, op))
            for name, runs in results.items():
                print(f"{tokens} tokens, {name}: attention x30 layers, median wall "
                      f"{statistics.median(w for w, _ in runs):.2f} s, CPU {statistics.median(c for _, c in runs):.2f} "
                      f"s (runs' CPU: {', '.join(f'{c:.2f}' for _, c in runs)})", flush=True)


if __name__ == "__main__":
    main()
