"""The tiny preset's synthetic language and the records built from it: the three stages' data
(STAGE_DATA) and the corpus the tiny target is pre-trained on (pretrain_corpus).

The language is small and regular on purpose, so that a draft can learn it in minutes:
templated sentences, counting, cyclic lists, copying, sums, and key/value facts that are
stated once and asked for much later (long-range look-ups for the long-context stages).

The tiny target and its tokenizer are trained on pretrain_corpus, so a change here that alters
the corpus alters the target's bytes: bump longspec.tiny.TINY_VERSION with it.
render_chat writes chats as the tokenizer's CHAT_TEMPLATE (longspec.tiny) does.

Answer styles (ANSWER_STYLES; the stage builders' `answer_style`, `python -m longspec.tiny build
OUT --answer-style other`): "target" (the default) writes the answers as the target learned them;
"other" writes the same answers in another wording, as a second model's answers would read
(OTHER_WORDS: "the code of ada is 42 ." -> "that code of ada equals 42 !"). Only the answers
change: chat assistant turns, arXiv abstracts, chain-of-thought responses, and documents (base,
long's book and code: a document is all answer); prompts, user turns and articles stay, and no
random draw changes, so the records match one for one. pretrain_corpus is always in the target's
style (the tiny target and TINY_VERSION do not depend on it): stage data in the "other" style is
what `longspec regenerate` brings back to the target's own.
"""

from __future__ import annotations

import random
import re


# --------------------------------------------------------------------------- the language

NOUNS = ["cat", "dog", "fox", "bird", "fish", "tree", "river", "stone", "house", "boat",
         "king", "queen", "robot", "star", "moon", "garden"]
ADJS = ["red", "blue", "green", "small", "big", "old", "young", "quiet", "happy", "dark"]
VERBS = ["sees", "likes", "finds", "follows", "helps", "draws", "moves", "keeps"]
PLACES = ["near the river", "in the garden", "under the moon", "by the house", "on the hill"]
NAMES = ["ada", "bob", "cleo", "dan", "eve", "finn", "gus", "hana", "ivo", "juno", "kai",
         "lena", "milo", "nora", "otto", "pia", "quin", "rosa", "sam", "tara"]
THINGS = ["code", "key", "room", "age", "score"]
CYCLES = [["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"],
          ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"],
          ["north", "east", "south", "west"],
          ["spring", "summer", "autumn", "winter"]]


