"""The models users bring, made here with random weights (no hub): a Llama-3.2-1B- or 3B-shaped HF checkpoint in
bf16 safetensors (what users download) with the default model's tokenizer and vocabulary (SmolLM2's, 49152
tokens), its BF16 GGUF by llama.cpp's `convert_hf_to_gguf.py`, and that quantized by `llama-quantize` into the
types people publish, for bench/peers.py (`--hf DIR/hf` against vLLM, `--gguf FILE` against llama-server).

    bash bench/setup_peers.sh /work/peers      # builds llama-server and llama-quantize, the converter's sentencepiece
    .venv/bin/python bench/users_models.py make DIR --shape 1b [--seed 0] [--types Q4_K_M,Q8_0,Q4_0] \\
        [--llama-cpp /work/peers/llama.cpp] [--convert-deps /work/peers/convert-deps]

DIR then holds hf/ (the checkpoint) and Llama-3.2-{1B,3B}-shaped-{BF16,Q4_K_M,Q8_0,Q4_0}.gguf. The weights are
transformers' own init (normal, std 0.02; norms at one), so activations stay finite: the model runs, it says
nothing. The converter runs on this Python (torch, transformers, numpy) with the llama.cpp tree's own gguf-py and
`--convert-deps` (a `pip install --target` folder holding sentencepiece, which it imports first) on its path."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tiny_models import TOKENIZER_FILES  # noqa: E402

# Llama-3.2-1B and 3B as published, but for the vocabulary (the default model's, so its tokenizer serves them)
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128),
}
COMMON = dict(tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
              initializer_range=0.02)
TYPES = "Q4_K_M,Q8_0,Q4_0"


def shape_config(shape: str, vocab_size: int, special_tokens: dict[str, int]) -> dict:
    """LlamaConfig's arguments for that shape."""
    return {**SHAPES[shape], **COMMON, "vocab_size": vocab_size, **special_tokens}


def parameter_count(config: dict) -> int:
    """Parameters of a Llama with these arguments (tied embeddings counted once), without building it."""
    hidden, heads, kv_heads, head_dim = (config[k] for k in ("hidden_size", "num_attention_heads",
                                                             "num_key_value_heads", "head_dim"))
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o; k and v
    mlp = 3 * hidden * config["intermediate_size"]
    layer = attention + mlp + 2 * hidden  # two RMS norms
    embedding = config["vocab_size"] * hidden
    head = 0 if config["tie_word_embeddings"] else embedding
    return embedding + config["num_hidden_layers"] * layer + hidden + head


def file_stem(shape: str) -> str:
    return f"Llama-3.2-{shape.upper()}-shaped"


def make_checkpoint(directory: Path, shape: str, seed: int, tokenizer_dir: Path) -> None:
    """The random bf16 checkpoint with the tokenizer's files beside it."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    default_config = json.loads((tokenizer_dir / "config.json").read_text())
    special = {key: default_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
               if key in default_config}
    config = LlamaConfig(**shape_config(shape, default_config["vocab_size"], special))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, directory / name)
    print(f"{directory}: {shape} shape, {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters, bf16")


def run(command: list[str], env: dict[str, str]) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, env={**os.environ, **env})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make", help="the checkpoint and its GGUFs into DIR")
    make.add_argument("dir", type=Path)
    make.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--types", default=TYPES, help="llama-quantize types, comma-separated")
    make.add_argument("--llama-cpp", type=Path, default=Path("/work/peers/llama.cpp"),
                      help="a llama.cpp tree with build/bin/llama-quantize (bench/setup_peers.sh's layout)")
    make.add_argument("--convert-deps", type=Path, default=Path("/work/peers/convert-deps"),
                      help="a folder put on the converter's PYTHONPATH (sentencepiece; setup_peers.sh makes it)")
    make.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    from tritonllm.model_files import prepare_default_model

    hf_dir = args.dir / "hf"
    if not (hf_dir / "config.json").exists():
        make_checkpoint(hf_dir, args.shape, args.seed, prepare_default_model())
    stem = args.dir / file_stem(args.shape)
    full = Path(f"{stem}-BF16.gguf")
    if not full.exists():
        run([sys.executable, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "bf16",
             "--outfile", str(full)], {"PYTHONPATH": str(args.convert_deps)})
    binaries = args.llama_cpp / "build" / "bin"
    for quant_type in args.types.split(","):
        quantized = Path(f"{stem}-{quant_type}.gguf")
        if not quantized.exists():
            run([str(binaries / "llama-quantize"), str(full), str(quantized), quant_type, str(args.threads)],
                {"LD_LIBRARY_PATH": str(binaries)})
        print(f"{quantized}: {quantized.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
