"""Figures for `longspec monitor` on a run whose metrics.jsonl holds 200,000 records.

    .venv/bin/python bench/bench_monitor.py [--records 200000] [--idle-s 10]

Runs the real command in a pseudo-terminal (120x40) and prints:
  first_screen_s     process start -> the last step shown on screen (Python start, imports included)
  app_first_paint_s  in-process: app created -> first screen painted           (target < 1 s)
  history_loaded_s   in-process: app created -> the whole history charted      (background)
  idle_cpu_percent   CPU of the monitor over --idle-s while the run writes nothing (target < 3 %)
  new_record_s       a record appended -> its step on screen, median of 5      (target < 1 s)
The *_cpu_s twins are CPU seconds spent meanwhile: on a shared, oversubscribed machine they say
more than wall-clock seconds, which then mostly measure the wait for a core.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import pty
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.tui import fixtures as F  # noqa: E402


def build(root: Path, records: int) -> Path:
    """A project whose base stage is running (this process stands in for the trainer)."""
    F.make_project(root, name="bench")
    out = F.write_run(root, "base", steps=10, total=2 * records, done=False, alive_pid=True)
    F.big_metrics(out / "metrics.jsonl", records, total=2 * records)
    return out


class PtyApp:
    def __init__(self, argv: list[str], cols: int = 120, rows: int = 40):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(cols), LINES=str(rows))
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT,
                                     start_new_session=True)
        os.close(slave)
        self.master = master
        self.buf = bytearray()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            with self.lock:
                self.buf += data

    def wait_for(self, text: str, start: int = 0, timeout: float = 20.0) -> float | None:
        """Seconds until `text` appears in the output after byte `start`, or None."""
        needle = text.encode()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            with self.lock:
                if self.buf.find(needle, start) >= 0:
                    return time.perf_counter()
            time.sleep(0.005)
        return None

    def mark(self) -> int:
        with self.lock:
            return len(self.buf)

    def quit(self) -> None:
        os.write(self.master, b"q")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self.master)


def cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def in_process(root: Path) -> dict[str, float | None]:
    from longspec_cli.tui.monitor_app import MonitorApp

    async def go():
        t0 = time.perf_counter()
        app = MonitorApp(root)
        async with app.run_test(size=(120, 40)) as pilot:
            while not app.history_done.is_set():
                await pilot.pause(0.02)
            await pilot.pause(0.6)  # the poll loop merges the history and posts a view
            return {"app_first_paint_s": app.first_paint_s, "app_first_paint_cpu_s": app.first_paint_cpu_s,
                    "history_loaded_s": time.perf_counter() - t0}

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--idle-s", type=float, default=10.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-monitor-"))
    try:
        root = tmp / "bench"
        t = time.perf_counter()
        out = build(root, args.records)
        size_mb = (out / "metrics.jsonl").stat().st_size / 1e6
        print(f"fixture: {args.records} records, {size_mb:.1f} MB, built in {time.perf_counter() - t:.1f} s")
        figures: dict[str, float | None] = {}
        figures.update(in_process(root))

        app = PtyApp([sys.executable, "-m", "longspec_cli", "monitor", str(root)])
        last = f"{args.records:,} / {2 * args.records:,}"
        seen = app.wait_for(last)
        figures["first_screen_s"] = None if seen is None else seen - app.t0
        figures["first_screen_cpu_s"] = cpu_seconds(app.proc.pid)
        time.sleep(2.0 + 1.5 * figures["history_loaded_s"])  # history and first status load in the background
        c0, w0 = cpu_seconds(app.proc.pid), time.perf_counter()
        time.sleep(args.idle_s)
        figures["idle_cpu_percent"] = 100 * (cpu_seconds(app.proc.pid) - c0) / (time.perf_counter() - w0)

        lat = []
        for k in range(1, 6):
            step = args.records + k
            rec = F.step_record(step, 2 * args.records)
            start = app.mark()
            t = time.perf_counter()
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            seen = app.wait_for(f"{step:,} / {2 * args.records:,}", start, timeout=10)
            lat.append(float("inf") if seen is None else seen - t)
            time.sleep(0.7)
        figures["new_record_s"] = statistics.median(lat)
        figures["new_record_max_s"] = max(lat)
        app.quit()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for k, v in figures.items():
        print(f"{k:20s} {'n/a' if v is None else f'{v:.3f}'}")


if __name__ == "__main__":
    main()
