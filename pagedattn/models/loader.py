"""Build a model, its tokenizer and its spec from a checkpoint.

Four sources: `None` (the embedded SmolLM2 GGUF), a Hugging Face folder (`config.json` +
`*.safetensors`; pickle weights are refused), a `.gguf` file (dequantised to the model dtype),
or a Hugging Face Hub id (`org/name`), fetched into (or, with `HF_HUB_OFFLINE=1`, found in)
huggingface_hub's cache. transformers parses configs and tokenizers of both kinds (and an audio
model's feature extractor, from the folder's `preprocessor_config.json`); the weights are read here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pagedattn.layer import attention_impls
from pagedattn.models import ARCHITECTURES, UnsupportedModelError, get_model_cls
from pagedattn.models.cache import cache_dir, read_gguf_cached
from pagedattn.models.default import default_model_path
from pagedattn.models.layers import head_size_of, layer_sliding_windows
from pagedattn.parallel.group import TPGroup
from pagedattn.parallel.layers import SINGLE

HF_EXTRA_MODULES = ("transformers", "tokenizers", "safetensors", "gguf", "jinja2")
"""The modules of the `[hf]` extra that loading a model needs."""
# A Hub repository id: `name` or `org/name` of letters, digits, '-', '_', '.' (no '..').
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
# What a checkpoint folder needs from a Hub repository (never pickle weights).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class MissingExtraError(ImportError):
    """An optional dependency is missing; the message names the `pip install` to run."""


def require_hf_extra(*, gguf: bool = True) -> None:
    """Raise MissingExtraError naming `pip install 'pagedattn[hf]'` when a module of the extra is
    absent (`gguf` only when the model is a GGUF file: a safetensors folder loads without it)."""
    missing = [m for m in HF_EXTRA_MODULES if (gguf or m != "gguf") and not _importable(m)]
    if missing:
        raise MissingExtraError(
            f"loading a model needs the [hf] extra (missing: {', '.join(missing)}); "
            "install it with `pip install 'pagedattn[hf]'`"
        )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported already, without a spec: present
        return True


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """The local path of `model`: the embedded default for None, an existing path as is, and a
    Hugging Face Hub id (`org/name`) as its snapshot in huggingface_hub's cache, downloaded
    unless `HF_HUB_OFFLINE=1` (config, tokenizer and safetensors files only).

    Raises FileNotFoundError naming what was tried when none of these applies.
    """
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    text = str(model)
    if text.endswith(".gguf") or not _HUB_ID.match(text) or ".." in text:
        raise FileNotFoundError(
            f"model path {text!r} does not exist; expected a folder with config.json and "
            "*.safetensors, a .gguf file, a Hugging Face Hub id (org/name), or None for the embedded default model"
        )
    return _hub_snapshot(text)


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ModuleNotFoundError:
        raise MissingExtraError(
            f"{repo_id!r} is not a local path, and a Hugging Face Hub id needs huggingface_hub: "
            "install it with `pip install 'pagedattn[hf]'`"
        ) from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        where = " (HF_HUB_OFFLINE=1: only the cache is read)" if constants.HF_HUB_OFFLINE else ""
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local path, and the Hugging Face Hub id was not found in the cache "
            f"{constants.HF_HUB_CACHE!r} nor downloaded{where}: {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from e

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know about a loaded model (all host values)."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    """Width of `compute_logits`' output (may exceed the tokenizer's vocabulary)."""
    max_model_len: int
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    sliding_windows: tuple[int | None, ...]
    """Each layer's sliding window (None: full attention): the engine's KV cache groups follow them."""
    has_chat_template: bool
    num_cross_layers: int = 0
    """Cross-attention layers of an encoder-decoder model (0: decoder-only). `num_layers` counts
    the decoder's self-attention layers; both kinds have the same heads and head size."""
    max_encoder_len: int = 0
    """The longest encoder prompt (0: decoder-only)."""
    decoder_start_token_id: int | None = None
    """The decoder prompt's first token (encoder-decoder models)."""

    @property
    def is_encoder_decoder(self) -> bool:
        return self.num_cross_layers > 0


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    """`forward(input_ids int64 [T], positions int64 [T]) -> [T, hidden]`,
    `compute_logits([N, hidden], out=None) -> float32 [N, vocab]` (written into `out` when given). Encoder-decoder models:
    `forward(input_ids, positions, encoder_input, encoder_positions)`, both None for a step that
    runs no encoder; else encoder_positions int64 [num_encoder_tokens] and encoder_input the
    encoder's token ids int64 [num_encoder_tokens], or for an audio encoder (`audio` set) the
    list of each prefill's float features [num_mel_bins, frames]."""
    tokenizer: object
    """A transformers tokenizer."""
    spec: ModelSpec
    audio: object | None = None
    """An audio encoder's request side (`pagedattn.models.whisper.LogMelInput`: features
    checked, waveforms made into features, frames counted as encoder positions); None when the
    model takes no audio."""


