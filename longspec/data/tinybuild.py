"""The tiny preset built (`python -m longspec.tiny build`, longspec/tiny.py): a byte-level BPE
tokenizer, a briefly pre-trained Qwen2- or Llama-family target and the three stages' data, all
local and offline. The tokenizer and target depend only on TINY_VERSION and the family, so they
are trained once and then copied from a cache ($LONGSPEC_TINY_CACHE, else ~/.cache/longspec/tiny/);
`seed` only changes the stage data. The synthetic language, the stage records and the pre-training
corpus are longspec.data.synthetic.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from longspec.data.synthetic import ANSWER_STYLES, STAGE_DATA, base_records, pretrain_corpus

TINY_VERSION = "4"  # the cache key: bump it with any change that alters the target's bytes
FAMILIES = ("qwen2", "llama")
CONTEXT_LIMIT = 32768
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 (BPE trainer order)
# Embedding rows; the BPE vocabulary is at most this (about 650 tokens): the spare rows are never
# targets, like the padded embeddings of Qwen models (151936 rows for 151665 tokens).
VOCAB_SIZE = 768
# Qwen2's pre-tokenizer split (single digits, letters runs, punctuation runs). transformers 5
# loads a `qwen2` folder with Qwen2Tokenizer, which rebuilds the pipeline with this regex and
# NFC; training with the same pieces keeps AutoTokenizer and tokenizer.json in agreement.
SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
               r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen-style ChatML; pad == eos as in the upstream stage configs.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128)
# Head dims a tiny target is built with: 16 (the preset's), or 32 (two heads of 32, one K/V head:
# the smallest head vLLM's CPU attention takes, for `longspec serve` and tests/serve/).
HEAD_DIMS = {16: {}, 32: dict(num_attention_heads=2, num_key_value_heads=1)}


def model_sizes(head_dim: int = 16) -> dict:
    if head_dim not in HEAD_DIMS:
        raise TinyBuildError(f"head dim {head_dim}: choose one of {', '.join(map(str, HEAD_DIMS))}")
    return {**MODEL_SIZES, **HEAD_DIMS[head_dim]}
# Most steps on short windows; every `long_every`-th step on one `long_seq` window, so that
# the target also knows positions and look-ups well past the short windows.
PRETRAIN = dict(steps=200, batch=8, seq=256, long_every=5, long_seq=2048, lr=8e-3, warmup=20,
                seed=1234)


def tiny_target_info() -> dict:
    """What a preset needs to know about the tiny target without building it."""
    return {
        "version": TINY_VERSION,
        "families": list(FAMILIES),
        "context_limit": CONTEXT_LIMIT,
        "eos_token": EOS_TOKEN,
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token": EOS_TOKEN,
        "pad_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "vocab_size": VOCAB_SIZE,
        **MODEL_SIZES,
    }


# --------------------------------------------------------------------------- tokenizer

def train_tokenizer(corpus: list[str], out_dir: Path):
    """Byte-level BPE over the corpus, saved as a PreTrainedTokenizerFast folder."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]), chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False, padding_side="right", model_max_length=CONTEXT_LIMIT)
    fast.save_pretrained(out_dir)
    return fast


# --------------------------------------------------------------------------- target

def make_config(family: str, vocab_size: int, eos_id: int, head_dim: int = 16):
    common = dict(vocab_size=vocab_size, max_position_embeddings=CONTEXT_LIMIT,
                  tie_word_embeddings=False, bos_token_id=eos_id, eos_token_id=eos_id,
                  pad_token_id=eos_id, rms_norm_eps=1e-6, **model_sizes(head_dim))
    if family == "qwen2":
        from transformers import Qwen2Config
        return Qwen2Config(rope_theta=1_000_000.0, use_sliding_window=False, **common)
    if family == "llama":
        from transformers import LlamaConfig
        return LlamaConfig(rope_theta=500_000.0, **common)
    raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(FAMILIES)}")


