"""`pagedattn bench engine` on a tiny shape: the files come out with their fields (not timed),
and the dummy model is what both sides run."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from pagedattn.benchmarks import engine, engine_offline, engine_report
from pagedattn.models.dummy import SHAPES, load_dummy_model, transformers_model


def test_tiny_run_writes_json_csv_and_plot(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["--model-shape", "tiny-llama", "--device", "cpu", "--quick", "--reps", "2", "--batches", "2",
            "--online-requests", "3", "--request-rate", "50", "--out", str(out)]
    assert engine.main(argv, "pagedattn bench engine") == 0

    result = json.loads((out / "engine_bench.json").read_text())
    assert {"environment", "settings", "sharegpt", "copy_bandwidth_gb_s", "shapes", "offline", "targets"} <= set(result)
    assert {"torch", "transformers", "device", "cpu", "load_average_before"} <= set(result["environment"])
    shape = result["shapes"]["tiny-llama"]
    decode = shape["decode_step"]
    assert decode["batch"] == 64 and decode["steps_timed"] > 0 and decode["floor_s"] > 0
    impls = {r["impl"]: r for r in result["offline"]}
    assert set(impls) == {"pagedattn", "transformers"}, shape["skipped"]
    ours = impls["pagedattn"]
    assert ours["workload"] == "128/128" and ours["batch"] == 2 and ours["reps"] == 2
    assert ours["generated_tokens"] == 2 * 128 and ours["tokens_per_s"] > 0 and ours["spread"] >= 0
    assert ours["speedup"] == pytest.approx(ours["tokens_per_s"] / impls["transformers"]["tokens_per_s"])
    assert impls["transformers"]["generated_tokens"] == 2 * 128
    assert any("transformers generate_batch" in t["target"] for t in result["targets"])

    with (out / "engine_offline.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["impl"] for r in rows] == ["pagedattn", "transformers"]
    assert set(rows[0]) == set(engine_report.OFFLINE_FIELDS)
    with (out / "engine_online.csv").open() as f:
        online = list(csv.DictReader(f))
    if "online" in shape:  # the server's extra is installed
        assert online[0]["completed"] == "3" and float(online[0]["ttft_p50_ms"]) > 0
        assert set(online[0]) == set(engine_report.ONLINE_FIELDS)
    else:
        assert any("pip install" in why for why in shape["skipped"])
    assert (out / "engine_throughput.png").stat().st_size > 0
    assert "targets:" in capsys.readouterr().out


def test_tensor_parallel_run_reports_the_floor_per_gpu_and_the_all_reduce(tmp_path, capsys):
    """At 2 ranks (CPU, gloo): the floor counts one rank's weights and KV heads, the step's
    all-reduces are timed, transformers (one device's) is not run."""
    out = tmp_path / "bench"
    argv = ["--model-shape", "tiny-llama", "--device", "cpu", "--quick", "--reps", "1", "--batches", "2",
            "--no-online", "--tensor-parallel-size", "2", "--out", str(out)]
    assert engine.main(argv, "pagedattn bench engine") == 0
    shape = json.loads((out / "engine_bench.json").read_text())["shapes"]["tiny-llama"]
    assert shape["tensor_parallel_size"] == 2 and shape["num_layers"] == SHAPES["tiny-llama"]["num_hidden_layers"]
    whole = engine_offline.weight_bytes_read(load_dummy_model("tiny-llama").model)
    assert whole / 2 < shape["weight_bytes_read"] < whole  # half of every split matrix, the norms whole
    decode = shape["decode_step"]
    assert decode["all_reduce_s"] > 0 and decode["all_reduce"] == "gloo"  # which all-reduce ran
    assert decode["all_reduces_per_step"] == 2 * SHAPES["tiny-llama"]["num_hidden_layers"]
    assert decode["kv_bytes"] == decode["median_context_tokens"] * 2 * 2 * 1 * 16 * 4  # 2 layers, 1 KV head a rank
    assert any("not compared at --tensor-parallel-size 2" in why for why in shape["skipped"])
    assert "floor per GPU" in capsys.readouterr().out


def test_bad_flags_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        engine.main(["--model-shape", "gpt5", "--device", "cpu"], "pagedattn bench engine")
    assert exc.value.code == 2
    assert "expected --model-shape in" in capsys.readouterr().err


def test_dummy_model_shares_weights_with_transformers():
    loaded = load_dummy_model("tiny-llama", seed=3)
    peer = transformers_model(loaded)
    ours = {p.data_ptr() for p in loaded.model.parameters()}
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj.weight
    k_rows = qkv[SHAPES["tiny-llama"]["hidden_size"]:]  # q has hidden_size rows, then k
    assert peer.model.layers[0].self_attn.k_proj.weight.data_ptr() == k_rows.data_ptr()
    assert peer.lm_head.weight.data_ptr() in ours
    ids = torch.arange(5, 25)[None]
    with torch.no_grad():
        logits = peer(ids).logits[0]
    assert logits.isfinite().all() and logits.std() > 0.1
    again = load_dummy_model("tiny-llama", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.parameters(), again.model.parameters()))


def test_sharegpt_lengths_are_seeded_and_fit_the_context():
    a = engine_offline.request_lengths("sharegpt", 200, max_model_len=1024, seed=7)
    assert a == engine_offline.request_lengths("sharegpt", 200, max_model_len=1024, seed=7)
    assert all(4 <= o <= 1024 and 1 <= i and i + o <= 1024 for i, o in a)
    assert len({i for i, _ in a}) > 50  # a spread, not one length
    reqs = engine_offline.make_requests(a[:3], vocab_size=100, seed=0, rep=0)
    assert [len(r.prompt) for r in reqs] == [i for i, _ in a[:3]]
    assert reqs != engine_offline.make_requests(a[:3], vocab_size=100, seed=0, rep=1)


def test_hf_attention_rows(tmp_path, capsys):
    """--hf-attention: transformers' generate_batch on our attention and on its own, same weights;
    our row is skipped, with the reason, where transformers runs no registered attention there."""
    from pagedattn.integrations.transformers import generate_batch_unavailable_reason

    out = tmp_path / "bench"
    argv = ["--model-shape", "tiny-llama", "--device", "cpu", "--quick", "--reps", "1", "--batches", "2",
            "--hf-attention", "--out", str(out)]
    assert engine.main(argv, "pagedattn bench engine") == 0
    result = json.loads((out / "engine_bench.json").read_text())
    rows = {r["backend"]: r for r in result["offline"]}
    assert {r["impl"] for r in rows.values()} == {"transformers"}
    assert {"sdpa", "paged|eager"} <= set(rows)
    assert all(r["generated_tokens"] == 2 * 128 and r["tokens_per_s"] > 0 for r in rows.values())
    why = generate_batch_unavailable_reason()
    if why:
        assert "pagedattn_torch" not in rows
        assert any(why in s for s in result["shapes"]["tiny-llama"]["skipped"])
    else:
        ours = rows["pagedattn_torch"]
        assert ours["speedup"] == pytest.approx(ours["tokens_per_s"] / rows["sdpa"]["tokens_per_s"])
    assert "paged|eager" in capsys.readouterr().out
