"""Each engine flag of `generate`/`chat` changes what runs: --tokenizer, --chat-template,
--max-num-batched-tokens/--max-num-seqs (see also test_streaming), and on CUDA
--gpu-memory-utilization and --enforce-eager."""

from __future__ import annotations

import io
import json

import pytest
import torch
from tiny_models import VOCAB

import pagedattn.cli.chat as chat
from pagedattn.cli import main
from pagedattn.cli.model_args import add_chat_template_argument, add_model_arguments, chat_template, engine_config


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def _prompt_tokens(capsys) -> list[int]:
    return [json.loads(line)["prompt_tokens"] for line in capsys.readouterr().out.splitlines()]


@pytest.fixture(scope="module")
def merging_tokenizer(tmp_path_factory) -> str:
    """A folder with another tokenizer for the tiny model: the byte tokenizer plus the merge
    "he" (id 258), and a chat template that sends the last message alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)} | {"<s>": 256, "</s>": 257, "he": 258}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = "{{ messages[-1]['content'] }}"
    folder = tmp_path_factory.mktemp("merging_tokenizer")
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_tokenizer_flag(tiny_chat, merging_tokenizer, capsys):
    base = ["generate", "hello", "--model", tiny_chat, "--max-tokens", "2", "--json"]
    assert main([*base, "--no-chat-template"]) == 0
    assert main([*base, "--no-chat-template", "--tokenizer", merging_tokenizer]) == 0
    assert _prompt_tokens(capsys) == [5, 4]  # h e l l o, then "he" l l o
    assert main(base) == 0  # the model's template: "[user] hello\nA:"
    assert main([*base, "--tokenizer", merging_tokenizer]) == 0  # the other tokenizer's template
    assert _prompt_tokens(capsys) == [len("[user] hello\nA:"), 4]


def test_chat_template_flag_inline_and_from_a_file(tiny_chat, tmp_path, capsys):
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    base = ["generate", "hello", "--model", tiny_chat, "--max-tokens", "2", "--json"]
    assert main(base) == 0
    assert main([*base, "--chat-template", template]) == 0
    assert main([*base, "--chat-template", str(path), "--system", "sys"]) == 0
    assert _prompt_tokens(capsys) == [len("[user] hello\nA:"), len("<hello>"), len("<sys><hello>")]


def test_chat_template_flag_lets_chat_run_a_model_without_one(tiny_without_template, monkeypatch, capsys):
    folder = tiny_without_template
    seen = []
    real = chat.chat_prompt
    monkeypatch.setattr(chat, "chat_prompt", lambda tok, messages, template=None: seen.append(template) or
                        real(tok, messages, template))
    monkeypatch.setattr("sys.stdin", _Pipe("hi\n"))
    assert main(["chat", "--model", str(folder), "--max-tokens", "2",
                 "--chat-template", "{{ messages[-1]['content'] }}"]) == 0
    assert seen == ["{{ messages[-1]['content'] }}"]


def _args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_model_arguments(parser, max_num_seqs=256)
    add_chat_template_argument(parser)
    return parser.parse_args(list(argv))


def test_shared_flags_reach_the_engine_config():
    """What a command building its engine from `engine_config` (as `serve` does) gets."""
    config = engine_config(_args("--max-num-batched-tokens", "512", "--max-num-seqs", "8", "--enforce-eager",
                                 "--tokenizer", "org/tok", "--gpu-memory-utilization", "0.5", "--device", "cpu"))
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.enforce_eager, config.tokenizer,
            config.gpu_memory_utilization) == (512, 8, True, "org/tok", 0.5)
    defaults = engine_config(_args())
    assert (defaults.max_num_batched_tokens, defaults.enforce_eager, defaults.gpu_memory_utilization,
            defaults.tokenizer, defaults.cascade_attention) == (None, False, 0.9, None, None)
    assert engine_config(_args("--no-cascade-attention")).cascade_attention is False
    assert chat_template(_args()) is None
    assert chat_template(_args("--chat-template", "{{ x }}")) == "{{ x }}"


def test_load_llm_hands_every_flag_to_the_engine(monkeypatch):
    import pagedattn.llm as llm_module
    from pagedattn.cli.model_args import load_llm

    seen = []
    monkeypatch.setattr(llm_module, "LLMEngine", lambda config: seen.append(config))
    config = engine_config(_args(
        "--model", "org/model", "--tokenizer", "org/tok", "--device", "cpu", "--dtype", "bfloat16",
        "--kv-cache-dtype", "fp8", "--max-model-len", "64", "--num-kv-blocks", "9", "--block-size", "8",
        "--max-num-batched-tokens", "300", "--max-num-seqs", "3", "--gpu-memory-utilization", "0.4", "--enforce-eager",
        "--no-cascade-attention",
    ))
    load_llm(config)
    assert seen == [config]


def test_gpu_memory_utilization_on_the_cpu_says_it_does_nothing(capsys):
    engine_config(_args("--gpu-memory-utilization", "0.5", "--device", "cpu"))
    assert "--gpu-memory-utilization has no effect on the CPU" in capsys.readouterr().err
    engine_config(_args("--device", "cpu"))
    assert capsys.readouterr().err == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_and_graph_flags(tiny_chat, monkeypatch):
    from pagedattn.cli.model_args import load_llm

    kept = []

    def runner_of(*argv):
        llm = load_llm(engine_config(_args("--model", tiny_chat, "--device", "cuda", "--max-num-seqs", "8", *argv)))
        kept.append((llm.engine.runner.num_blocks, llm.engine.runner.graphs))
        del llm
        torch.cuda.empty_cache()
        return kept[-1]

    blocks_low, graphs = runner_of("--gpu-memory-utilization", "0.3")
    assert graphs is not None
    blocks_high, _ = runner_of("--gpu-memory-utilization", "0.6")
    assert blocks_high > blocks_low * 1.5
    _, eager_graphs = runner_of("--gpu-memory-utilization", "0.3", "--enforce-eager")
    assert eager_graphs is None
