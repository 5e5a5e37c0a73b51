"""A torchrun launch (2 CPU processes, gloo; torchrun's variables give the rendezvous and rank 0
starts no worker): `pagedattn generate --tensor-parallel-size 2` under it answers what one
process answers, once (the other rank serves inside the engine and exits with 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pagedattn
from pagedattn.parallel.group import Rendezvous


def _generate(folder: str, *launcher: str, size: int) -> subprocess.CompletedProcess:
    command = [*launcher, "-m", "pagedattn", "generate", "--model", folder, "--device", "cpu", "--max-tokens", "8",
               "--no-chat-template", "--json", "--num-kv-blocks", "64", "--tensor-parallel-size", str(size)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(command + ["hello world"], capture_output=True, text=True, timeout=300, env=env)


def test_torchrun_ranks_join_and_answer_once(tiny_kv):
    folder = tiny_kv(2).folder
    port = Rendezvous.local(2).port
    launched = _generate(folder, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                         "--master-port", str(port), "--no-python", sys.executable, size=2)
    assert launched.returncode == 0, launched.stderr[-2000:]
    answers = [json.loads(line) for line in launched.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == 1
    alone = pagedattn.LLM(folder, device="cpu", num_kv_blocks=64)
    ids = alone.generate(answers[0]["prompt"], pagedattn.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert answers[0]["outputs"][0]["token_ids"] == ids[0].outputs[0].token_ids
