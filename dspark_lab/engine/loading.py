"""Resolve a model reference to files, refuse what we should not run, and load through mlx-lm
(or, for multimodal checkpoints, mlx-vlm's model classes, of which only the text path runs).

Every failure a user can cause (a typo in a path, an offline cache miss, a checkpoint that
wants to run its own Python, weights that do not fit the config) becomes a LoadError whose
message says what is wrong and how to fix it, instead of a traceback from deep in a loader.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Sequence

from ..errors import LoadError, SlowDtypeWarning

# What a text model needs from a repo; mirrors what mlx-lm fetches, without the weights of
# other formats (.bin, .gguf) that we would never read.
ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jsonl", "*.jinja"]

# Bits mlx's quantized matmul supports (affine mode).
SUPPORTED_QUANT_BITS = (2, 3, 4, 5, 6, 8)

# Config files whose `auto_map` / `model_file` would make transformers or mlx-lm import
# Python shipped with the checkpoint.
REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "generation_config.json", "processor_config.json", "preprocessor_config.json")
REMOTE_CODE_KEYS = ("auto_map", "model_file")
TRUST_ENV = "DSPARK_LAB_TRUST_REMOTE_CODE"


def _looks_like_repo_id(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not ref.startswith((".", "~")) and " " not in ref


def check_reference(ref: str | os.PathLike, *, what: str = "model") -> None:
    """Refuse, without touching the network, a reference that is neither a path here nor a
    Hugging Face repo id (owner/name): a typo, which resolve_model_path would refuse the same way."""
    if not Path(ref).expanduser().exists() and not _looks_like_repo_id(str(ref)):
        raise LoadError(f"{what} {str(ref)!r} not found: no such directory, and it is not a Hugging Face repo id (owner/name). Check the path.")


def resolve_model_path(ref: str | os.PathLike, *, what: str = "model") -> Path:
    """A local directory, or a Hugging Face repo id fetched (or found in the cache) through
    huggingface_hub. Honours HF_HUB_OFFLINE: offline and not cached is an error that says so."""
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise LoadError(f"{what} path {str(path)!r} is a file; pass the directory that holds config.json and the *.safetensors weights (for a .gguf file, run `dspark-lab import-gguf` first).")
        return path
    check_reference(ref, what=what)
    ref = str(ref)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(ref, allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError as e:
        if offline:
            raise LoadError(
                f"{what} {ref!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 forbids downloading it. "
                f"Fix: download it once with network access (`hf download {ref}`), or unset HF_HUB_OFFLINE, or pass a local directory."
            ) from e
        raise LoadError(f"could not download {what} {ref!r} from the Hugging Face hub ({e}). Check your network, or pass a local directory.") from e
    except RepositoryNotFoundError as e:
        raise LoadError(f"{what} repo {ref!r} does not exist on the Hugging Face hub (or is private: log in with `hf auth login`).") from e
    except HfHubHTTPError as e:
        raise LoadError(f"could not download {what} {ref!r}: {e}") from e


def weights_digest(ref: str | os.PathLike | None) -> str | None:
    """A short fingerprint of the weights a folder holds (config.json and every *.safetensors file,
    in name order): which version of a head or model was measured. A head continued and stored
    again at the same path (fixtures/NAME after each training session) gets a new digest, so a
    trial, a registry entry and a resumed sweep can tell the versions apart. None for what is not
    a local folder (a hub id: its snapshot is already pinned by its revision)."""
    if ref is None:
        return None
    folder = Path(ref).expanduser()
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.name == "config.json" or p.suffix == ".safetensors")
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:16]


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LoadError(f"{path} is not valid JSON ({e}). Re-download or repair the file.") from e
    if not isinstance(data, dict):
        raise LoadError(f"{path} must hold a JSON object, found {type(data).__name__}.")
    return data


def remote_code_markers(model_dir: Path) -> list[str]:
    """Every place in the checkpoint's config files that asks to import shipped Python,
    including nested configs (text_config, vision_config, ...)."""
    found: list[str] = []

    def walk(obj: Any, file: str, prefix: str) -> None:
        if isinstance(obj, dict):
            for key, value in obj.items():
                if key in REMOTE_CODE_KEYS and value:
                    found.append(f"{file}: {prefix}{key}")
                elif isinstance(value, dict):
                    walk(value, file, f"{prefix}{key}.")

    for name in REMOTE_CODE_FILES:
        f = model_dir / name
        if f.exists():
            try:
                walk(json.loads(f.read_text()), name, "")
            except json.JSONDecodeError:
                pass  # a broken file is reported by the loader that needs it
    return found


def check_remote_code(model_dir: Path, trust_remote_code: bool) -> None:
    markers = remote_code_markers(model_dir)
    if markers and not (trust_remote_code or os.environ.get(TRUST_ENV) == "1"):
        raise LoadError(
            f"checkpoint {str(model_dir)!r} asks to import its own Python code ({'; '.join(markers)}). "
            f"dspark-lab refuses this by default. If you trust its author, pass --trust-remote-code "
            f"(trust_remote_code=True) or set {TRUST_ENV}=1."
        )


# The pip extra that brings mlx-vlm, as the refusal messages name it.
VLM_FIX = 'pip install "dspark-lab[vlm]"'


def is_multimodal(config: dict[str, Any]) -> bool:
    """A vision-language (or audio) checkpoint: its text model sits in a nested text_config."""
    return any(isinstance(config.get(k), dict) for k in ("text_config", "vision_config", "audio_config"))


def _mlx_lm_has(config: dict[str, Any]) -> bool:
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except ValueError:
        return False
    return True


def _mlx_vlm_has(config: dict[str, Any]) -> bool | None:
    """Whether mlx-vlm has this model_type; None when mlx-vlm is not installed."""
    try:
        from mlx_vlm.utils import get_model_and_args
    except ImportError:
        return None
    try:
        get_model_and_args({k: v for k, v in config.items() if k != "model_file"})
    except (ValueError, KeyError):
        return False
    except ImportError as e:  # the family's module exists but needs something missing
        raise LoadError(f"mlx-vlm's model_type {config.get('model_type')!r} cannot be imported ({e}); install what it names.") from e
    return True


def choose_loader(config: dict[str, Any], cfg_path: Path | str = "config.json") -> str:
    """"mlx-vlm" for a multimodal config (or a model_type only mlx-vlm has) when mlx-vlm has
    the model_type, else "mlx-lm" when mlx-lm has it (its own text path of e.g. gemma3); a
    model_type neither has, or one that needs mlx-vlm when it is not installed, is refused."""
    model_type = config.get("model_type")
    lm_has = _mlx_lm_has(config)
    if lm_has and not is_multimodal(config):
        return "mlx-lm"
    vlm_has = _mlx_vlm_has(config)
    if vlm_has:
        return "mlx-vlm"
    if lm_has:
        return "mlx-lm"
    if vlm_has is None and is_multimodal(config):
        raise LoadError(
            f"model_type {model_type!r} in {cfg_path} is a multimodal architecture that mlx-lm {_mlx_lm_version()} does not have; "
            f"dspark-lab runs such models' text path through mlx-vlm, which is not installed. Fix: {VLM_FIX}."
        )
    if vlm_has is None:
        raise LoadError(
            f"unknown model_type {model_type!r} in {cfg_path}: mlx-lm {_mlx_lm_version()} has no such architecture "
            f"(and mlx-vlm, which has more, is not installed: {VLM_FIX}). Upgrade mlx-lm, or check the config."
        )
    from mlx_vlm import __version__ as vlm_version

    raise LoadError(
        f"unknown model_type {model_type!r} in {cfg_path}: neither mlx-lm {_mlx_lm_version()} nor mlx-vlm {vlm_version} "
        "has such an architecture, so dspark-lab has no dedicated support for it. Upgrade them, or check the config."
    )


def read_model_config(model_dir: Path) -> dict[str, Any]:
    """The model's config.json, or a LoadError saying the folder is not a model directory."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.exists():
        raise LoadError(f"no config.json in {str(model_dir)!r}: this is not a Hugging Face-layout model directory. Pass the directory that holds config.json and the weights.")
    return read_json(cfg_path)