def load_model(
    model: str | os.PathLike | None = None,
    *,
    tokenizer: str | os.PathLike | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    attention_backend: str = "auto",
    kv_cache_dtype: str = "auto",
    max_model_len: int | None = None,
    tp: TPGroup = SINGLE,
) -> LoadedModel:
    """Load a checkpoint onto `device` in `dtype`, its attention running on `attention_backend`.

    model: None (the embedded SmolLM2-135M-Instruct GGUF), a folder with `config.json` and
        `*.safetensors`, a `.gguf` file, or a Hugging Face Hub id (see `resolve_model_path`).
    tokenizer: where the tokenizer (and its chat template) comes from instead, the same kinds
        of source as `model` (None: the model's own).
    max_model_len: caps the spec's context (None: the model's own; larger is refused).
    dtype: a torch dtype or its name; "auto" is float32 on the CPU and otherwise the config's
        half-precision dtype (bfloat16 when the config names none or float32).
    device: a torch device; "auto" is CUDA when available, else the CPU.
    tp: this rank's tensor-parallel group: the model is this rank's shard, and a safetensors
        folder's tensors are read only as far as that shard needs.
    Raises FileNotFoundError for a missing path, UnsupportedModelError (a ValueError) naming the
    supported architectures, ValueError for pickle-only or mismatching weights,
    MissingExtraError without the `[hf]` extra.
    """
    require_hf_extra(gguf=model is None or any(str(m).endswith(".gguf") for m in (model, tokenizer) if m is not None))
    device = _resolve_device(device)
    path = resolve_model_path(model)
    folder = path if path.is_dir() else None
    if folder is not None:
        from transformers import AutoConfig

        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"expected a Hugging Face config.json in {str(path)!r}")
        config = AutoConfig.from_pretrained(path)
        architecture = _hf_architecture(config)
        language_config = getattr(get_model_cls(architecture), "language_config", None)
        if language_config is not None:  # a multimodal checkpoint whose language model we run
            config = language_config(config)
        files = _safetensors_files(path)
        weights = _safetensors_weights(files)
        extra_eos = _generation_eos(path)
    elif path.suffix == ".gguf":
        config, architecture, weights = read_gguf_cached(path)
        extra_eos = ()
    else:
        raise ValueError(
            f"expected a model folder or a .gguf file, got the file {str(path)!r}"
        )

    tokenizer = load_tokenizer(path if tokenizer is None else tokenizer)
    cls = get_model_cls(architecture)
    dtype = _resolve_dtype(dtype, config, device)
    net = build_model(architecture, config, device=device, dtype=dtype, attention_backend=attention_backend,
                      kv_cache_dtype=kv_cache_dtype, tp=tp)
    net.load_weights(weights)
    spec = capped(model_spec(architecture, config, tokenizer, dtype, extra_eos), max_model_len)
    audio_input = getattr(cls, "audio_input", None)  # audio encoders: features from the folder's preprocessor config
    audio = audio_input(config, folder) if audio_input is not None else None
    return LoadedModel(net, tokenizer, spec, audio)


def build_model(architecture: str, config, *, device: torch.device, dtype: torch.dtype, attention_backend: str,
                kv_cache_dtype: str, tp: TPGroup = SINGLE) -> nn.Module:
    """Our model of `architecture` made on `device` in `dtype` (weights uninitialised), in eval
    mode, its attention layers told their query dtype; with `tp` of several ranks, this rank's
    shard (ValueError for a family without tensor parallelism)."""
    cls = get_model_cls(architecture)
    parallel = {}
    if tp.size > 1:
        if not getattr(cls, "supports_tensor_parallel", False):
            raise ValueError(f"expected a model family with tensor parallelism (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3) for "
                             f"tensor_parallel_size={tp.size}, got {architecture}")
        parallel["tp"] = tp
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _no_random_init():
            net = cls(config, attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype, **parallel)
    finally:
        torch.set_default_dtype(default_dtype)
    net.eval().requires_grad_(False)
    for impl in attention_impls(net):  # backends that plan ahead (FlashInfer) plan from step one
        impl.set_query_dtype(dtype)
    return net