def token_stream(tokenizer, docs: list[str]):
    """Documents tokenized and joined with EOS: (N,) LongTensor."""
    import torch
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids += enc + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def pretrain_target(family: str, tokenizer, docs: list[str], log=None, head_dim: int = 16):
    """A tiny causal LM trained briefly and deterministically on the synthetic corpus."""
    import torch
    from transformers import AutoModelForCausalLM

    p = PRETRAIN
    stream = token_stream(tokenizer, docs)  # (N,)
    windows = {seq: stream[: (len(stream) // seq) * seq].view(-1, seq)  # (W, T)
               for seq in (p["seq"], p["long_seq"])}
    threads = torch.get_num_threads()
    rng_state = torch.random.get_rng_state()  # restored below: leave the caller's RNG alone
    torch.set_num_threads(1)  # one thread: the same float sums on every run
    try:
        torch.manual_seed(p["seed"])
        config = make_config(family, VOCAB_SIZE, tokenizer.eos_token_id, head_dim)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=(0.9, 0.95),
                                weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / p["warmup"])
                                                  * max(0.05, 1 - s / p["steps"]))
        gen = torch.Generator().manual_seed(p["seed"])
        for step in range(p["steps"]):
            long = p["long_every"] and step % p["long_every"] == p["long_every"] - 1
            pool = windows[p["long_seq"] if long else p["seq"]]
            pick = torch.randint(0, len(pool), (1 if long else p["batch"],), generator=gen)
            batch = pool[pick]  # (B, T)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if log and (step % 50 == 0 or step == p["steps"] - 1):
                log(f"step {step} loss {loss.item():.3f}")
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng_state)
    model.eval()
    return model


def eval_loss(model, tokenizer, docs: list[str], seq: int = 512) -> float:
    """Mean next-token loss (nats) over documents, in windows of `seq` tokens."""
    import torch
    stream = token_stream(tokenizer, docs)
    n = (len(stream) - 1) // seq
    windows = stream[: n * seq].view(n, seq)
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    return sum(losses) / len(losses)


# --------------------------------------------------------------------------- build + cache

class TinyBuildError(RuntimeError):
    """A tiny build that cannot go ahead (bad family, output already there)."""


def cache_dir() -> Path:
    return Path(os.environ.get("LONGSPEC_TINY_CACHE") or Path.home() / ".cache" / "longspec" / "tiny")


TARGET_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "tiny.json")


def _complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in TARGET_FILES)


def build_target(family: str, dest: Path, log=None, head_dim: int = 16) -> dict:
    """Train tokenizer + target from scratch into `dest` (which must not exist yet)."""
    import torch
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    corpus = pretrain_corpus(random.Random(1), n_short=3000, n_long=30)
    heldout = [r["text"] for r in base_records(random.Random(99), 100)]
    tokenizer = train_tokenizer(corpus, dest)
    if log:
        log(f"pre-training the {family} target once (about half a minute; then cached)")
    t0 = time.time()
    model = pretrain_target(family, tokenizer, corpus, log=log, head_dim=head_dim)
    if log:
        log(f"{family} target trained in {time.time() - t0:.1f} s")
    model.save_pretrained(dest, safe_serialization=True)
    heldout_loss = eval_loss(model, tokenizer, heldout)
    info = {"version": TINY_VERSION, "family": family, "pretrain": PRETRAIN,
            "tokenizer_size": len(tokenizer), "heldout_loss": round(heldout_loss, 4),
            "torch": torch.__version__}
    (dest / "tiny.json").write_text(json.dumps(info, indent=2) + "\n")
    for f in dest.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; the cache is shared by every project
    return info