def quantization_entry(config: dict[str, Any]) -> Any:
    """A model config's quantization entry as written (mlx-lm's "quantization", or Hugging Face's
    "quantization_config"); None for float weights."""
    return config.get("quantization") or config.get("quantization_config")


def validate_config(model_dir: Path) -> dict[str, Any]:
    """config.json present, a model_type mlx-lm (or mlx-vlm) knows, quantization bits mlx supports."""
    cfg_path = model_dir / "config.json"
    config = read_model_config(model_dir)
    model_type = config.get("model_type")
    if not model_type:
        raise LoadError(f"{cfg_path} has no model_type; dspark-lab cannot tell which architecture to build.")
    choose_loader(config, cfg_path)
    quant = quantization_entry(config) or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    if bits is not None and bits not in SUPPORTED_QUANT_BITS:
        raise LoadError(f"unsupported quantization: {bits} bits in {cfg_path}; MLX supports {', '.join(map(str, SUPPORTED_QUANT_BITS))}. Re-quantize the model (e.g. `mlx_lm.convert -q --q-bits 4`).")
    if not list(model_dir.glob("model*.safetensors")):
        raise LoadError(f"no model*.safetensors weights in {str(model_dir)!r}. Convert the checkpoint to safetensors (`mlx_lm.convert`), or import a GGUF with `dspark-lab import-gguf`.")
    return config


