"""bench/peers.py's set-up: the long prompts, vLLM's dtype on this CPU, llama-server's KV cache like ours."""

import json
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is scripts, not a package
import peers  # noqa: E402
from tritonllm.model_files import default_gguf_path  # noqa: E402


def test_long_prompts_are_exact_ordinary_and_share_no_prefix(default_model_dir: Path):
    prompts = peers.long_prompts([16, 8000], default_model_dir)
    assert len(prompts.warm_up) == 16
    assert {length: [len(p) for p in of_length] for length, of_length in prompts.by_length.items()} == {
        16: [16] * peers.PROMPTS_PER_LENGTH, 8000: [8000] * peers.PROMPTS_PER_LENGTH}
    every = [prompts.warm_up, *(p for of_length in prompts.by_length.values() for p in of_length)]
    assert len({prompt[0] for prompt in every}) == len(every)  # no cached prefix on any server
    added = set(AutoTokenizer.from_pretrained(default_model_dir).added_tokens_decoder)
    assert added and not added & {token for prompt in every for token in prompt}
    assert peers.long_prompts([16, 8000], default_model_dir) == prompts  # the same on every server


@pytest.mark.parametrize("requested, bf16_hardware, isa, expected", [
    ("auto", True, "native", "bfloat16"),
    ("auto", False, "native", "float32"),
    ("auto", True, "avx2", "float32"),  # an AVX2-only box has no bf16 units
    ("float32", True, "native", "float32"),
    ("bfloat16", False, "native", "bfloat16"),
])
def test_vllm_dtype_is_bf16_on_bf16_hardware_only(requested, bf16_hardware, isa, expected, monkeypatch):
    monkeypatch.setattr(peers, "cpu_has_bf16", lambda: bf16_hardware)
    assert peers.vllm_dtype(requested, isa) == expected


def test_a_decode_step_reads_the_embedding_table_only_where_it_is_the_head():
    tied = {"token_embd.weight": 100, "blk.0.attn_q.weight": 10, "output_norm.weight": 1}
    assert peers.bytes_read_per_token(tied) == 111
    assert peers.bytes_read_per_token({**tied, "output.weight": 50}) == 61
    untied_hf = {"model.embed_tokens.weight": 100, "model.layers.0.mlp.up_proj.weight": 10, "lm_head.weight": 100}
    assert peers.bytes_read_per_token(untied_hf) == 110


def test_tensor_bytes_are_the_files_data(default_model_dir: Path):
    checkpoint = default_model_dir / "model.safetensors"
    header_bytes = 8 + int.from_bytes(checkpoint.read_bytes()[:8], "little")
    sizes = peers.tensor_bytes(default_model_dir)
    assert "model.embed_tokens.weight" in sizes and sum(sizes.values()) == checkpoint.stat().st_size - header_bytes
    gguf = default_gguf_path()
    from_gguf = peers.tensor_bytes(gguf)
    assert "token_embd.weight" in from_gguf and "output.weight" not in from_gguf  # SmolLM2's head is tied
    data = gguf.stat().st_size - GGUFReader(gguf).data_offset  # the tensors, each padded to the file's alignment
    assert data - 32 * len(from_gguf) < sum(from_gguf.values()) <= data


@pytest.mark.parametrize("argv, error", [
    (["--hf", "m", "--vllm-python", "p", "--quantization", "q4_0"], None),
    (["--gguf", "f.gguf", "--llama-server", "s"], None),
    (["--gguf", "f.gguf", "--llama-server", "s", "--prompt-tokens", "512"], None),
    (["--hf", "m", "--llama-server", "s"], "llama-server takes its GGUF"),
    (["--hf", "m", "--gguf", "f.gguf"], "--gguf compares"),
    (["--gguf", "f.gguf", "--vllm-python", "p"], "--gguf compares"),
    (["--streams", "0"], "nothing to measure"),
])
def test_options_that_cannot_go_together_are_refused(argv, error, capsys):
    if error is None:
        args = peers.parse_args(argv)
        assert args.levels == [1, 32] and args.prompt_tokens == ([512] if "--prompt-tokens" in argv else [])
        return
    with pytest.raises(SystemExit):
        peers.parse_args(argv)
    assert error in capsys.readouterr().err


@pytest.mark.parametrize("argv, dtype", [
    (["--gguf", "f.gguf", "--llama-server", "s"], "float16"),  # llama-server's own default KV type, f16
    (["--llama-server", "s", "--kv-cache-dtype", "float32"], "float32"),
    (["--gguf", "f.gguf"], "auto"),  # no llama-server: ours as it starts by default
    (["--llama-server", "s", "--kv-cache-dtype", "auto"], None),  # llama-server has no "auto"
])
def test_both_kv_caches_take_one_dtype(argv, dtype, capsys):
    if dtype is None:
        with pytest.raises(SystemExit):
            peers.parse_args(argv)
        assert "--kv-cache-dtype float16 or float32" in capsys.readouterr().err
        return
    assert peers.parse_args(argv).kv_cache_dtype == dtype


def test_both_kv_caches_hold_the_same_tokens(default_model_dir: Path):
    """Ours' --kv-cache-memory is the bytes of llama-server's context in the same dtype, by the shape in
    config.json; llama-server is given that dtype as its cache type."""
    config = json.loads((default_model_dir / "config.json").read_text())
    token_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"]
    tokens = peers.llama_server_context(32, 128, [])
    assert tokens == 32 * (peers.PROMPT_TOKENS_PER_SLOT + 128)
    assert peers.kv_memory_for(default_gguf_path(), tokens, "float16") == tokens * token_bytes * 2
    assert peers.kv_memory_for(default_gguf_path(), tokens, "float32") == tokens * token_bytes * 4
    command = peers.llama_server_peer(Path("llama-server"), default_gguf_path(), 32, 128, 2, [], "float16").command
    assert command[command.index("--ctx-size") + 1] == str(tokens)
    assert command[command.index("--cache-type-k") + 1] == command[command.index("--cache-type-v") + 1] == "f16"
