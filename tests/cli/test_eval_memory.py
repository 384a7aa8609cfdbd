"""`eval` past 32k: the default length buckets follow max_seq_length up to 128k, and a bucket the
device cannot hold (the target's KV cache at that length, the weights, one layer's prefill) is
refused with the figures before anything heavy loads (longspec.machine.evalmemory), by
`longspec eval` before it starts longspec.evaluate."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from longspec_cli.app import app
from longspec.machine import evalmemory as EM
from longspec.machine.memory import GiB, ModelSize

from .conftest import finish_stage, no_traceback, panel_text

runner = CliRunner()
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "head_dim": 128}


def test_default_buckets_follow_max_seq_length_to_128k():
    assert EM.default_lengths(131072) == [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    assert EM.parse_lengths("1k, 128k,4096") == [1024, 4096, 131072]


def test_the_128k_bucket_needs_the_kv_cache_and_is_refused_where_it_cannot_fit():
    size = ModelSize.from_mapping(LLAMA_8B)
    n = EM.need(size, 131072 + 1024, 2, cuda=True)
    # KV cache: tokens x (32 target layers + 1 draft layer) x 8 KV heads x 128 x 2 (K, V) x 2 bytes
    assert n.kv == 132096 * 33 * 8 * 128 * 2 * 2 and round(n.kv / GiB, 1) == 16.6
    assert 15 * GiB < n.weights < 16 * GiB and round(n.total / GiB, 1) == 46.7
    buckets = EM.default_lengths(131072)
    assert EM.refusal(size, buckets, 1024, 2, 80 * GiB, "an 80 GiB GPU", True) is None
    message, hint = EM.refusal(size, buckets, 1024, 2, 24 * GiB, "a 24 GiB GPU", True)
    assert message.startswith("the 128k length bucket needs about 46.7 GiB on a 24 GiB GPU and 24.0 GiB is available")
    assert "KV cache 16.6 GiB (132,096 tokens x 33 layers x 8 KV heads x 128 x 2 x 2 bytes)" in message
    assert hint == "--lengths 1k,2k,4k,8k,16k leaves out the buckets that do not fit"
    _, hint = EM.refusal(size, buckets, 1024, 4, 8 * GiB, "the CPU", False)         # fp32: not even 1k
    assert hint.startswith("not even the shortest bucket fits")


def test_longspec_eval_refuses_a_128k_bucket_before_starting_the_evaluation(project, drafts, monkeypatch):
    (project.target / "config.json").write_text(json.dumps(LLAMA_8B))
    finish_stage(project, "base", drafts["0"])
    out = project.out("base")
    (out / "training_config.yaml").write_text(
        f"model_name_or_path: {project.target}\nprecision: bf16\ndata:\n  max_seq_length: 131072\n")
    monkeypatch.setattr(EM, "cpu_available", lambda: 64 * GiB)
    started = []
    monkeypatch.setattr("longspec_cli.launch.trainer.run_trainer_json", lambda *a, **k: started.append(a) or {})
    res = runner.invoke(app, ["eval", str(project.root), "base", "--device", "cpu"])
    assert res.exit_code == 1 and not started
    no_traceback(res)
    text = panel_text(res.output)
    assert "stage base: the 128k length bucket needs about" in text and "64.0 GiB is available" in text
    assert "CPU memory" in text and "--lengths 1k,2k,4k,8k,16k,32k leaves out" in text
    # the buckets that fit: the evaluation starts
    res = runner.invoke(app, ["eval", str(project.root), "base", "--device", "cpu", "--lengths", "1k,32k"])
    assert len(started) == 1, res.output
