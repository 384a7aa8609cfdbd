"""`sequence_parallel_size` before launch (pure, no torch): validate's check of the world, the
head counts and the length, and the memory estimate that tells which SP a stage's length needs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from longspec.project.checks.seqpar import largest_sp, sp_problems
from longspec.machine import memory as M
from tests.cli.test_validate import edit, find, make_project, run_json, stage

# Qwen2.5-7B: 28 query / 4 key-value heads; QwQ-32B: 40 / 8; Llama-3.1-8B: 32 / 8.
QWEN7B = M.ModelSize(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064)
QWQ = M.ModelSize(hidden=5120, layers=64, heads=40, kv_heads=8, intermediate=27648, vocab=152064)


def test_head_rule_names_the_largest_sp_that_works():
    assert largest_sp(40, 8, world=8) == 8
    assert largest_sp(28, 4, world=8) == 4                 # 28 heads: 8 does not divide them
    assert largest_sp(32, 2, world=8) == 8                 # 2 key-value heads, each replicated 4x
    assert sp_problems(8, 8, 32, 2, 131072) == []
    (line,) = sp_problems(8, 8, 28, 4, 131072)
    assert "28 query / 4 key-value heads" in line and "largest SP that works is 4" in line
    assert sp_problems(2, 8, 32, 3, 1024)[0].startswith("sequence_parallel_size = 2 does not fit")
    lines = sp_problems(3, 8, 30, 3, 32768)
    assert any("does not divide the 8 ranks" in x for x in lines)
    assert any("max_seq_length = 32768 is not divisible by sequence_parallel_size = 3" in x for x in lines)
    assert sp_problems(1, 7, 3, 1, 5) == []                # SP 1: nothing to check


def test_validate_reports_every_sp_problem_at_the_key(tmp_path):
    proj = make_project(tmp_path)
    (proj / "target" / "config.json").write_text(json.dumps(
        {"max_position_embeddings": 32768, "num_attention_heads": 28, "num_key_value_heads": 4}))
    edit(stage(proj, "long"), "cross_attn_lag: 4", "cross_attn_lag: 4\nsequence_parallel_size: 3")
    code, rep = run_json(str(proj), "--world-size", "8")
    assert code == 1
    errors = [p for p in rep["problems"] if p["key"] == "sequence_parallel_size"]
    assert len(errors) == 3 and all(p["file"] == str(stage(proj, "long")) and p["line"] for p in errors)
    assert find(rep, "largest SP that works is 4", "error")
    # SP 4 fits 28 / 4 heads, 8 ranks and 32768 tokens; the global batch counts data-parallel ranks.
    edit(stage(proj, "long"), "sequence_parallel_size: 3", "sequence_parallel_size: 4")
    _, rep = run_json(str(proj), "--world-size", "8")
    assert not [p for p in rep["problems"] if p["key"] == "sequence_parallel_size"]
    assert find(rep, "x 2 data-parallel (8 GPUs (--world-size) / SP 4)")


def test_memory_divides_the_sequence_part_by_sp_and_names_the_sp_a_length_needs():
    shape = M.StageShape(size=QWQ, precision="bf16", zero_stage=3, offload_optimizer=True, seq_len=131072,
                         micro_batch=1, world_size=8, flash=True)
    one, eight = M.estimate(shape), M.estimate(replace(shape, sequence_parallel=8))
    persistent = lambda e: sum(b for _, b in e.persistent)  # noqa: E731
    assert persistent(one) == persistent(eight)             # ZeRO still partitions over all 8
    for what in ("draft activations", "target K/V + final hidden"):   # per-token parts: 1/8
        assert dict(one.phase_b)[what] == pytest_approx(8 * dict(eight.phase_b)[what])
    assert one.peak - persistent(one) > 6 * (eight.peak - persistent(eight))
    # Without flash-attn the reference path holds one budget-bounded chunk at any length or SP,
    # so SP divides the rest there too.
    sdpa1, sdpa8 = (M.estimate(replace(shape, flash=False, sequence_parallel=sp)) for sp in (1, 8))
    ref_chunk = lambda e: dict(dict(e.phase_b_max)["draft backward"])["SDPA reference chunk"]  # noqa: E731
    bound = 3 * M.SCORE_BUDGET["cuda"] / 2        # scores (mask + weights) <= the budget, 1 + 2 bytes each
    for est in (sdpa1, sdpa8, M.estimate(replace(shape, flash=False, seq_len=8192))):
        assert 0.7 * bound <= ref_chunk(est) <= bound
    assert ref_chunk(sdpa8) == pytest_approx_rel(ref_chunk(sdpa1), 0.05)
    assert sdpa8.peak < sdpa1.peak < 1.5 * one.peak
    assert "sequence parallel 8 (16384 tokens per GPU)" in eight.lines()[0]
    warning = M.fit_warning(one, 80 * M.GiB, "--gpu-mem 80")
    assert warning is not None and "sequence_parallel_size=" in warning
    need = M.sequence_parallel_needed(one, 80 * M.GiB)
    assert need in (2, 4, 8) and M.estimate(replace(shape, sequence_parallel=need)).peak <= 0.95 * 80 * M.GiB
    # Qwen2.5-7B's 28 heads allow SP 1, 2, 4 only: the tip never names 8.
    q7 = replace(shape, size=QWEN7B, seq_len=524288)
    assert M.sequence_parallel_needed(M.estimate(q7), 80 * M.GiB) in (None, 2, 4)


def pytest_approx_rel(x, rel):
    import pytest

    return pytest.approx(x, rel=rel)


def pytest_approx(x):
    import pytest

    return pytest.approx(x, rel=1e-9)


def _errors(proj, *args) -> list[tuple[str, str]]:
    _, rep = run_json(str(proj), *args)
    return sorted((Path(p["file"]).name, p["key"]) for p in rep["problems"] if p["severity"] == "error")


def test_the_128k_preset_composes_and_validates_like_its_32k_sibling(tmp_path):
    from typer.testing import CliRunner

    from longspec_cli.app import app
    from longspec.project.hydracompose import compose_stage

    runner = CliRunner()
    for name in ("llama3.1-8b-instruct", "llama3.1-8b-instruct-128k"):
        res = runner.invoke(app, ["init", str(tmp_path / name), "--no-input", "--preset", name])
        assert res.exit_code == 0, res.output
    plain, long = tmp_path / "llama3.1-8b-instruct", tmp_path / "llama3.1-8b-instruct-128k"
    # The same problems as the 32k project (the hub target and the data are not on disk), none for SP.
    assert _errors(long) == _errors(plain)
    for stage_name in ("long", "longcot"):
        data = compose_stage(long / "conf" / "exp" / f"{stage_name}.yaml").data     # Hydra's own compose
        assert data["sequence_parallel_size"] == 8 and data["data"]["max_seq_length"] == 131072
        assert data["global_batch_size"] == 64 and data["gradient_accumulation_steps"] == 64
    assert compose_stage(long / "conf" / "exp" / "base.yaml").data["sequence_parallel_size"] == 1
    # On 4 GPUs SP 8 cannot run: validate says so from the preset's head counts.
    assert ("long.yaml", "sequence_parallel_size") in _errors(long, "--world-size", "4")