class Lang:
    """Sentence makers over one random stream; every method returns plain text."""

    def __init__(self, rng: random.Random):
        self.r = rng

    def sentence(self) -> str:
        r = self.r
        s = f"the {r.choice(ADJS)} {r.choice(NOUNS)} {r.choice(VERBS)} the {r.choice(NOUNS)}"
        return s + (f" {r.choice(PLACES)} ." if r.random() < 0.4 else " .")

    def counting(self) -> str:
        a, n = self.r.randrange(0, 180), self.r.randrange(4, 12)
        return f"count from {a} : " + " ".join(str(a + i) for i in range(n)) + " ."

    def cycle(self) -> str:
        c = self.r.choice(CYCLES)
        a, n = self.r.randrange(len(c)), self.r.randrange(3, 9)
        return "list : " + " ".join(c[(a + i) % len(c)] for i in range(n)) + " ."

    def copy(self) -> str:
        words = [self.r.choice(NOUNS + ADJS) for _ in range(self.r.randrange(3, 7))]
        return "copy : " + " ".join(words) + " | " + " ".join(words) + " ."

    def sum(self) -> str:
        a, b = self.r.randrange(0, 50), self.r.randrange(0, 50)
        return f"{a} plus {b} is {a + b} ."

    def facts(self, n: int) -> dict[tuple[str, str], int]:
        keys = {(self.r.choice(NAMES), self.r.choice(THINGS)) for _ in range(n)}
        return {k: self.r.randrange(10, 100) for k in sorted(keys)}

    @staticmethod
    def fact(key: tuple[str, str], value: int) -> str:
        return f"fact : the {key[1]} of {key[0]} is {value} ."

    @staticmethod
    def question(key: tuple[str, str], value: int) -> str:
        return f"question : what is the {key[1]} of {key[0]} ? answer : {value} ."

    def filler(self) -> str:
        return self.r.choice([self.sentence, self.sentence, self.counting, self.cycle,
                              self.copy, self.sum])()

    def paragraph(self, n_sentences: int, n_facts: int = 0) -> str:
        """Sentences with facts stated early and asked for later (look-back structure)."""
        facts = list(self.facts(n_facts).items()) if n_facts else []
        out = [self.fact(k, v) for k, v in facts]
        out += [self.filler() for _ in range(n_sentences)]
        self.r.shuffle(facts)
        out += [self.question(k, v) for k, v in facts]
        return " ".join(out)

    def code(self, n_funcs: int) -> str:
        ks = [self.r.randrange(1, 60) for _ in range(n_funcs)]
        lines = []
        for i, k in enumerate(ks):
            op = self.r.choice(["+", "-", "*"])
            lines += [f"def f{i}(x):", f"    return x {op} {k}", ""]
        for _ in range(n_funcs):
            i, x = self.r.randrange(n_funcs), self.r.randrange(0, 20)
            lines.append(f"print(f{i}({x}))")
        return "\n".join(lines) + "\n"

    def chat(self, n_turns: int) -> list[dict]:
        facts = list(self.facts(n_turns).items())
        msgs = [{"role": "system", "content": "you are a helpful assistant ."}] \
            if self.r.random() < 0.5 else []
        for key, value in facts:
            fact = f"the {key[1]} of {key[0]} is {value} ."
            msgs.append({"role": "user", "content": f"remember : {fact}"})
            msgs.append({"role": "assistant", "content": f"ok , {fact}"})
        for _ in range(n_turns):
            kind = self.r.random()
            if kind < 0.4 and facts:
                key, value = self.r.choice(facts)
                q = f"what is the {key[1]} of {key[0]} ?"
                a = f"the {key[1]} of {key[0]} is {value} ."
            elif kind < 0.7:
                a0, n = self.r.randrange(0, 150), self.r.randrange(4, 12)
                q = f"count from {a0} to {a0 + n - 1} ."
                a = " ".join(str(a0 + i) for i in range(n)) + " ."
            else:
                q, a = "tell me a story .", " ".join(self.sentence() for _ in range(3))
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return msgs

    def sum_cot(self, n_terms: int) -> tuple[str, str]:
        nums = [self.r.randrange(1, 40) for _ in range(n_terms)]
        problem = "add the numbers " + " , ".join(map(str, nums)) + " ."
        steps, total = ["let me think step by step . start with 0 ."], 0
        for x in nums:
            steps.append(f"{total} plus {x} is {total + x} .")
            total += x
        steps.append(f"wait , let me check . the numbers were " + " , ".join(map(str, nums)) + " .")
        steps.append(f"so the total is {total} . the answer is {total} .")
        return problem, " ".join(steps)

    def lookup_cot(self, n_facts: int, search: tuple[float, float] = (0.5, 1.0)) -> tuple[str, str]:
        """The key is one of the facts between the `search` shares of the list (by default in
        its second half: a long search before the hit)."""
        facts = list(self.facts(n_facts).items())
        lo, hi = (int(len(facts) * x) for x in search)
        key, value = self.r.choice(facts[lo:max(hi, lo + 1)])
        prompt = " ".join(self.fact(k, v) for k, v in facts) + \
            f" question : what is the {key[1]} of {key[0]} ?"
        steps = [f"i need the {key[1]} of {key[0]} . let me go through the facts ."]
        for k, v in facts:
            if k == key:
                steps.append(f"the {k[1]} of {k[0]} is {v} . this is the one .")
                break
            steps.append(f"the {k[1]} of {k[0]} is {v} . not this one .")
        steps.append(f"so the answer is {value} .")
        return prompt, " ".join(steps)


