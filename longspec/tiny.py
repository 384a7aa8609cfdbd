"""The tiny preset: a synthetic language, a byte-level BPE tokenizer, a briefly pre-trained
Qwen2- or Llama-family target and the three stages' data, all built locally and offline.

    python -m longspec.tiny build OUT [--family qwen2|llama] [--seed N] [--answer-style target|other]
        [--head-dim 16|32] [--json] [--force] [--quiet]

writes OUT/target/ (an ordinary Hugging Face model folder: config, safetensors, tokenizer) and
OUT/data/{base,long,longcot}.jsonl. The tokenizer and target depend only on TINY_VERSION and the
family (and the head dim: `--head-dim 32` builds a target vLLM's CPU attention can run, cached
apart), so they are trained once and then copied from a cache ($LONGSPEC_TINY_CACHE, else
~/.cache/longspec/tiny/); `seed` only changes the stage data. `--answer-style other` writes the
stage data's answers in another wording than the target's (as a second model's answers would
read; longspec.data.synthetic.restyle): same questions, same target.

The synthetic language, the stage records and the pre-training corpus are longspec.data.synthetic.
"""
from longspec.data.tinybuild import (  # noqa: F401  (the names the tests and bench scripts use)
    TINY_VERSION, TinyBuildError, build_tiny, cache_dir, cached_target, main, tiny_target_info, write_data,
)

if __name__ == "__main__":
    import sys

    sys.exit(main())
