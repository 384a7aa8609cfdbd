"""Regenerate a stage's answers with its own target, so the draft learns what the target writes.

    python -m longspec.regenerate --config-dir DIR/conf +exp=STAGE [key=value ...] --out DIR
        [--server URL ...] [--api-key-env NAME ...] [--concurrency N] [--api completions|chat] [--batch N]
        [--prefix-tokens N] [--max-new-tokens N] [--shard-rows N] [--limit N] [--server-wait S]
        [--idle-timeout S] [--retries N] [--served-model NAME]
        [--keep-truncated] [--force] [--json] [--rerun COMMAND]

Reads the stage's train_file (longspec.data.records), asks the target (longspec.decode.engines:
greedy on the local target, or OpenAI-compatible servers with --server) by the prompt rules of
longspec.data.regen, and writes OUT as ordered parquet shards plus manifest.json
(longspec.data.regenstore), through the loop of longspec.decode.regenloop. A rerun first asks the rows that failed again (put back in their
shards), then resumes after the last complete shard; another source, target or setting is refused
(exit 1, the reason) unless --force. A server that gives no answer leaves the rotation
(longspec.decode.servers); when none has answered for --server-wait seconds (60) the run stops.
A server's key comes from the environment only (OPENAI_API_KEY, or the variable --api-key-env
names: longspec.project.serverkeys), goes to its server's origin alone (a redirect is not
followed) and is shown nowhere (what a server writes back is cut short and masked); a 401 or
403 stops the run at once. One run per folder: a second one is refused (exit 1), naming the first.

Servers (longspec.decode.engines): the served model must be the stage's target (--served-model
NAME takes another on purpose); every wait before the first row is bounded by --server-wait;
answers stream, and a request with no byte for --idle-timeout seconds (120) is abandoned and tried
again (--retries more times, 5; Retry-After honoured up to 120 s); an answer that cannot be kept
(empty, over its token limit or its byte bound, text the tokenizer refuses) fails its row.

Exit codes: 0 done, 1 refused (a config error, a key a server refused), 3 unreadable input,
5 stopped by SIGTERM, 6 stopped because no server answered for --server-wait seconds, 7 done but
rows failed (a rerun asks them again), 130 stopped by SIGINT (5, 6 and 130 after writing the rows
done so far).
--rerun is the command the messages and the manifest name to go on (`longspec regenerate` passes
its own). Progress on stderr; --json prints the summary as one JSON line on stdout.
"""
from __future__ import annotations

import itertools
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from longspec.data import regen as R
from longspec.data import regenstore as S
from longspec.runs.regenstate import Progress, clear_progress, hold, summary_text
from longspec.errors import ROWS_FAILED, SERVERS_GONE

EXIT_REFUSED, EXIT_INPUT, EXIT_TERM, EXIT_INT = 1, 3, 5, 130
EXIT_SERVERS, EXIT_FAILED = SERVERS_GONE, ROWS_FAILED           # 6, 7 (longspec.errors)
INT_FLAGS = ("concurrency", "batch", "prefix-tokens", "max-new-tokens", "shard-rows", "limit", "window",
             "server-wait", "idle-timeout", "retries")
DEFAULTS = {"out": None, "server": [], "api-key-env": [], "api": "completions", "concurrency": 4, "batch": 8,
            "prefix-tokens": 128, "max-new-tokens": None, "shard-rows": 1000, "limit": None, "window": None, "server-wait": 60,
            "idle-timeout": 120, "retries": 5, "served-model": None, "keep-truncated": False, "force": False, "json": False, "rerun": None}
FLAGS: dict = {}
STOP: list[int] = []          # the exit code a stop signal asked for
REFUSED: list[str] = []       # a server refused the key (401/403): the run stops, this is why
HELD: list = []               # the folder's lock, held until the process exits