def _mlx_lm_version() -> str:
    from mlx_lm import __version__

    return __version__


def load_mlx_lm(model_dir: Path, *, trust_remote_code: bool = False):
    """mlx-lm's loader, with its weight/config mismatch errors turned into LoadErrors."""
    from mlx_lm.utils import load

    try:
        return load(str(model_dir), return_config=True, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise _load_error(model_dir, e, "") from e


def _load_error(model_dir: Path, e: ValueError, via: str) -> LoadError:
    """A loader's ValueError as a LoadError: weights that do not fit the config say so."""
    msg = str(e)
    if "parameters" in msg or "Missing" in msg or "shape" in msg or "Received" in msg:
        return LoadError(
            f"the safetensors in {str(model_dir)!r} do not match its config.json: {msg.strip()} "
            "The weights and config come from different models, or the download is incomplete."
        )
    return LoadError(f"could not load {str(model_dir)!r}{via}: {msg}")


def load_mlx_vlm(model_dir: Path, config: dict[str, Any]):
    """mlx-vlm's model class for a multimodal checkpoint, reduced to its language model (text
    generation is all dspark-lab does), with mlx-lm's tokenizer wrapper. Returns the language
    model, the tokenizer and the text config (model_type kept as the checkpoint names it)."""
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.utils import load_model

    try:
        model = load_model(model_dir)
    except ValueError as e:
        raise _load_error(model_dir, e, " through mlx-vlm") from e
    language_model = getattr(model, "language_model", None)
    if language_model is None:
        raise LoadError(f"mlx-vlm's model_type {config.get('model_type')!r} has no language_model; this family needs dedicated support in dspark-lab.")
    text_config = {**config, **(config.get("text_config") or {}), "model_type": config.get("model_type")}
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id", text_config.get("eos_token_id")))
    return language_model, tokenizer, text_config


DTYPES = ("float32", "float16", "bfloat16")


def cpu_dtype_advice(model, name: str) -> str | None:
    """What to say when `model` holds bfloat16 or float16 weights and MLX runs on its CPU
    backend, which computes half precision slowly (a 4-bit bfloat16 Qwen2.5-Coder-0.5B decoded
    10.1x faster cast to float32 on a 2-core machine: docs/results/cpu_dtype_qwen05.txt); None
    on a GPU, or when the weights are float32 already."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if mx.default_device().type != mx.cpu:
        return None
    halves = sorted({str(p.dtype).rsplit(".", 1)[-1] for _, p in tree_flatten(model.parameters())
                     if p.dtype in (mx.bfloat16, mx.float16)})
    if not halves:
        return None
    return (f"{name} has {' and '.join(halves)} weights and MLX runs on its CPU backend here, where that "
            "arithmetic is slow: load it with --dtype float32 (dtype='float32' in Python), which decoded a "
            "4-bit bfloat16 Qwen2.5-Coder-0.5B 10x faster on a 2-core machine; the greedy tokens may then "
            "differ from the half-precision model's at near-ties.")


def load_tokenizer(repo_or_path: str | os.PathLike, *, trust_remote_code: bool = False):
    """The model's tokenizer alone (mlx-lm's TokenizerWrapper, with the eos ids load_target's
    has): for work that only tokenizes, such as reading a corpus into distill's data, where
    loading the weights took minutes on a CPU."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer

    model_dir = resolve_model_path(repo_or_path)
    check_remote_code(model_dir, trust_remote_code)
    config = read_model_config(model_dir)  # the weights need not be there: nothing here reads them
    eos = config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))
    return mlx_lm_tokenizer(model_dir, eos_token_ids=eos)


