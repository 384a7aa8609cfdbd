"""The trained draft served in vLLM (CPU backend) through longspec's plugin (longspec/serve/).

One tiny target of head dim 32 (the smallest vLLM's CPU attention takes; `python -m longspec.tiny
build --head-dim 32`), one base stage trained by `longspec run`, exported with `longspec export
--format vllm`, measured by `python -m longspec.evaluate` and decoded by vLLM in one process
(tests/serve/vllm_driver.py: three engines, plain / GLIDE / GLIDE with draft_model's own metadata for
the cross-attention) on the same 8 prompts, all in one batch, prefilled in chunks of 64 tokens.

The vLLM environment is the repository's .venv-vllm (`make vllm`) or $LONGSPEC_VLLM_PYTHON; without
one these tests skip, and fail under LONGSPEC_REQUIRE_VLLM=1 (CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIRE = os.environ.get("LONGSPEC_REQUIRE_VLLM", "") not in ("", "0")
GAMMA = 4
NEW_TOKENS = 32
CUTS = (40, 120, 250, 400, 60, 180, 300, 90)     # prompt lengths (tokens); > 64: prefilled in chunks
# vLLM's acceptance against eval's chain tau. Both decode the same greedy chain in fp32, so each
# round accepts the same drafts unless a draft's argmax flips between vLLM's CPU kernels and torch's
# SDPA (another summation order). One flip moves one round by at least one token: 1/160 of tau on
# these 8 x 32 tokens (about 160 rounds); 0.02 allows three.
TAU_TOL = 0.02

# The first test also pays for the module's fixture (a tiny target, a trained stage, eval, three
# engines): 13 minutes on a busy 2-core machine, over the suite's default limit of 15.
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(2400)]


def vllm_python() -> Path:
    py = Path(os.environ.get("LONGSPEC_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
    if not py.exists():
        why = f"no vLLM environment at {py} (make vllm builds it)"
        if REQUIRE:
            pytest.fail(f"LONGSPEC_REQUIRE_VLLM=1 but {why}", pytrace=False)
        pytest.skip(why)
    return py


def sh(*argv, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env, **kw)
    assert res.returncode == 0, f"{argv[:4]} exited {res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return res


def last_json(res: subprocess.CompletedProcess):
    """The JSON object a command prints last (DeepSpeed's accelerator notice or progress may come first)."""
    lines = res.stdout.splitlines()
    start = max(i for i, ln in enumerate(lines) if ln.startswith("{"))
    return json.loads("\n".join(lines[start:]))


def cli(*argv) -> subprocess.CompletedProcess:
    return sh(sys.executable, "-m", "longspec_cli", *argv)


def prompts_from(data: Path, tokenizer_dir: Path, out: Path) -> list[list[int]]:
    """Document prefixes of the long stage's records, as eval reads a --prompts file (whole strings)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    docs = [r["text"] for r in map(json.loads, data.read_text().splitlines()) if "text" in r][-len(CUTS):]
    texts = [tok.decode(tok(d)["input_ids"][:n]) for d, n in zip(docs, CUTS)]
    out.write_text("".join(json.dumps(t) + "\n" for t in texts))
    return [tok(t)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    py = vllm_python()
    tmp = tmp_path_factory.mktemp("serve")
    built = last_json(sh(sys.executable, "-m", "longspec.tiny", "build", tmp / "tiny", "--head-dim", "32",
                         "--json", "--quiet"))
    proj = tmp / "proj"
    cli("init", proj, "--preset", "tiny", "--target", built["target"], "--stages", "base",
        "--data", f"base={built['data']['base']}", "--no-input")
    cli("run", proj, "base", "max_steps=120")
    status = last_json(cli("status", proj, "--json"))
    run_dir = Path(next(s for s in status["stages"] if s["name"] == "base")["output_dir"])
    exported = last_json(cli("export", proj, "--stage", "base", "--format", "vllm", "--json"))
    ids = prompts_from(Path(built["data"]["long"]), Path(built["target"]), tmp / "prompts.jsonl")
    ev = last_json(sh(sys.executable, "-m", "longspec.evaluate", run_dir, "--prompts", tmp / "prompts.jsonl",
                      "--gamma", GAMMA, "--max-new-tokens", NEW_TOKENS, "--no-eos", "--lengths", "512",
                      "--json", "--no-write"))
    spec = {"target": built["target"], "draft": exported["out"], "prompts": ids, "max_tokens": NEW_TOKENS,
            "gamma": GAMMA, "runs": ["plain", "glide", "stock"], "trace_dir": str(tmp)}
    (tmp / "spec.json").write_text(json.dumps(spec))
    sh(py, ROOT / "tests" / "serve" / "vllm_driver.py", tmp / "spec.json", tmp / "out.json", timeout=900)
    out = json.loads((tmp / "out.json").read_text())
    traces = {k: [json.loads(ln) for ln in (tmp / f"{k}.jsonl").read_text().splitlines()] for k in ("glide", "stock")}
    return {"proj": proj, "py": py, "eval": ev, "ids": ids, "exported": exported, "traces": traces, **out}


def tau(run: dict) -> float:
    """vLLM's mean tokens per draft round, the bonus token counted (as eval's tau)."""
    c = run["counters"]
    return (c["num_accepted_tokens"] + c["num_drafts"]) / c["num_drafts"]


def test_greedy_output_with_the_draft_is_vllms_own(served):
    assert len(served["ids"]) == 8 and max(map(len, served["ids"])) > 64     # one batch; chunked prefill
    assert served["glide"]["counters"]["num_drafts"] > 0
    assert served["glide"]["tokens"] == served["plain"]["tokens"]
    assert all(len(t) == NEW_TOKENS for t in served["plain"]["tokens"])


def test_vllm_acceptance_is_evals_chain_tau(served):
    ev = served["eval"]
    assert ev["lossless"] is True and ev["gamma"] == GAMMA
    print(f"vLLM tau {tau(served['glide']):.4f}, eval chain tau {ev['tau']:.4f}")
    assert tau(served["glide"]) == pytest.approx(ev["tau"], abs=TAU_TOL)


def unverified_reads(trace: list[dict]) -> list[dict]:
    """Draft steps whose cross-attention sees keys other than the verified ones: at step j a request's
    query sits at position p + j (p: the newest token's, vLLM's own positions) and the target's cache
    holds the verified tokens 0 .. p - 1: the keys must be exactly those, for every query (non-causal)."""
    return [r for r in trace if r["causal"] or any(s != p - r["step"] for s, p in zip(r["seq"], r["pos"]))]


def test_cross_attention_reads_only_verified_positions(served):
    glide, stock = served["traces"]["glide"], served["traces"]["stock"]
    assert {r["step"] for r in glide} == set(range(GAMMA)) and len(glide) >= served["glide"]["counters"]["num_drafts"] // 8
    assert unverified_reads(glide) == []
    # draft_model's own metadata: causal, lengths past the newest token (rejected drafts' slots)
    assert len(unverified_reads(stock)) == len(stock)
    # still lossless, as the target verifies every draft
    assert served["stock"]["tokens"] == served["plain"]["tokens"]
    print(f"stock metadata tau {tau(served['stock']):.4f}, GLIDE metadata {tau(served['glide']):.4f}")


def test_serve_dry_run_prints_the_vllm_command(served):
    res = cli("serve", served["proj"], "base", "--vllm-python", served["py"], "--port", "8123", "--dry-run")
    draft = served["exported"]["out"]
    assert f"{served['py']} -m vllm.entrypoints.openai.api_server --model " in res.stdout
    assert f'"model": "{draft}", "num_speculative_tokens": 4' in res.stdout
    assert "--disable-hybrid-kv-cache-manager --enforce-eager --host 127.0.0.1 --port 8123" in res.stdout
    assert "http://127.0.0.1:8123/v1" in res.stdout


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120) -> dict:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read(1 << 20))


def test_longspec_serve_answers_on_the_openai_api(served):
    """`longspec serve` starts vLLM with the draft; a completion through the OpenAI API is the target's
    greedy continuation (vLLM's own without speculation, run by the driver)."""
    import signal
    import time
    import urllib.error
    import urllib.request

    port = free_port()
    argv = [sys.executable, "-m", "longspec_cli", "serve", str(served["proj"]), "base", "--vllm-python",
            str(served["py"]), "--port", str(port), "--", "--dtype", "float32", "--max-model-len", "2048"]
    log = open(served["proj"] / "serve.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (served["proj"] / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5) as r:
                    model = json.loads(r.read())["data"][0]["id"]
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                assert time.monotonic() < deadline, "vLLM did not answer within 600 s"
                time.sleep(2)
        n = 16
        out = post(f"{url}/completions", {"model": model, "prompt": served["ids"][0], "max_tokens": n,
                                          "temperature": 0, "ignore_eos": True})
        text = out["choices"][0]["text"]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        assert text == tok.decode(served["plain"]["tokens"][0][:n])
        assert f"OpenAI API at {url}" in (served["proj"] / "serve.log").read_text()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_an_unsupported_vllm_is_refused_with_the_reason():
    code = (
        "import vllm; vllm.__version__ = '0.31.0'\n"
        "import vllm.v1.worker.gpu_model_runner as runner\n"
        "from longspec.serve import plugin, vllm_model, vllm_proposer\n"
        "stock = runner.DraftModelProposer\n"
        "plugin.register()\n"
        "assert runner.DraftModelProposer is stock, 'proposer swapped on an unsupported vLLM'\n"
        "try:\n"
        "    vllm_model.GlideForCausalLM(vllm_config=None)\n"
        "except plugin.UnsupportedVllm as e:\n"
        "    print('refused:', e)\n"
    )
    res = sh(vllm_python(), "-c", code)
    assert "refused: longspec's GLIDE plugin runs on vLLM 0.32.0; this is vLLM 0.31.0." in res.stdout