# --------------------------------------------------------------------------- answer styles

ANSWER_STYLES = ("target", "other")
OTHER_WORDS = {"the": "that", "is": "equals", ".": "!", ",": ";", "ok": "sure", "plus": "add",
               "so": "thus", "let": "allow", "answer": "result"}
_WORD = re.compile(r"(?<!\S)\S+(?!\S)")


def other_style(text: str) -> str:
    """`text` in the "other" answer style: whole words swapped by OTHER_WORDS, spacing kept."""
    return _WORD.sub(lambda m: OTHER_WORDS.get(m.group(0), m.group(0)), text)


def restyle(rec: dict, answer_style: str = "target") -> dict:
    """A stage record with its answers in `answer_style` (the record itself for "target")."""
    if answer_style not in ANSWER_STYLES:
        raise ValueError(f"answer_style {answer_style!r}: choose one of {', '.join(ANSWER_STYLES)}")
    if answer_style == "target":
        return rec
    out = dict(rec)
    for key in ("text", "abstract", "qwq", "response"):
        if isinstance(out.get(key), str):
            out[key] = other_style(out[key])
    for key in ("conversation", "messages"):
        if isinstance(out.get(key), list):
            out[key] = [{**m, "content": other_style(m["content"])} if m.get("role") == "assistant" else m
                        for m in out[key]]
    return out


# --------------------------------------------------------------------------- stage data

def base_records(rng: random.Random, n: int, answer_style: str = "target") -> list[dict]:
    """Stage 1: short texts (~100-200 tokens)."""
    lang = Lang(rng)
    return [restyle({"text": lang.paragraph(rng.randrange(6, 12), rng.randrange(0, 4))}, answer_style)
            for _ in range(n)]


def _span(rng: random.Random, span: int | tuple[int, int]) -> int:
    """A length: fixed (an int, no draw from `rng`) or drawn from [lo, hi)."""
    return span if isinstance(span, int) else rng.randrange(*span)


def long_records(rng: random.Random, n: int, chat_turns: tuple[int, int] = (25, 40),
                 article_sentences: int | tuple[int, int] = 100, answer_style: str = "target") -> list[dict]:
    """Stage 2: ~1-2k-token documents (book, code) in upstream's `source` kinds, plus chats
    (arxiv summaries, tulu-v2 and plain `messages` chats) of `chat_turns` look-ups and articles
    of `article_sentences` sentences. The defaults (~1.3-2.5k-token chats) are the pre-training
    corpus's; the demo's stage asks for shorter chats (DEMO_LENGTHS)."""
    lang, out = Lang(rng), []
    for i in range(n):
        kind = ("book", "code", "arxiv", "tulu-v2", "messages")[i % 5]
        if kind == "book":
            text = "\n\n".join(f"chapter {c} .\n" + lang.paragraph(rng.randrange(20, 30), 3)
                               for c in range(1, 5))
            out.append({"source": "book", "text": text})
        elif kind == "code":
            out.append({"source": "code", "text": lang.code(rng.randrange(60, 90))})
        elif kind == "arxiv":
            facts = list(lang.facts(6).items())
            article = " ".join(lang.fact(k, v) for k, v in facts) + " " + \
                lang.paragraph(_span(rng, article_sentences))
            abstract = "we study the facts . " + " ".join(lang.fact(k, v) for k, v in facts[:3])
            out.append({"source": "arxiv", "article": article, "abstract": abstract})
        elif kind == "tulu-v2":
            out.append({"source": "tulu-v2", "conversation": lang.chat(rng.randrange(*chat_turns))})
        else:
            out.append({"messages": lang.chat(rng.randrange(*chat_turns))})
    return [restyle(r, answer_style) for r in out]


