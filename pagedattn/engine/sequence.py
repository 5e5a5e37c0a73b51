"""A sequence (one completion's tokens and KV blocks) and a request's group of sequences."""

from __future__ import annotations

import copy
import enum
import hashlib
import time
from dataclasses import dataclass, field

import torch

from pagedattn.engine.outputs import RequestMetrics
from pagedattn.engine.sampling_params import SamplingParams

class SeqStatus(enum.Enum):
    WAITING = "waiting"  # needs (re)computing from some token on; holds GPU blocks only once admitted
    RUNNING = "running"  # holds GPU blocks
    SWAPPED = "swapped"  # holds CPU blocks
    FINISHED = "finished"  # holds nothing


_FINISHED = SeqStatus.FINISHED  # read per sequence per step: a global, not an enum lookup


class EncoderFeatures:
    """An audio encoder's input for one request (Whisper's log-mel features), never changed.

    values: float32 [num_mel_bins, frames] on the CPU, owned by the request.
    num_positions: the encoder positions the model makes of them (the model's rule, asked by
        the input processor): the request's encoder length.
    key: a digest of the values' shape and bytes, the prefix cache's encoder key (equal
        features may share decoder blocks; different ones never do).
    """

    def __init__(self, values: torch.Tensor, num_positions: int):
        self.values = values
        self.num_positions = num_positions
        digest = hashlib.sha256(repr(tuple(values.shape)).encode())
        digest.update(values.numpy().tobytes())
        self.key = int.from_bytes(digest.digest()[:8], "little")


