"""pagedattn's cache folder, and the GGUF checkpoints kept there dequantised.

Reading a GGUF file costs seconds every start-up: parsing its metadata (the tokenizer's token
lists: ~100k small arrays) and dequantising every tensor in NumPy (SmolLM2-135M: ~5 s of the
~13 s to a first token on a laptop-class CPU). The first load of a GGUF therefore keeps what it
read: the transformers config (`config.json`) and the float32 weights under Hugging Face names,
llama.cpp's conversions undone (`*.safetensors` shards, written as the model consumes them, so
no second copy of the weights is held), in `cache_dir() / "gguf-weights" / <key>`; later loads
read that folder instead (memory-mapped safetensors: a fraction of a second; the config as a
`KeptConfig`, without transformers' config classes). The key is the
file's resolved path, size and modification time, transformers' version and `FORMAT`; a folder
appears whole or not at all (written under a temporary name, then renamed). A GGUF whose
float32 weights exceed `MAX_BYTES` is not kept (a 7B model would take 28 GB), nor is anything
when the cache cannot be written: the load goes on from the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import types
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FORMAT = 2
"""Bump when what is kept changes (names, conversions, the config's form): older folders are not read."""
MAX_BYTES = 4 << 30
"""The largest float32 checkpoint kept (SmolLM2-135M: 0.54 GB)."""
_SHARD_BYTES = 64 << 20  # weights held back before a shard is written


def cache_dir() -> Path:
    """pagedattn's cache folder: `$PAGEDATTN_CACHE`, else `$XDG_CACHE_HOME/pagedattn` (default
    `~/.cache/pagedattn`)."""
    root = os.environ.get("PAGEDATTN_CACHE")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedattn"
    return Path(root).expanduser()


def read_gguf_cached(path: Path) -> tuple[object, str, Iterator[tuple[str, torch.Tensor]]]:
    """`read_gguf(path)`'s (config, architecture, weights), from the cache when it holds the file."""
    from pagedattn.models.gguf_file import GGUF_MODEL_TYPES, read_gguf

    folder = _folder(path)
    if (folder / "config.json").is_file():
        from safetensors import SafetensorError, safe_open

        try:
            config = KeptConfig(**json.loads((folder / "config.json").read_text()))
            architecture = GGUF_MODEL_TYPES[config.model_type]
            shards = sorted(folder.glob("*.safetensors"))
            if not shards:
                raise OSError("no *.safetensors shards")
            for shard in shards:  # each header read (and checked against the file's size) now
                with safe_open(str(shard), framework="pt", device="cpu"):
                    pass
            return config, architecture, _read(shards)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError) as e:
            # damaged: read the file again, keep it anew
            logger.warning("ignoring the damaged GGUF cache %s (%s)", folder, e)
            shutil.rmtree(folder, ignore_errors=True)
    config, architecture, weights = read_gguf(path)
    return config, architecture, _kept(weights, config, folder)


class KeptConfig(types.SimpleNamespace):
    """A GGUF's transformers config read back from the cache: every attribute it had, defaults
    and derived ones included (what the models read), without importing its class: transformers'
    config modules import torch.distributed and sympy, about a second of a start-up."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def _folder(path: Path) -> Path:
    """`gguf-weights/<stem>-<hash of the path>-<hash of the rest of the key>`."""
    import transformers

    path = path.resolve()
    stat = path.stat()
    version = f"{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{FORMAT}"
    return cache_dir() / "gguf-weights" / f"{path.stem}-{_hash(str(path))}-{_hash(version)}"


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _read(shards: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for shard in shards:
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                yield name, f.get_tensor(name)


def _kept(
    weights: Iterator[tuple[str, torch.Tensor]], config, folder: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` as they are, written to `folder` as they pass; the folder is renamed into place
    once every weight passed (a load that stops early, or a write that fails, leaves none)."""
    writer = _ShardWriter(folder)
    try:
        for name, tensor in weights:
            writer.add(name, tensor)
            yield name, tensor
        writer.finish(config)
    finally:
        writer.discard()


class _ShardWriter:
    def __init__(self, folder: Path):
        self.folder = folder
        self.tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
        self.shard: dict[str, torch.Tensor] = {}
        self.shard_bytes = 0
        self.total_bytes = 0
        self.num_shards = 0
        self.ok = self._try(lambda: self.tmp.mkdir(parents=True, exist_ok=False))

    def _try(self, action) -> bool:
        try:
            action()
            return True
        except OSError as e:  # read-only or full: the load goes on without the cache
            logger.info("not keeping the dequantised GGUF in %s: %s", self.folder, e)
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if not self.ok:
            return
        self.total_bytes += tensor.numel() * tensor.element_size()
        if self.total_bytes > MAX_BYTES:
            logger.info("not keeping the dequantised GGUF: over %d GiB", MAX_BYTES >> 30)
            self.ok = False
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        self.shard[name] = tensor
        self.shard_bytes += tensor.numel() * tensor.element_size()
        if self.shard_bytes >= _SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        shard, self.shard, self.shard_bytes = self.shard, {}, 0
        path = self.tmp / f"weights-{self.num_shards:05d}.safetensors"
        self.num_shards += 1
        self.ok = self.ok and self._try(lambda: save_file({k: v.contiguous() for k, v in shard.items()}, str(path)))

    def finish(self, config) -> None:
        if not self.ok:
            return
        if self.shard:
            self._flush()
        # config.json last (all of it, not only what differs from the class's defaults, which
        # `KeptConfig` does not know); the folder is renamed into place whole
        kept = (self.ok and self._try(lambda: config.to_json_file(self.tmp / "config.json", use_diff=False))
                and self._try(lambda: self.tmp.rename(self.folder)))
        if kept:
            logger.info("kept the dequantised GGUF in %s", self.folder)
            self._drop_stale()

    def _drop_stale(self) -> None:
        """Remove the folders of earlier versions of the same file (same path, other key)."""
        same_path = self.folder.name.rsplit("-", 1)[0] + "-"
        for other in self.folder.parent.iterdir():
            if other.name.startswith(same_path) and other != self.folder and not other.name.endswith(".tmp"):
                shutil.rmtree(other, ignore_errors=True)

    def discard(self) -> None:
        """Remove what a load that did not finish wrote."""
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)