def longcot_records(rng: random.Random, n: int, sum_terms: tuple[int, int] = (60, 120),
                    lookup_facts: tuple[int, int] = (30, 60),
                    search: tuple[float, float] = (0.5, 1.0), answer_style: str = "target") -> list[dict]:
    """Stage 3: long chain-of-thought in QwQ-LongCoT (`problem`/`qwq`: sums of `sum_terms`
    numbers) and prompt/response form (a look-up among `lookup_facts` facts, the key between the
    `search` shares of them). The defaults (0.5-2.7k tokens) are the pre-training corpus's."""
    lang, out = Lang(rng), []
    for i in range(n):
        if i % 2 == 0:
            problem, qwq = lang.sum_cot(rng.randrange(*sum_terms))
            out.append({"problem": problem, "qwq": qwq})
        else:
            prompt, response = lang.lookup_cot(rng.randrange(*lookup_facts), search)
            out.append({"prompt": prompt, "response": response})
    return [restyle(r, answer_style) for r in out]


# The tiny preset's stage files: (maker, records, lengths). Stages 2-3 train 60 steps x 2
# records in the demo: 160 records leave 40 never drawn, the held-out prompts their eval decodes.
# Their chats and chains of thought are sized for the preset's 512-token max_seq_length: whole,
# answer and end of turn included (the chat rule in docs/DESIGN.md), with questions of ~40 to
# ~460 tokens (eval's 256 and 512 buckets; a question over 256 tokens is trained under the
# trainer's prompt cap, head and tail kept); the book and code documents keep ~1.3-1.9k tokens,
# the long-context part of stage 2.
DEMO_LENGTHS = {"long": dict(chat_turns=(2, 7), article_sentences=(8, 23)),
                "longcot": dict(sum_terms=(8, 21), lookup_facts=(20, 32), search=(0.25, 0.6))}
STAGE_DATA = {"base": (base_records, 2500, {}), "long": (long_records, 160, DEMO_LENGTHS["long"]),
              "longcot": (longcot_records, 160, DEMO_LENGTHS["longcot"])}


def render_chat(messages: list[dict], generation_prompt: bool = False) -> str:
    """CHAT_TEMPLATE in Python, for the pre-training corpus (no tokenizer exists yet)."""
    s = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return s + ("<|im_start|>assistant\n" if generation_prompt else "")


def record_text(rec: dict) -> str:
    """Any stage record as one document (chats in CHAT_TEMPLATE form)."""
    if "text" in rec:
        return rec["text"]
    if "article" in rec:
        msgs = [{"role": "user", "content": rec["article"]},
                {"role": "assistant", "content": rec["abstract"]}]
    elif "conversation" in rec or "messages" in rec:
        msgs = rec.get("conversation") or rec["messages"]
    else:
        msgs = [{"role": "user", "content": rec.get("problem") or rec["prompt"]},
                {"role": "assistant", "content": rec.get("qwq") or rec["response"]}]
    return render_chat(msgs)


def pretrain_corpus(rng: random.Random, n_short: int, n_long: int) -> list[str]:
    """Documents of every kind the stages use, as the target sees them (chats rendered)."""
    lang, docs = Lang(rng), []
    for i in range(n_short):
        k = i % 10
        if k < 5:
            docs.append(lang.paragraph(rng.randrange(6, 14), rng.randrange(0, 5)))
        elif k == 5:
            docs.append(lang.code(rng.randrange(5, 20)))
        elif k in (6, 7):
            docs.append(render_chat(lang.chat(rng.randrange(2, 6))))
        elif k == 8:
            docs.append(record_text(dict(zip(("problem", "qwq"),
                                             lang.sum_cot(rng.randrange(5, 25))))))
        else:
            docs.append(record_text(dict(zip(("prompt", "response"),
                                             lang.lookup_cot(rng.randrange(4, 15))))))
    docs += [record_text(r) for r in long_records(rng, n_long)]
    docs += [record_text(r) for r in longcot_records(rng, n_long // 2)]
    return docs