class Sequence:
    """Token ids (prompt then output) and the KV-cache bookkeeping of one completion.

    `num_computed_tokens`: leading tokens whose K/V are in the cache (the vocabulary's
    context_len of the next step). Tokens past it are computed by the next steps; a running
    sequence has at least one (the last sampled token).

    Encoder-decoder models: `token_ids` are the decoder's; the encoder prompt, never changed,
    is `encoder_token_ids` (a text encoder's) or `encoder_features` (an audio encoder's). It
    runs through the encoder on the sequence's prefill step, which writes its cross-attention
    K/V into the blocks of `cross_block_table` (the cross pool's). Those blocks hold the
    request's encoder output: forks share them, as they share decoder blocks.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        block_size: int,
        encoder_token_ids: tuple[int, ...] = (),
        encoder_features: EncoderFeatures | None = None,
    ):
        self.seq_id = seq_id
        self.block_size = block_size
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # One block table per KV cache group (the block manager's), all of one length; none
        # while the sequence holds no blocks.
        self.block_tables: list[list[int]] = []
        self.encoder_token_ids = tuple(encoder_token_ids)
        self.encoder_features = encoder_features
        self.cross_block_table: list[int] = []
        self.status = SeqStatus.WAITING
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or string that finished it
        self.output_logprobs: list[dict] | None = None  # per output token, when its request asks
        self.reads_prefix_cache = True  # False: every prompt position is computed (prompt logprobs)
        self.generator: torch.Generator | None = None
        self.detokenizer = None  # engine.detokenizer.IncrementalDetokenizer, when a tokenizer exists
        # A guided request's xgrammar GrammarMatcher over this completion's output tokens (engine.grammar)
        self.grammar = None
        # Prefix caching: how many leading blocks were offered to the hash table, and the hash
        # chain of full blocks of `token_ids` (content only, independent of physical blocks).
        self.num_registered_blocks = 0
        self._block_hashes: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, len={len(self)}, computed={self.num_computed_tokens}, "
            f"status={self.status.value}, blocks={self.block_tables})"
        )

    @property
    def block_table(self) -> list[int]:
        """The first KV cache group's block table (the only one when every layer attends alike)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def encoder_len(self) -> int:
        """Encoder tokens, the encoder positions of its features for an audio encoder (0 for a
        decoder-only model's sequence)."""
        if self.encoder_features is not None:
            return self.encoder_features.num_positions
        return len(self.encoder_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    def append_token(self, token_id: int, logprob: float, logprobs: dict | None = None) -> None:
        """Append a generated token, its log-probability and (when asked) its {token id: Logprob}."""
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if self.output_logprobs is not None:
            self.output_logprobs.append(logprobs)

    def block_hash(self, i: int) -> int:
        """Chained hash of full block `i`: hash((hash of block i-1, its token ids)). Block 0's
        parent is None, or the key of the encoder prompt (its token ids' hash, its features'
        digest): a decoder's K/V depend on the encoder output through cross-attention, so equal
        decoder tokens over different encoder prompts must not share blocks."""
        bs = self.block_size
        if (i + 1) * bs > len(self.token_ids):
            raise ValueError(f"block {i} is not full: sequence has {len(self.token_ids)} tokens of block size {bs}")
        while len(self._block_hashes) <= i:
            j = len(self._block_hashes)
            if j:
                parent = self._block_hashes[j - 1]
            elif self.encoder_features is not None:
                parent = self.encoder_features.key
            else:
                parent = hash(self.encoder_token_ids) if self.encoder_token_ids else None
            self._block_hashes.append(hash((parent, tuple(self.token_ids[j * bs : (j + 1) * bs]))))
        return self._block_hashes[i]

    def block_tokens(self, i: int) -> tuple[int, ...]:
        return tuple(self.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def fork(self, seq_id: int) -> Sequence:
        """A copy sharing nothing mutable; the block manager shares the blocks (`BlockManager.fork`)."""
        child = copy.copy(self)
        child.seq_id = seq_id
        child.token_ids = list(self.token_ids)
        child.block_tables = []
        child.cross_block_table = []
        child._block_hashes = list(self._block_hashes)
        child.generator = None
        child.output_logprobs = list(self.output_logprobs) if self.output_logprobs is not None else None
        child.detokenizer = self.detokenizer.fork() if self.detokenizer is not None else None
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        return child

    def reset_for_recompute(self) -> None:
        """Forget the cache: every token (prompt and outputs so far) is computed again. The
        tokens stay, and so does the grammar matcher's state over them."""
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0
        self.block_tables = []
        self.cross_block_table = []
        self.status = SeqStatus.WAITING


@dataclass
class BeamHypothesis:
    score: float  # cumulative logprob / generated tokens ** length_penalty
    token_ids: list[int]  # output tokens only
    cumulative_logprob: float
    finish_reason: str


@dataclass(eq=False)
class SequenceGroup:
    """One request: its prompt, options, and sequences (one until the first sample forks
    `best_of` samples or beams)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_index: int
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None  # None: a decoder-only request, or an audio encoder's
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))
    generators: list[torch.Generator | None] = field(default_factory=list)  # per completion, seeded requests
    forked: bool = False
    beam_hypotheses: list[BeamHypothesis] = field(default_factory=list)
    beam_done: bool = False
    error: str | None = None
    prompt_logprobs: list[dict | None] | None = field(init=False, default=None)
    """The prompt's {token id: Logprob} per token as computed so far (None first: nothing
    predicts it), when `params.prompt_logprobs` is set."""

    def __post_init__(self) -> None:
        # asked per sequence per step (`needs_fork`); a request's params do not change
        self._branches = self.params.width > 1 or self.params.use_beam_search
        # What the params ask to record; such requests compute every prompt position (as vLLM).
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
            for seq in self.seqs:
                seq.reads_prefix_cache = False
        if self.params.logprobs is not None:
            for seq in self.seqs:
                seq.output_logprobs = []

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status is not _FINISHED]

    @property
    def is_beam(self) -> bool:
        return self.params.use_beam_search

    @property
    def is_finished(self) -> bool:
        if self.error is not None or self.beam_done:
            return True
        for s in self.seqs:  # the engine asks every step of every group: no list
            if s.status is not _FINISHED:
                return False
        return True

    @property
    def needs_fork(self) -> bool:
        """Whether the next sample of the prompt should branch into `width` sequences."""
        return self._branches and not self.forked