def cached_target(family: str, log=None, head_dim: int = 16) -> tuple[Path, bool]:
    """The cache entry for `family`, built under a lock if missing; (path, was_cached)."""
    from filelock import FileLock
    if family not in FAMILIES:
        raise TinyBuildError(f"unknown tiny family {family!r}; choose one of {', '.join(FAMILIES)}")
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    model_sizes(head_dim)  # refuses an unknown head dim before anything is built
    entry = root / (f"v{TINY_VERSION}-{family}" + ("" if head_dim == 16 else f"-hd{head_dim}"))
    with FileLock(str(entry) + ".lock"):
        if _complete(entry):
            return entry, True
        if entry.exists():  # hand-damaged: rebuild
            shutil.rmtree(entry)
        for stale in root.glob(f".{entry.name}-*"):  # left by a killed build (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = _mkdtemp(root, f".{entry.name}-")
        try:
            build_target(family, tmp, log=log, head_dim=head_dim)
            os.rename(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return entry, False


def _mkdtemp(parent: Path, prefix: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    tmp.chmod(0o755)  # mkdtemp makes 0700; the result is an ordinary shared folder
    return tmp


def _write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_data(data_dir: Path, seed: int, answer_style: str = "target") -> dict[str, str]:
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for stage, (make, n, lengths) in STAGE_DATA.items():
        rng = random.Random(f"longspec-tiny-{stage}-{seed}")
        path = data_dir / f"{stage}.jsonl"
        _write_jsonl(path, make(rng, n, **lengths, answer_style=answer_style))
        paths[stage] = str(path.resolve())
    return paths


def build_tiny(out_dir, family: str = "qwen2", seed: int = 0, force: bool = False,
               log=None, answer_style: str = "target", head_dim: int = 16) -> dict:
    """OUT/target/ (model + tokenizer) and OUT/data/{base,long,longcot}.jsonl.

    Returns {"target": path, "data": {stage: path}, "family", "seed", "cached", "seconds"}.
    """
    t0 = time.time()
    out = Path(out_dir)
    target = out / "target"
    data_files = [out / "data" / f"{s}.jsonl" for s in STAGE_DATA]
    existing = [p for p in [target, *data_files] if p.exists()]
    if existing and not force:
        raise TinyBuildError(f"{existing[0]} already exists; pass --force to replace the "
                             "tiny build")
    entry, cached = cached_target(family, log=log, head_dim=head_dim)
    out.mkdir(parents=True, exist_ok=True)
    tmp = _mkdtemp(out, ".target-")
    try:
        shutil.copytree(entry, tmp, dirs_exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    data = write_data(out / "data", seed, answer_style)
    return {"target": str(target.resolve()), "data": data, "family": family, "seed": seed,
            "answer_style": answer_style, "cached": cached, "seconds": round(time.time() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m longspec.tiny",
                                 description="Build the tiny preset: target, tokenizer, data.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write OUT/target/ and OUT/data/*.jsonl")
    b.add_argument("out", help="output folder")
    b.add_argument("--family", choices=FAMILIES, default="qwen2")
    b.add_argument("--seed", type=int, default=0, help="seed of the stage data")
    b.add_argument("--answer-style", choices=ANSWER_STYLES, default="target",
                   help="the stage answers' wording: the target's, or another (a second model's)")
    b.add_argument("--json", action="store_true", help="print the paths as one JSON object")
    b.add_argument("--force", action="store_true", help="replace an earlier tiny build in OUT")
    b.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    b.add_argument("--head-dim", type=int, choices=sorted(HEAD_DIMS), default=16,
                   help="the target's head dim (32: what vLLM's CPU attention takes, for `longspec serve`)")
    args = ap.parse_args(argv)
    log = None if args.quiet else (lambda m: print(f"[tiny] {m}", file=sys.stderr, flush=True))
    try:
        res = build_tiny(args.out, family=args.family, seed=args.seed, force=args.force, log=log,
                         answer_style=args.answer_style, head_dim=args.head_dim)
    except (TinyBuildError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res))
    else:
        print(f"target  {res['target']}")
        for stage, path in res["data"].items():
            print(f"{stage:8}{path}")
    return 0
