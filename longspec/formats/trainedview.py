"""`prepare --show`: a stage's first records with the trained tokens marked.

The trainer side (`python -m longspec.show`) encodes the records and returns each token as
[id, text, trained]; this module only lays them out: brackets around trained spans for a pipe or
a file, colour (rich) on a terminal.
"""

from __future__ import annotations

OPEN, CLOSE = "[", "]"


def header(rec: dict) -> str:
    """`record 0 (line 1): 40 prompt, 12 trained, 0 cut tokens` plus what a reader should know."""
    at = f"line {rec['line']}" if isinstance(rec["line"], int) else rec["line"]      # a table row: FILE:row N
    text = (f"record {rec['index']} ({at}): {rec['prompt']:,} prompt, "
            f"{rec['trained']:,} trained, {rec['cut']:,} cut tokens")
    notes = []
    if rec.get("chat") and not rec.get("end_of_turn_trained"):
        notes.append("no end of turn trained")
    if rec.get("untrained_answers"):
        notes.append(f"{rec['untrained_answers']} earlier answer(s) left as context by the template")
    return text + (f" ({'; '.join(notes)})" if notes else "")


def spans(rec: dict) -> list[tuple[str, bool]]:
    """The record's text as runs of (text, trained)."""
    out: list[tuple[str, bool]] = []
    for _, text, trained in rec["tokens"]:
        if out and out[-1][1] == trained:
            out[-1] = (out[-1][0] + text, trained)
        else:
            out.append((text, trained))
    return out


def plain(rec: dict) -> str:
    """The record's text with trained spans in brackets."""
    return "".join(f"{OPEN}{t}{CLOSE}" if trained else t for t, trained in spans(rec))


def rich_text(rec: dict):
    """The record's text for a terminal: trained spans green on a dark background, the rest dim."""
    from rich.text import Text

    out = Text()
    for t, trained in spans(rec):
        out.append(t, style="bold green on grey15" if trained else "dim")
    return out


def legend() -> str:
    return (f"trained tokens are in {OPEN}brackets{CLOSE} (colour on a terminal); prompt tokens are "
            "read, not trained; cut tokens fell past max_seq_length or the prompt cap")
