"""Run in the vLLM environment's Python by tests/serve/test_vllm_serve.py (never imported by pytest):

    python tests/serve/vllm_driver.py SPEC.json OUT.json

SPEC: {"target", "draft", "prompts": [[ids]], "max_tokens", "gamma", "runs": ["plain", "glide", "stock"],
"trace_dir"}: each run's draft steps are traced to TRACE_DIR/<run>.jsonl (longspec/serve/vllm_proposer.py).
Greedy decoding of every prompt in one batch on vLLM's CPU backend, chunked prefill on (a budget of
64 tokens per step, so the longer prompts are prefilled in several chunks), per run: plain (no
speculation), glide (the draft through longspec's plugin), stock (the same with the cross-attention
given draft_model's own metadata: LONGSPEC_VLLM_CROSS_METADATA=stock). OUT: per run the tokens,
vLLM's speculative-decoding counters and the engine's start and generation times.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name.removeprefix("vllm:spec_decode_")] = getattr(m, "value", None) or getattr(m, "values", None)
    return out


def run(spec: dict, kind: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ["LONGSPEC_VLLM_CROSS_METADATA"] = "stock" if kind == "stock" else "glide"
    if spec.get("trace_dir"):
        os.environ["LONGSPEC_VLLM_TRACE"] = os.path.join(spec["trace_dir"], f"{kind}.jsonl")
    extra = {}
    if kind != "plain":
        extra["speculative_config"] = {"method": "draft_model", "model": spec["draft"],
                                       "num_speculative_tokens": spec["gamma"]}
    t0 = time.monotonic()
    llm = LLM(model=spec["target"], dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=8,
              max_num_batched_tokens=64, enable_chunked_prefill=True, enable_prefix_caching=False,
              disable_hybrid_kv_cache_manager=True, disable_log_stats=False, seed=0, **extra)
    t1 = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    t2 = time.monotonic()
    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "counters": counters(llm),
           "start_s": round(t1 - t0, 1), "generate_s": round(t2 - t1, 1)}
    llm.llm_engine.engine_core.shutdown()
    del llm
    return res


def main() -> int:
    spec = json.load(open(sys.argv[1]))
    results = {kind: run(spec, kind) for kind in spec["runs"]}
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
