"""The paper's benchmarks from local files: LongBench's five long-output tasks and AIME problems.

    --bench longbench:FOLDER   FOLDER/<task>.jsonl for gov_report, qmsum, multi_news, lcc and
                               repobench-p (any subset present), or LongBench's data.zip as it is
                               downloaded (its data/<task>.jsonl read from the zip): one JSON object per line with
                               LongBench's fields (`context`, `input`, `answers`, `length`,
                               `dataset`, `language`, `all_classes`, `_id`). Each prompt is the
                               task's instruction (the wording of upstream's benchmark script)
                               as a user turn after a "You are a helpful assistant" system turn,
                               rendered through the target's chat template with the generation
                               prompt, then the task's answer lead ("Summary:", "Answer:").
                               Prompts outside --min-prompt-tokens (1,200) .. --max-prompt-tokens
                               (the target's position limit minus 2,000) are left out, as upstream.
    --bench aime:FILE          JSONL (or a JSON list) of problems, the text in `problem` or
                               `question`, or the set's parquet as downloaded (AI-MO/aimo-validation-aime:
                               `id`, `problem`, `solution`, `answer`, `url`; a file, folder or glob
                               read by formats.datafiles); the chat prompt as upstream's QwQ script builds it.

Nothing is downloaded: the files are LongBench's data.zip (huggingface.co/datasets/THUDM/LongBench)
and an AIME set such as AI-MO/aimo-validation-aime, fetched by the user. A malformed line is an
error naming FILE:LINE, or FILE:row N of a parquet file (exit 3).
"""
from __future__ import annotations

import zipfile
from pathlib import Path

from longspec.measure.prompts import (SYSTEM_PROMPT, Prompt, PromptError, end_of_turn_ids, parse_prompt_text,
                              read_prompt_file)
from longspec.formats import datafiles

LONGBENCH_SOURCE = "LongBench's data.zip from huggingface.co/datasets/THUDM/LongBench (data/<task>.jsonl)"
AIME_SOURCE = "an AIME problem set, e.g. huggingface.co/datasets/AI-MO/aimo-validation-aime (its parquet, or JSONL)"
MIN_PROMPT_TOKENS = 1200
LIMIT_MARGIN = 2000

# task -> (user turn, answer lead after the generation prompt); upstream's inference_long-bench.py
LONGBENCH_TASKS = {
    "gov_report": ("You are given a report by a government agency. Write a one-page summary of the report.\n\n"
                   "Report:\n{context}\n\nNow, write a one-page summary of the report.", "Summary:"),
    "qmsum": ("You are given a meeting transcript and a query containing a question or instruction. "
              "Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\n"
              "Now, answer the query based on the above meeting transcript in one or more sentences.\n\n"
              "Query: {input}", "Answer:"),
    "multi_news": ("You are given several news passages. Write a one-page summary of all news. \n\n"
                   "News:\n{context}\n\nNow, write a one-page summary of all the news.", "Summary:"),
    "lcc": ("Please complete the code given below. \n{context}Now, complete the code given.", ""),
    "repobench-p": ("Please complete the code given below. \n{context}Now, complete the code given.", ""),
}


def parse_bench(spec: str) -> tuple[str, Path]:
    """'longbench:FOLDER' / 'aime:FILE' -> (kind, path); PromptError 2 for anything else."""
    kind, sep, where = spec.partition(":")
    if not sep or kind not in ("longbench", "aime") or not where:
        raise PromptError(f"--bench {spec!r}: give longbench:FOLDER or aime:FILE", 2)
    return kind, Path(where).expanduser()


def _jsonl(path, items=None):
    """(FILE:LINE, object) of a JSONL file (or items of a JSON list); PromptError 3 naming FILE:LINE."""
    for i, obj in (read_prompt_file(Path(path)) if items is None else items):
        if not isinstance(obj, dict):
            raise PromptError(f"{path}:{i}: expected a JSON object, got {type(obj).__name__}", 3)
        yield f"{path}:{i}", obj


def _table_or_jsonl(path: Path):
    """(where, object) of a parquet/arrow set (where: FILE:row N) or of a JSON/JSONL file."""
    try:
        src = datafiles.resolve(path)
        if not src.table:
            yield from _jsonl(path)
            return
        for at, obj in datafiles.iter_rows(src):
            yield str(at), obj
    except datafiles.SourceError as e:
        raise PromptError(e.message, 3, hint=e.hint) from None