def take_flags(argv: list[str]) -> tuple[list[str], dict]:
    """(Hydra's arguments, this module's flags)."""
    flags = {k: (list(v) if isinstance(v, list) else v) for k, v in DEFAULTS.items()}
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a[2:].partition("=") if a.startswith("--") else ("", "", "")
        if name in ("keep-truncated", "force", "json") and not eq:
            flags[name] = True
        elif name in DEFAULTS and name not in ("keep-truncated", "force", "json"):
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"error: {a} needs a value")
                value, i = argv[i + 1], i + 1
            if name in ("server", "api-key-env"):
                flags[name].append(value)
            elif name in INT_FLAGS:
                if not value.isdigit() or int(value) < (0 if name == "retries" else 1):
                    raise SystemExit(f"error: --{name} {value}: a {'' if name == 'retries' else 'positive '}whole number")
                flags[name] = int(value)
            else:
                flags[name] = value
        else:
            out.append(a)
        i += 1
    return out, flags


# ----------------------------------------------------------------------------- the run

def run(cfg) -> dict:
    from longspec.data.encoding import load_tokenizer
    from longspec.decode.regenloop import embedded_rows, served_rows
    from longspec.training.entry import TrainError, read_config

    conf = read_config(cfg)
    target, train_file = Path(conf["model_name_or_path"]), Path(conf["train_file"])
    collator, max_seq = conf["data"]["collator"], int(conf["data"]["max_seq_length"])
    out = Path(FLAGS["out"] or Path("data") / "regen" / conf["stage"]).absolute()
    settings = {"max_seq_length": max_seq, "prefix_tokens": FLAGS["prefix-tokens"],
                "max_new_tokens": FLAGS["max-new-tokens"], "temperature": 0,
                "chat_template_kwargs": R.CHAT_TEMPLATE_KWARGS, "keep_truncated": FLAGS["keep-truncated"]}
    lock, holder = hold(out)
    if lock is None:
        raise S.RegenRefused(f"{out}: another regeneration writes this folder: {holder}; wait for it to end, or stop "
                             "it, then run this again (one run per stage, --force or not)")
    HELD.append(lock)
    S.refuse_own_output(train_file, out)
    expect = S.expectations(train_file, target, collator, settings, R.PROMPT_RULE)
    start, totals, retry = S.open_folder(out, expect, FLAGS["force"])
    out.mkdir(parents=True, exist_ok=True)
    total = R.count_records(train_file, FLAGS["limit"])
    tok = load_tokenizer(target)
    engine = _engine(target, tok, max_seq)
    rerun = FLAGS["rerun"]
    S.write_manifest(out, expect, engine.describe(), totals, total, start,
                     start >= total and not retry, rerun)
    writer = S.OrderedWriter(out, collator, start, FLAGS["shard-rows"], FLAGS["keep-truncated"], totals)
    prompter = R.Prompter(tok, max_seq, FLAGS["prefix-tokens"], FLAGS["max-new-tokens"])
    # the failed rows of the shards first (asked again), then the records after the last shard
    rows = (r for r in itertools.takewhile(lambda r: r.index < total,
                                           R.source_rows(train_file, collator, min(retry, default=start)))
            if r.index >= start or r.index in retry)
    progress = Progress(conf["stage"], start, total, writer, out)
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    t0, redone = time.monotonic(), []
    try:
        if engine.kind == "server":
            progress.engine = engine
            done = served_rows(engine, prompter, rows, FLAGS["window"], lambda: bool(STOP), REFUSED, progress.tick)
        else:
            done = embedded_rows(engine, prompter, rows, lambda: bool(STOP))
        for row in done:
            try:
                R.check_trainable(row, tok, collator, max_seq, FLAGS["keep-truncated"])   # as prepare will read it
            except Exception as e:                     # noqa: BLE001 (a tokenizer that refuses the text)
                row.status, row.reason = "failed", f"the target's tokenizer cannot take the row ({type(e).__name__})"
            if row.index < start:
                redone.append(row)
                continue
            if redone:
                writer.problems += S.patch_shards(out, collator, FLAGS["keep-truncated"], redone, writer.totals)
                redone = []
            writer.put(row)
            progress.tick()
    except OSError as e:
        raise TrainError(f"{out}: cannot write ({e.strerror or e})") from None
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        writer.flush()                                 # what is done is kept, in order
        if redone:
            writer.problems += S.patch_shards(out, collator, FLAGS["keep-truncated"], redone, writer.totals)
        gone = engine.kind == "server" and engine.gone
        if engine.kind == "server":
            engine.close()
        complete = not (STOP or REFUSED or gone) and writer.next >= total and not writer.totals.get("failed")
        S.write_manifest(out, expect, engine.describe(), writer.totals, total, writer.next, complete, rerun)
        progress.end()
    if not STOP:
        clear_progress(out)                            # ended by itself: the manifest says how
    if REFUSED:
        from longspec.decode.engines import KeyRefused

        raise KeyRefused(f"{REFUSED[0]}; the rows done are kept ({writer.next}/{total} records), "
                         "the same command goes on once the key is right")
    seconds = time.monotonic() - t0
    made = writer.totals["completion_tokens"] - progress.tokens0
    return {"stage": conf["stage"], "out": str(out), "engine": engine.describe(), "records": total,
            "done": writer.next, "resumed_at": start, "complete": complete, **writer.totals,
            "seconds": round(seconds, 2), "rows_per_s": round((writer.next - start) / max(seconds, 1e-9), 3),
            "tokens_per_s": round(made / max(seconds, 1e-9), 1), "problems": writer.problems, "rerun": rerun,
            **({"stopped_by": "SIGINT" if STOP[0] == EXIT_INT else "SIGTERM"} if STOP else {}),
            **({"stopped_by": "servers", "message": engine.rotation.gone_message()} if gone and not STOP else {})}


