"""What a chat record trains: the prompt / answer split, rendered by the target's own chat template.

The rule (docs/DESIGN.md, "What a chat record trains"): each assistant answer and its end-of-turn
token(s) are trained; system text (the record's or the template's default), user turns and the
generation header are not. The split comes from rendering, never from guessing the format:

  prompt     render(messages before the answer, add_generation_prompt=True): what the target
             reads at inference before it writes the answer.
  answer     render(messages up to the answer) minus the prompt, when the prompt is its prefix
             and the answer text is in it verbatim (then it is the template's own text: answer
             + end of turn). Otherwise the template rewrites the answer (QwQ-32B and Qwen3 drop
             the reasoning before </think>, Llama trims whitespace, a generation prompt that
             opens <think>): the record's answer is kept whole, followed by the template's own
             end of turn, found by rendering a sentinel answer and reading what follows it.
  refused    a template whose rendered turn shows no end of turn after the sentinel: a
             ChatError naming the template (the caller adds file:line).

Several assistant turns: the sequence is the template's own prompt for the last answer (the
whole history as the target reads it before that answer) followed by the last answer and its
end. The earlier answers inside that history are trained as the template shows them there
(QwQ-32B drops their reasoning, Qwen3 their empty think block), each with its end of turn; they
are found by rendering the same history with sentinel answers. A template that does not show
earlier answers that way leaves them untrained context, counted (`untrained_answers`) so that
`prepare --show` can say so.

`split_chat` is the one public entry: prompt / answer pieces for a conversation, used by the
stage collators (longspec.data.encoding) and by evaluation prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SENTINEL = "LONGSPECSENTINELANSWER"
# Piece kinds: "prompt" (system, user, default system text, headers) is not trained; "answer" and
# "end" (the end-of-turn text) are.


class ChatError(ValueError):
    """A conversation the template cannot split (no end of turn, a template error, no answer)."""


@dataclass
class ChatSplit:
    pieces: list[tuple[str, str]] = field(default_factory=list)   # (text, kind) in order
    untrained_answers: int = 0  # earlier answers the template hides: left as context
    kept_whole: int = 0         # answers the template rewrote: the record's text + its end of turn

    @property
    def prompt(self) -> str:
        """Everything before the last answer (the generation prompt for it)."""
        last = max(i for i, (_, k) in enumerate(self.pieces) if k == "answer")
        return "".join(t for t, _ in self.pieces[:last])

    def token_ids(self, tokenizer) -> tuple[list[int], list[int]]:
        """(prompt ids, last answer + end-of-turn ids), tokenized piece by piece as the trainer
        tokenizes them (the template's special tokens are in the text: none are added)."""
        last = max(i for i, (_, k) in enumerate(self.pieces) if k == "answer")
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t, _ in self.pieces]
        return [i for p in ids[:last] for i in p], [i for p in ids[last:] for i in p]


def template_name(tokenizer) -> str:
    """A short name for messages: the tokenizer's folder."""
    return str(getattr(tokenizer, "name_or_path", "") or "the tokenizer") + "'s chat template"


def render(tokenizer, messages: list[dict], generation_prompt: bool = False, **template_kwargs) -> str:
    """The tokenizer's own chat template (transformers' apply_chat_template), as text."""
    if not getattr(tokenizer, "chat_template", None):       # a plain format; answers end with EOS
        eos = tokenizer.eos_token or ""
        text = "".join(f"{m['role']}: {m['content']}{eos if m['role'] == 'assistant' else ''}\n"
                       for m in messages)
        return text + ("assistant: " if generation_prompt else "")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt, **template_kwargs)
    except Exception as e:  # jinja raises its own errors (role order, unsupported roles)
        raise ChatError(f"{template_name(tokenizer)} failed: {e}") from None


def end_of_turn(tokenizer, before: list[dict], **template_kwargs) -> str:
    """The text the template writes after an assistant answer that follows `before`."""
    text = render(tokenizer, before + [{"role": "assistant", "content": SENTINEL}], **template_kwargs)
    at = text.rfind(SENTINEL)
    end = text[at + len(SENTINEL):] if at >= 0 else ""
    if not end.strip():
        raise ChatError(f"{template_name(tokenizer)} gives no end of turn after an assistant answer "
                        f"(rendered: {text[-80:]!r}); the answer's end cannot be trained")
    return end