def _longbench_files(where: Path) -> dict[str, tuple[str, object]]:
    """task -> (name for messages, (line, object) items) of a LongBench folder or its data.zip."""
    if where.is_dir():
        return {t: (str(where / f"{t}.jsonl"), None) for t in LONGBENCH_TASKS if (where / f"{t}.jsonl").is_file()}
    try:
        with zipfile.ZipFile(where) as z:
            members = {Path(n).name: n for n in sorted(z.namelist(), key=len, reverse=True)}
            out = {}
            for t in LONGBENCH_TASKS:
                if f"{t}.jsonl" in members:
                    name = f"{where}:{members[f'{t}.jsonl']}"
                    out[t] = (name, parse_prompt_text(z.read(members[f"{t}.jsonl"]), name))
            return out
    except (zipfile.BadZipFile, OSError) as e:
        raise PromptError(f"--bench longbench:{where}: not a folder nor a readable zip ({e})", 2,
                          hint=f"nothing is downloaded: get {LONGBENCH_SOURCE}") from None


def _chat(tokenizer, user: str, lead: str) -> list[int]:
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    if getattr(tokenizer, "chat_template", None):
        from longspec.data.chat import ChatError, render

        try:
            text = render(tokenizer, msgs, generation_prompt=True)
        except ChatError as e:
            raise PromptError(str(e), 3) from None
        return tokenizer(text + lead, add_special_tokens=False)["input_ids"]
    return tokenizer(f"{SYSTEM_PROMPT}\n\n{user}\n\n{lead}")["input_ids"]


def longbench_prompts(folder: Path, tokenizer, *, min_tokens: int, max_tokens: int,
                      n: int | None) -> tuple[list[Prompt], dict]:
    """Prompts of every LongBench task file present in `folder` (at most n per task)."""
    if not folder.exists():
        raise PromptError(f"--bench longbench:{folder}: no such folder or zip", 2,
                          hint=f"nothing is downloaded: get {LONGBENCH_SOURCE}")
    files = _longbench_files(folder)
    present = list(files)
    if not present:
        raise PromptError(f"{folder}: none of {', '.join(t + '.jsonl' for t in LONGBENCH_TASKS)}", 2,
                          hint=f"nothing is downloaded: get {LONGBENCH_SOURCE}")
    stops = end_of_turn_ids(tokenizer)
    prompts: list[Prompt] = []
    kept: dict[str, int] = {}
    out_of_range = 0
    for task in present:
        user_fmt, lead = LONGBENCH_TASKS[task]
        path, items = files[task]
        kept[task] = 0
        for at, obj in _jsonl(path, items):
            line = at.rsplit(":", 1)[1]
            for name in ("context",) + (("input",) if "{input}" in user_fmt else ()):
                if not isinstance(obj.get(name), str):
                    raise PromptError(f"{at}: field '{name}' must be a string (LongBench's format)", 3)
            if n is not None and kept[task] >= n:
                continue
            ids = _chat(tokenizer, user_fmt.format(context=obj["context"], input=obj.get("input", "")), lead)
            if not min_tokens < len(ids) <= max_tokens:
                out_of_range += 1
                continue
            kept[task] += 1
            prompts.append(Prompt(ids, f"{task}:{obj.get('_id') or line}", "longbench", task=task, stops=stops))
    if not prompts:
        raise PromptError(f"{folder}: no LongBench prompt between {min_tokens} and {max_tokens} tokens "
                          f"({out_of_range} outside)", 3, hint="--min-prompt-tokens / --max-prompt-tokens set the range")
    return prompts, {"prompt_source": str(folder), "bench": "longbench", "tasks": kept,
                     "prompt_token_range": [min_tokens, max_tokens], "left_out_by_length": out_of_range}


def aime_prompts(path: Path, tokenizer, *, n: int | None) -> tuple[list[Prompt], dict]:
    """Prompts of an AIME-style problem file (`problem` or `question` per object)."""
    if not datafiles.names_data(path):
        raise PromptError(f"--bench aime:{path}: no such file", 2, hint=f"nothing is downloaded: get {AIME_SOURCE}")
    stops = end_of_turn_ids(tokenizer)
    prompts = []
    for at, obj in _table_or_jsonl(path):
        text = obj.get("problem", obj.get("question"))
        if not isinstance(text, str) or not text.strip():
            raise PromptError(f"{at}: needs a string 'problem' or 'question' field", 3)
        if n is None or len(prompts) < n:
            ident = obj.get("id", obj.get("_id", at.rsplit(":", 1)[1]))
            prompts.append(Prompt(_chat(tokenizer, text, ""), f"aime:{ident}", "aime", task="aime", stops=stops))
    if not prompts:
        raise PromptError(f"{path}: no problems", 3)
    return prompts, {"prompt_source": str(path), "bench": "aime", "tasks": {"aime": len(prompts)}}
