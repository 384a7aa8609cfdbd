"""`longspec run`'s measuring process: one `python -m longspec.evaluate --serve` for every stage it
measures, instead of one process per stage.

The process starts (and imports torch and transformers) once; on the CPU it keeps the stages'
shared target loaded between them. Between two measurements it waits on its stdin and holds no
GPU memory (it keeps nothing on a GPU). Each request is the argument list `longspec eval` would
start the module with; its answer is the same result object (launch.trainer's contract: the result,
or the module's own error, or a crash with its last lines).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import deque

from longspec.errors import INTERRUPTED, LongspecError, RefusedError
from longspec.files.tail import last_json
from longspec_cli.launch import trainer


class EvalWorker:
    """Started at the first `measure`, ended by `close` (its stdin closed)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.tail: deque[str] = deque(maxlen=12)
        self.show_progress = False
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "EvalWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, head: list[str]) -> subprocess.Popen:
        """`head --serve`: head is the request's `python -m longspec.evaluate` (its one builder's line)."""
        import os

        env = dict(os.environ)
        root = str(trainer.trainer_root())
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["LONGSPEC_STARTED_AT"] = repr(time.time())      # its `process_start` timing, to the millisecond
        try:
            proc = subprocess.Popen([*head, "--serve"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, env=env,
                                    start_new_session=True)   # the terminal's Ctrl-C is the CLI's to pass on
        except OSError as e:
            raise RefusedError(f"cannot start {' '.join(head)}: {e}") from None
        self._reader = threading.Thread(target=self._echo, args=(proc,), daemon=True)
        self._reader.start()
        return proc

    def _echo(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            line = line.rstrip("\n")
            self.tail.append(line)
            if self.show_progress and line and not trainer._noise(line):
                print(f"  {line}", file=sys.stderr, flush=True)

    def measure(self, argv: list[str], *, show_progress: bool, allow_codes=()) -> dict:
        """The result of `argv` (an evaluate_argv: `python -m longspec.evaluate RUN ...`), measured by
        the worker; the errors of trainer.run_trainer_json."""
        if not trainer.trainer_available():
            raise RefusedError("`longspec.evaluate` needs the trainer's packages (torch, transformers)",
                               hint="pip install 'longspec[train]'")
        if len(argv) < 3 or argv[1] != "-m":
            raise ValueError(f"not a `python -m MODULE ...` line: {argv[:3]}")
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start(argv[:3])
        self.show_progress = show_progress
        self.tail.clear()
        args = argv[3:]
        answer = None
        restore = trainer.forward_sigterm(self.proc)     # a SIGTERM to `run` reaches the measurement too
        try:
            self.proc.stdin.write(json.dumps(args) + "\n")
            self.proc.stdin.flush()
            for line in self.proc.stdout:          # its answer line (a stray line of a library is passed over)
                answer = last_json(line)
                if answer is not None and "exit_code" in answer:
                    break
                answer = None
        except BrokenPipeError:
            pass
        except KeyboardInterrupt:
            self.close(kill=True)
            raise LongspecError("evaluation interrupted", exit_code=INTERRUPTED) from None
        finally:
            restore()
        if answer is None:                          # the process died: its last lines say why
            code = self.proc.wait()
            if self._reader:
                self._reader.join(timeout=5)
            self.proc = None
            detail = "\n".join(t for t in self.tail if t.strip())
            raise LongspecError(f"longspec.evaluate failed (exit {code})" + (f":\n{detail}" if detail else ""),
                                exit_code=1)
        code = int(answer.get("exit_code") or 0)
        if code == 130:
            raise LongspecError("evaluation interrupted", exit_code=INTERRUPTED)
        if "error" in answer and code != 0:
            raise LongspecError(str(answer["error"]), hint=answer.get("hint"), exit_code=code or 1)
        if code != 0 and code not in allow_codes:
            raise LongspecError(f"longspec.evaluate failed (exit {code})", exit_code=1)
        return answer.get("result") or {}

    def close(self, kill: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if kill:
                proc.kill()
            else:
                proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