def split_chat(tokenizer, messages: list[dict], **template_kwargs) -> ChatSplit:
    """Prompt / answer / end-of-turn pieces of a conversation with at least one assistant turn,
    split by the rule above; turns after the last answer are left out (nothing to train).
    Keyword arguments reach the template (e.g. enable_thinking=False for Qwen3)."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ChatError("the conversation has no assistant turn to train")
    last = turns[-1]
    out = ChatSplit()
    head = render(tokenizer, messages[:last], True, **template_kwargs)
    out.pieces = _history(tokenizer, messages, turns[:-1], head, out, **template_kwargs)
    answer = messages[last]["content"]
    full = render(tokenizer, messages[:last + 1], **template_kwargs)
    tail = full[len(head):] if full.startswith(head) else None
    if tail is not None and tail.startswith(answer) and tail[len(answer):].strip():
        end = tail[len(answer):]
    else:
        end = end_of_turn(tokenizer, messages[:last], **template_kwargs)
        out.kept_whole += 1
    out.pieces += [(answer, "answer"), (end, "end")]
    return out


def _history(tokenizer, messages, earlier: list[int], head: str, out: ChatSplit,
             **template_kwargs) -> list[tuple[str, str]]:
    """The last answer's prompt cut into pieces: earlier answers (as the template shows them in
    the history: QwQ-32B without their reasoning) and their ends are trained, the rest is not.
    They are found by rendering the same history with sentinel answers; where the template does
    not show them that way, the whole prompt is context (counted in `untrained_answers`)."""
    if not earlier:
        return [(head, "prompt")]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    marked = [dict(m) for m in messages[:last]]
    for n, i in enumerate(earlier):
        marked[i]["content"] = f"{SENTINEL}{n}Z"
    rest, contexts = render(tokenizer, marked, True, **template_kwargs), []
    for n in range(len(earlier)):
        before, sep, rest = rest.partition(f"{SENTINEL}{n}Z")
        if not sep:
            return _as_context(head, earlier, out)
        contexts.append(before)
    contexts.append(rest)                 # after the last earlier answer, up to the generation prompt
    if not (head.startswith(contexts[0]) and head.endswith(contexts[-1])):
        return _as_context(head, earlier, out)
    pieces, pos, end = [(contexts[0], "prompt")], len(contexts[0]), None
    for n, i in enumerate(earlier):
        nxt = contexts[n + 1]
        at = head.find(nxt, pos) if n + 1 < len(earlier) else len(head) - len(nxt)
        if end is None or not nxt.startswith(end):      # most templates end every turn alike
            end = end_of_turn(tokenizer, messages[:i], **template_kwargs)
        if at < pos or not nxt.startswith(end):
            return _as_context(head, earlier, out)
        pieces += [(head[pos:at], "answer"), (end, "end"), (nxt[len(end):], "prompt")]
        pos = at + len(nxt)
    return [p for p in pieces if p[0]]


def _as_context(head: str, earlier: list[int], out: ChatSplit) -> list[tuple[str, str]]:
    out.untrained_answers += len(earlier)
    return [(head, "prompt")]


def end_of_turn_tokens(tokenizer) -> tuple[int, ...]:
    """The token ids that close a rendered assistant turn under the tokenizer's template (its end
    of turn less whitespace: `<|im_end|>` of `<|im_end|>\\n`, Llama 3's `<|eot_id|>`, Mistral's
    `</s>`); the EOS when the template gives none. What `validate` requires trained."""
    try:
        after = end_of_turn(tokenizer, [{"role": "user", "content": "hi"}])
    except ChatError:
        return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    return tuple(int(i) for i in ids if tokenizer.decode([i]).strip())


def end_of_turn_ids(tokenizer) -> tuple[int, ...]:
    """The EOS and the special token the chat template closes an assistant turn with (a server's
    stop tokens); the EOS alone for a tokenizer without a template."""
    stops = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    if getattr(tokenizer, "chat_template", None):
        try:
            after = end_of_turn(tokenizer, [{"role": "user", "content": "hi"}])
        except ChatError:
            return tuple(stops)
        ids = tokenizer(after, add_special_tokens=False)["input_ids"]
        special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
        first = next((i for i in ids if i in special), None)
        if first is not None and first not in stops:
            stops.append(int(first))
    return tuple(stops)