@contextlib.contextmanager
def _no_random_init():
    """nn.Linear and nn.Embedding draw random initial weights (1.5 s of SmolLM2-135M's start-up
    on a CPU), which `load_weights` overwrites and refuses to leave unloaded: skip the draw."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def capped(spec: ModelSpec, max_model_len: int | None) -> ModelSpec:
    """`spec` with its context cut to `max_model_len` (None: as it is; longer is refused)."""
    if max_model_len is None:
        return spec
    if max_model_len > spec.max_model_len:
        raise ValueError(
            f"expected max_model_len <= the model's context of {spec.max_model_len} tokens, got {max_model_len}"
        )
    return dataclasses.replace(spec, max_model_len=max_model_len)


def load_tokenizer(source: str | os.PathLike):
    """The tokenizer of a model folder, a `.gguf` file or a Hub id (see `resolve_model_path`)."""
    path = resolve_model_path(source)
    if path.suffix == ".gguf" and path.is_file():
        return _gguf_tokenizer(path)
    if not path.is_dir():
        raise ValueError(f"expected a tokenizer folder, a .gguf file or a Hub id, got the file {str(path)!r}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _gguf_tokenizer(path: Path):
    """The tokenizer of a GGUF file. transformers builds it by parsing the file's metadata again
    (seconds: the token lists), so it is built once per file and kept as `tokenizer.json` under
    `tokenizer_cache_dir()`, keyed by the file's path, size, mtime and transformers' version."""
    import hashlib

    import transformers

    stat = path.resolve().stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    folder = tokenizer_cache_dir() / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (folder / "tokenizer_config.json").is_file():
        try:
            return _kept_tokenizer(folder)
        except (OSError, ValueError):  # a damaged cache entry: build it again below
            pass
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (TypeError, ValueError, KeyError) as e:  # transformers' GGUF conversion, not our code
        raise ValueError(
            f"transformers {transformers.__version__} could not build the tokenizer of {path.name} from its "
            f"GGUF metadata ({type(e).__name__}: {str(e).splitlines()[0]}); try another transformers "
            "version, or a model folder with tokenizer.json") from e
    try:
        tokenizer.save_pretrained(folder)
    except OSError:  # a read-only cache: the next start-up parses again, nothing worse
        pass
    return tokenizer


_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""transformers' tokenizer classes that are not a model family's: a kept GGUF tokenizer is one."""


def _kept_tokenizer(folder: Path):
    """A tokenizer that `_gguf_tokenizer` saved, loaded by the class it was saved as when that is
    a generic one: AutoTokenizer would first index every model family of transformers (reading
    ~1,700 files, about a second of a start-up) to find it."""
    import transformers

    name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    cls = getattr(transformers, name, None) if name in _GENERIC_TOKENIZERS else None
    if cls is None:
        from transformers import AutoTokenizer as cls
    return cls.from_pretrained(folder)


def tokenizer_cache_dir() -> Path:
    """Where GGUF tokenizers are kept: `cache_dir() / "gguf-tokenizers"`."""
    return cache_dir() / "gguf-tokenizers"


def _resolve_device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _resolve_dtype(dtype: str | torch.dtype, config, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"expected dtype 'auto' or one of {list(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(configured, str):
        configured = _DTYPES.get(configured)
    return configured if configured in (torch.float16, torch.bfloat16) else torch.bfloat16


def _hf_architecture(config) -> str:
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise UnsupportedModelError(
        f"expected an architecture in {sorted(ARCHITECTURES)}, got {names or 'none'} "
        f"(model_type {getattr(config, 'model_type', None)!r})"
    )


def model_spec(architecture: str, config, tokenizer, dtype: torch.dtype, extra_eos=()) -> ModelSpec:
    """The spec: the geometry from the model class's `spec_fields(config)` (a dict of ModelSpec
    fields, for families whose config names differ: encoder-decoder), else as decoder-only
    configs name things."""
    eos: set[int] = set()
    for ids in (config.eos_token_id, tokenizer.eos_token_id, *extra_eos):
        if ids is not None:
            eos.update([ids] if isinstance(ids, int) else ids)
    common = dict(
        architecture=architecture,
        vocab_size=config.vocab_size,
        dtype=dtype,
        eos_token_ids=frozenset(eos),
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
    )
    spec_fields = getattr(get_model_cls(architecture), "spec_fields", None)
    if spec_fields is not None:
        return ModelSpec(**common, **spec_fields(config))
    num_heads = config.num_attention_heads
    return ModelSpec(
        **common,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_size=head_size_of(config),
        hidden_size=config.hidden_size,
        max_model_len=config.max_position_embeddings,
        sliding_windows=layer_sliding_windows(config),
    )


def _generation_eos(folder: Path) -> tuple:
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return () if eos is None else (eos,)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickles:
        raise ValueError(
            f"expected *.safetensors weights in {str(folder)!r}, found only pickle files {pickles}; "
            "pagedattn never loads pickle (it can run code): convert them to safetensors first"
        )
    raise FileNotFoundError(f"expected *.safetensors weights in {str(folder)!r}, found none")


def _safetensors_weights(files: list[Path]) -> Iterator[tuple[str, SafetensorsTensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, SafetensorsTensor(f.get_slice(name))


class SafetensorsTensor:
    """A tensor of an open safetensors file, read only as far as it is indexed: `t[...]` reads
    it all, `t[a:b]` or `t[:, a:b]` only those rows or columns (a tensor-parallel rank's shard).
    Valid while the file is open: `_safetensors_weights` keeps it open until the next file."""

    def __init__(self, part) -> None:
        self._slice = part  # safetensors' PySafeSlice

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._slice.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]