def _engine(target: Path, tok, max_seq: int):
    from longspec.decode.engines import EmbeddedEngine, ServerEngine

    if FLAGS["server"]:
        return ServerEngine(FLAGS["server"], FLAGS["concurrency"], FLAGS["api"], idle=FLAGS["idle-timeout"],
                            retries=FLAGS["retries"], template_kwargs=R.CHAT_TEMPLATE_KWARGS,
                            wait=FLAGS["server-wait"], key_envs=FLAGS["api-key-env"], target=str(target),
                            max_seq_length=max_seq, served_model=FLAGS["served-model"])
    return EmbeddedEngine(target, tok, FLAGS["batch"])


def _on_signal(signum, frame) -> None:
    if STOP:                                           # a second signal: stop at once
        raise KeyboardInterrupt
    STOP.append(EXIT_INT if signum == signal.SIGINT else EXIT_TERM)
    print(f"\nregenerate: {signal.Signals(signum).name}: writing the rows done so far", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- entry point

def guarded(cfg) -> int:
    from longspec.data.encoding import DataError
    from longspec.decode.engines import EngineError
    from longspec.training.entry import EXIT_ERROR, tool_boundary

    def code_of(e: BaseException) -> int:
        if isinstance(e, (S.RegenRefused, EngineError)):
            return EXIT_REFUSED
        return EXIT_INPUT if isinstance(e, DataError) else EXIT_ERROR

    code, r = tool_boundary(run, cfg, json_out=FLAGS["json"], extra_errors=(EngineError,), code_of=code_of)
    if r is not None:
        if FLAGS["json"]:
            print(json.dumps(r), flush=True)
        print(summary_text(r), file=sys.stderr, flush=True)
        if r.get("stopped_by") == "servers":
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_SERVERS)                     # requests in flight are abandoned, not waited for
        if r["failed"] and not STOP:
            code = EXIT_FAILED
    if STOP:
        # A server's requests still in flight are abandoned: their threads are not waited for.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(STOP[0])
    return code


def main() -> None:
    from longspec.training.entry import implied_config_dir, make_hydra_entry
    from longspec.machine import cudaarch

    cudaarch.fix_environ()                       # an arch list DeepSpeed can parse, if it builds an op
    argv, flags = take_flags(sys.argv[1:])
    FLAGS.update(flags)
    if FLAGS["rerun"] is None:
        FLAGS["rerun"] = shlex.join(["python", "-m", "longspec.regenerate",
                                     *(a for a in sys.argv[1:] if a != "--force")])
    sys.argv = [sys.argv[0]] + implied_config_dir(argv)
    make_hydra_entry(guarded)()


if __name__ == "__main__":
    main()
