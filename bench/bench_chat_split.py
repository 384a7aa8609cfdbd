"""What the chat split (longspec.data.chat.split_chat) costs when a stage is encoded.

    .venv/bin/python bench/bench_chat_split.py [--records 200]

On the tiny preset's stage-2 and stage-3 records (multi-turn chats of 25-40 turns, arXiv
summaries, long chains of thought), under the tiny ChatML template and QwQ-32B's published one
(tests/trainer/templates/), prints per stage and template: records/s of encoding.encode_records
(render + split + tokenize + labels) and the ratio to one plain apply_chat_template render plus one
tokenizer call per record (the least any template-based collator does). Compare ratios, not times.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from longspec.data import collators, encoding
    from longspec import tiny

    target = tiny.build_tiny(Path(tempfile.mkdtemp()), family="qwen2")["target"]
    stages = {"long_data": tiny.long_records(random.Random(0), args.records),
              "long_cot": tiny.longcot_records(random.Random(0), args.records)}
    for template in ("tiny-chatml", "qwq-32b"):
        tok = AutoTokenizer.from_pretrained(target)
        if template == "qwq-32b":
            tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
            tok.chat_template = (ROOT / "tests/trainer/templates/qwq-32b.jinja").read_text()
        for collator, recs in stages.items():
            t0 = time.perf_counter()
            out = encoding.encode_records(recs, tok, collator, 1 << 20)
            split_s = time.perf_counter() - t0
            assert not any(isinstance(r, Exception) for r in out)
            t0 = time.perf_counter()
            for rec in recs:
                msgs = _messages(rec, collators)
                if msgs is None:
                    tok(rec["text"])["input_ids"]
                else:
                    tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)
            base_s = time.perf_counter() - t0
            print(f"{template:12s} {collator:10s} {len(recs) / split_s:8.1f} records/s  "
                  f"{split_s / base_s:5.2f}x one render + tokenize")


def _messages(rec, collators):
    if "text" in rec:
        return None
    if "article" in rec:
        return [{"role": "user", "content": rec["article"]}, {"role": "assistant", "content": rec["abstract"]}]
    if "conversation" in rec or "messages" in rec:
        return collators.messages_of(rec, "conversation" if "conversation" in rec else "messages")
    return collators.long_cot_messages(rec)


if __name__ == "__main__":
    main()
