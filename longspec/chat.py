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

Several assistant turns are split in order; the text between two answers is what the template
renders for the turns in between (untrained). When the template re-renders earlier turns
differently once later turns exist (Mistral moves the system text into the last user turn), the
sequence restarts from the later prompt and the earlier answers become untrained context; the
count is kept (`restarts`) so that `prepare --show` can say so.

`split_chat` is the one public entry: prompt / answer pieces for a conversation, used by the
stage collators (longspec.data) and by evaluation prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SENTINEL = "LONGSPECSENTINELANSWER"
# Piece kinds: "prompt" (system, user, default system text, headers) is not trained; "answer" and
# "end" (the end-of-turn text) are.
TRAINED_KINDS = ("answer", "end")


class ChatError(ValueError):
    """A conversation the template cannot split (no end of turn, a template error, no answer)."""


@dataclass
class ChatSplit:
    pieces: list[tuple[str, str]] = field(default_factory=list)   # (text, kind) in order
    restarts: int = 0           # earlier answers turned into context (template re-rendered them)
    kept_whole: int = 0         # answers the template rewrote: the record's text + its end of turn

    @property
    def prompt(self) -> str:
        """Everything before the last answer (the generation prompt for it)."""
        last = max(i for i, (_, k) in enumerate(self.pieces) if k == "answer")
        return "".join(t for t, _ in self.pieces[:last])


def template_name(tokenizer) -> str:
    """A short name for messages: the tokenizer's folder."""
    return str(getattr(tokenizer, "name_or_path", "") or "the tokenizer") + "'s chat template"


def render(tokenizer, messages: list[dict], generation_prompt: bool = False, **template_kwargs) -> str:
    """The tokenizer's own chat template (transformers' apply_chat_template), as text."""
    if not getattr(tokenizer, "chat_template", None):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
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
    each assistant turn split by the rule above. Keyword arguments reach the template
    (e.g. enable_thinking=False for Qwen3)."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ChatError("the conversation has no assistant turn to train")
    out = ChatSplit()
    emitted = ""          # the text of the pieces so far
    reference = ""        # the template's own rendering of the conversation up to the last answer
    for k in turns:
        before = messages[:k]
        head = render(tokenizer, before, True, **template_kwargs)
        if head.startswith(reference) and reference:
            context = head[len(reference):]
        elif head.startswith(emitted):
            context = head[len(emitted):]
        else:                                     # earlier turns re-rendered: restart from here
            out.restarts += sum(1 for _, kind in out.pieces if kind == "answer")
            out.pieces, emitted, context = [], "", head
        answer = messages[k]["content"]
        full = render(tokenizer, messages[:k + 1], **template_kwargs)
        tail = full[len(head):] if full.startswith(head) else None
        if tail is not None and tail.startswith(answer) and tail[len(answer):].strip():
            end = tail[len(answer):]
        else:
            end = end_of_turn(tokenizer, before, **template_kwargs)
            out.kept_whole += 1
        new = [(context, "prompt"), (answer, "answer"), (end, "end")]
        out.pieces += [p for p in new if p[0]]
        emitted += context + answer + end
        reference = full
    return out