def cast_floats(module, dtype: str) -> None:
    """Cast a module's float parameters (a quantized layer's scales and biases too) to `dtype`
    in place; integer ones (packed quantized weights) stay as they are."""
    import mlx.core as mx
    from mlx.utils import tree_map

    want = getattr(mx, dtype)
    module.update(tree_map(lambda p: p.astype(want) if mx.issubdtype(p.dtype, mx.floating) else p, module.parameters()))
    mx.eval(module.parameters())


def load_target(
    repo_or_path: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    kv_bits: int | None = None,
    dtype: str | None = None,
    taps: Sequence[int] | None = None,
    dequantize: bool = False,
    quantize: int | None = None,
    fuse_projections: bool = True,
):
    """Load a causal LM as a `Target` plus its tokenizer (mlx-lm's TokenizerWrapper).
    A multimodal checkpoint loads through mlx-vlm and runs as its language model (text only).

    `kv_bits` quantizes the KV cache; `dtype` casts the float weights, a quantized model's scales
    and biases too (float32 is the fast choice on MLX's CPU backend: a 4-bit bfloat16
    Qwen2.5-Coder-0.5B decoded 10x faster cast to float32 on a 2-core machine); `taps` lists the
    layers a drafter will read, and asking for them runs the one-time probe that the tap
    reproduces the model's logits. `dequantize`
    turns a quantized model's layers into plain ones holding the same weights (mlx-lm's
    dequantize_model): the same model in more memory, for work at large batch sizes, where
    dense matmuls beat the quantized kernels (docs/performance.md, tenth round). `quantize` stores
    the model's layers at that many bits on load (mlx-lm's quantize_model, groups of 64), a
    quantized model's after dequantizing them: how a benchmark times one model at 4 and 8 bits
    without a second download (the 8-bit copy of a 4-bit file holds values within a quarter of a
    4-bit step of its own, in twice the bytes). `fuse_projections` (default on) stacks each layer's
    q/k/v and gate/up projections into one product each (Target.fuse_projections: the same
    outputs bit for bit on MLX's kernels, 5 fewer operations a Qwen2 layer; plain decoding of the
    4-bit Qwen 0.5B and 1.5B 1.06-1.11x faster on an H100, docs/performance.md, forty-second
    round); off keeps the model's layers as stored. Half-precision
    weights left as they are on MLX's CPU backend give a SlowDtypeWarning that says so."""
    from .target import Target

    if kv_bits is not None and kv_bits not in SUPPORTED_QUANT_BITS:
        raise LoadError(f"kv_bits={kv_bits} is not supported; use one of {', '.join(map(str, SUPPORTED_QUANT_BITS))} (or leave it unset for a full-precision cache).")
    if dtype is not None and dtype not in DTYPES:
        raise LoadError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}.")
    model_dir = resolve_model_path(repo_or_path)
    check_remote_code(model_dir, trust_remote_code)
    config = validate_config(model_dir)
    if choose_loader(config) == "mlx-vlm":
        model, tokenizer, config = load_mlx_vlm(model_dir, config)
    else:
        model, tokenizer, config = load_mlx_lm(model_dir, trust_remote_code=trust_remote_code)
    if dtype is not None:
        cast_floats(model, dtype)
    elif advice := cpu_dtype_advice(model, str(repo_or_path)):
        warnings.warn(advice, SlowDtypeWarning, stacklevel=2)
    if quantize is not None and quantize not in SUPPORTED_QUANT_BITS:
        raise LoadError(f"quantize={quantize} is not supported; use one of {', '.join(map(str, SUPPORTED_QUANT_BITS))} (or leave it unset to keep the weights as stored).")
    if dequantize or quantize is not None:
        import mlx.core as mx
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)  # a float model passes through unchanged
        if quantize is not None:
            from mlx_lm.utils import quantize_model

            config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
            model, config = quantize_model(model, config, group_size=64, bits=quantize)
        mx.eval(model.parameters())
    target = Target(model, config, name=str(repo_or_path), kv_bits=kv_bits)
    if fuse_projections:
        target.fuse_projections()
    if taps is not None:
        target.check_taps(taps)
        target.probe(taps)
    return target, tokenizer
