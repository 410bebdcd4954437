"""Engine settings, declared once: `tritonllm serve` / `write-repository` options (with env vars and help), the
`llm` model's config.pbtxt parameters and `EngineConfig` all come from these fields; `InstanceGroup` says how
many engines one tritonserver runs, and where (the config.pbtxt instance_group)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from tritonllm.interface import settings
from tritonllm.interface.settings import setting

SCHEDULING_POLICIES = ("fcfs", "priority")  # tritonllm/engine/core/scheduler.py says what each does
# tritonllm/engine/layers/linear.py says what each is
WEIGHT_FORMATS = ("auto", "float32", "float16", "bfloat16", "int8", "int4", "int4-q8")
KV_CACHE_DTYPES = ("auto", "float16")  # tritonllm/engine/core/model_runner.py: kv_cache_dtype
PREFILL_DTYPES = ("auto", "float32", "bfloat16", "int8")  # tritonllm/engine/layers/row_dtype.py
DECODE_DTYPES = ("float32", "int8")
# llama.cpp's block types an HF checkpoint may be quantized to at load (tritonllm/engine/models/weights.py)
QUANTIZATIONS = ("none", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k")

_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str | int) -> int:
    """'1GiB', '512MiB', '2e9' or 1073741824 → bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a memory size: {text!r} (examples: 1GiB, 512MiB, 2000000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


AUTO = "auto"


def parse_size_or_auto(text: str | int) -> int | str:
    """'auto' or a memory size in bytes (parse_size)."""
    return AUTO if str(text).strip().lower() == AUTO else parse_size(text)


def at_least_one(name: str) -> Callable[[str], int]:
    """The parser of a whole-number setting that must be at least 1."""
    def parse(text: str) -> int:
        count = int(text)
        if count < 1:
            raise ValueError(f"{name} must be at least 1, not {count}")
        return count
    return parse


def slowdown(text: str) -> float:
    """max_decode_slowdown's parser: 0 (off) or at least 1."""
    value = float(text)
    if value != 0 and not value >= 1:
        raise ValueError(f"max_decode_slowdown must be 0 (off) or at least 1, not {text}")
    return value


@dataclass(frozen=True)
class EngineConfig:
    model_path: str = setting("", "HF model directory, .gguf file, or Hugging Face hub id ORG/NAME[@REVISION] "
                                  "(downloaded into the HF cache; HF_HUB_OFFLINE=1: the cache only; a GGUF-only "
                                  "repository: ORG/NAME[@REVISION]:FILE.gguf); empty for the default model",
                              option="model")
    dtype: str = setting("auto", "activations dtype, the KV cache's too unless kv_cache_dtype says otherwise (auto: "
                                 "bfloat16 on CUDA; on the CPU what the weight format runs with)")
    weight_format: str = setting("auto", "CPU projection weights: float32, float16, bfloat16, int8, int4 or int4-q8 "
                                         "(int4 with llama.cpp's int8 activations); auto times the exact or "
                                         "near-exact ones at load and takes the fastest",
                                 choices=WEIGHT_FORMATS)
    quantization: str = setting("none", "an HF checkpoint's projections quantized at load to llama.cpp's blocks "
                                        "(its reference quantizers; the LM head to q8_0), run as a GGUF's blocks by "
                                        "the int4 or int4-q8 weight format: q8_0, q4_0, q4_1, q5_0, q4_k (q5_0 "
                                        "where a width is no multiple of 256, as llama-quantize); none: as stored",
                                choices=QUANTIZATIONS)
    prefill_dtype: str = setting("auto", "the CPU engine's prompt tokens: float32 (exact: the bits decoding them "
                                         "would give), bfloat16 (their projections and attention on the CPU's bf16 "
                                         "matrix units, AMX or AVX512-BF16: prompts several times faster, their "
                                         "inputs rounded to bf16; projections of a GGUF's blocks read the blocks, "
                                         "others keep bf16 weights beside the format's, 2 bytes a weight), int8 "
                                         "(int4-q8's kernels with one level of int8 codes for their inputs, "
                                         "llama.cpp's numerics, where decode rows take two: half the integer work), "
                                         "or auto: int8 with decode_dtype int8, bfloat16 on CPUs with AMX or "
                                         "AVX512-BF16 and float32 activations unless that needs a copy of a GGUF "
                                         "read as its blocks alone, else float32",
                                 choices=PREFILL_DTYPES)
    decode_dtype: str = setting("float32", "the CPU engine's decode tokens and LM head: float32 (exact; int4-q8's "
                                           "kernels take two levels of int8 codes for their inputs, near-exact) or "
                                           "int8 (int4-q8's kernels with one level: llama.cpp's numerics, half the "
                                           "integer work of a batched step; prompts then int8 too unless "
                                           "prefill_dtype says otherwise)",
                                choices=DECODE_DTYPES)
    device: str = setting("auto", "cpu, cuda or auto (cuda when available)")
    kv_cache_memory: int = setting(1 << 30, "bytes for the paged KV cache of each engine instance (e.g. 512MiB, 8GiB)",
                                   parse=parse_size)
    kv_cache_dtype: str = setting("auto", "the KV cache's dtype: auto (the activations') or float16 (the CPU engine "
                                          "with float32 activations: keys and values rounded to float16, half the "
                                          "cache's memory and half the bytes decode attention reads)",
                                  choices=KV_CACHE_DTYPES)
    kv_host_memory: int | str = setting(
        AUTO, "bytes of host memory for the KV cache's host tier: full blocks the KV cache evicts are kept there "
              "(least recently used out) and copied back on a prefix hit; 0: off; auto: off on the CPU (the KV cache "
              "is host memory already), 2 x kv_cache_memory of pinned memory on CUDA", parse=parse_size_or_auto)
    kv_storage_dir: str = setting(
        "", "directory of the KV cache's storage tier: every computed block is written there (one file a block, off "
            "the engine's thread) and found again after the device and host tiers evicted it, after a restart, and "
            "by the other stacks sharing the directory; empty: off")
    kv_storage_size: int = setting(16 << 30, "bytes the storage tier's files may take (least recently used out)",
                                   parse=parse_size)
    block_size: int = setting(16, "tokens per KV cache block")
    max_num_seqs: int = setting(64, "sequences in the running batch")
    max_num_batched_tokens: int = setting(512, "token budget of one engine step (prefill chunks + decodes)")
    max_decode_slowdown: float = setting(
        0.0, "while sequences decode, size a step's prompt chunks (from measured step times) so the step takes "
             "about this many times a step of the decodes alone: their inter-token latency while a long prompt "
             "prefills, traded for its time to first token (0: off, the token budget alone sizes the chunks)",
        parse=slowdown)
    scheduling_policy: str = setting("fcfs", "fcfs: first come, first served; priority: by each request's priority "
                                             "(lower first, then arrival), preempting lower-priority running "
                                             "sequences for a waiting one (vLLM's)", choices=SCHEDULING_POLICIES)
    max_queue_len: int = setting(256, "waiting requests before new ones are refused")
    reasoning_parser: str = setting("auto", "chat answers of a model that reasons in tags: its reasoning apart from "
                                            "the answer (reasoning_content), constraints on the answer after it: a "
                                            "model family of tritonllm/engine/processing/reasoning.py by vLLM's "
                                            "name, none, or auto: the family whose tags the chat template writes")
    stream_interval: int = setting(1, "streamed requests: a response once a choice has this many new tokens (the "
                                      "first and the last at once); more spends less CPU per token in every process "
                                      "of the stack, in fewer, larger chunks (vLLM's and SGLang's --stream-interval)",
                                   parse=at_least_one("stream_interval"))
    max_step_failures: int = setting(3, "engine steps failing in a row after which the engine is dead: it refuses "
                                        "all requests and reports unhealthy (a persistent fault)")
    max_model_len: int = setting(0, "longest prompt + output in tokens; 0: the model's max_position_embeddings")
    enable_prefix_caching: bool = setting(True, "reuse the KV of cached prompt prefixes")
    lora_dir: str = setting("", "directory of PEFT LoRA adapters, one per subdirectory (empty: LoRA off)")
    max_loras: int = setting(4, "LoRA adapters resident at once; more wait for a slot")
    max_lora_rank: int = setting(16, "largest LoRA rank accepted (sizes the slot pool)")
    max_hidden_states_tokens: int = setting(
        4096, "most hidden states one request may ask for (choices x (max_tokens + echoed prompt tokens))")

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> "EngineConfig":
        """From the model's config.pbtxt parameters; absent or empty ones keep their default."""
        return settings.from_strings(cls, values)

    def to_strings(self) -> dict[str, str]:
        """As config.pbtxt parameters."""
        return settings.to_strings(self)


def parse_gpu_ids(text: str) -> str:
    """'0, 1' → '0,1'; empty stays empty."""
    ids = [part.strip() for part in str(text).split(",") if part.strip()]
    if not all(part.isdigit() for part in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"not a list of distinct GPU ids: {text!r} (example: 0,1)")
    return ",".join(ids)


@dataclass(frozen=True)
class InstanceGroup:
    """The engines one tritonserver runs: the `llm` model's instance_group. Each instance is a whole engine in
    its own stub process (weights, KV cache of kv_cache_memory, scheduler); Triton hands each request to a free
    instance, with no regard for which one holds its prompt's prefix in cache."""

    instances: int = setting(1, "engines (Triton model instances) in this tritonserver; with --gpus, engines on "
                                "each listed GPU", parse=at_least_one("instances"))
    gpus: str = setting("", "GPU ids for the engines, e.g. 0,1 (KIND_GPU: each engine on its GPU); empty: "
                            "KIND_MODEL, each engine takes CUDA when available, else the CPU", parse=parse_gpu_ids)

    def to_pbtxt(self) -> str:
        """The instance_group entry of config.pbtxt."""
        if not self.gpus:
            return f"instance_group [{{ count: {self.instances}, kind: KIND_MODEL }}]"
        gpus = ", ".join(self.gpus.split(","))
        return f"instance_group [{{ count: {self.instances}, kind: KIND_GPU, gpus: [ {gpus} ] }}]"
