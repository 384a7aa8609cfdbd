"""Follow a growing text file by byte offset: the one file tailer (train.log in the monitor and in
`run`'s echo, metrics.jsonl through runfolder.MetricsTail). Pure: standard library only.

Made for run folders on a shared file system written by another node: every poll is one
`os.stat`; the file is opened only when its size changed (NFS close-to-open consistency then
gives fresh data). Only complete lines are returned: a partial last line stays on disk and is
read again once its newline arrives. Truncation (size below our offset), replacement (another
inode, or other first bytes: copy-and-truncate rotation) and deletion are reported, and reading
restarts from the beginning of the new file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

HEAD_BYTES = 64  # first bytes remembered to notice a file replaced in place
READ_CAP = 4 << 20  # bytes read per poll at most: the UI stays responsive on a huge backlog


@dataclass
class TailRead:
    lines: list[str] = field(default_factory=list)
    reset: str | None = None  # None | "truncated" | "replaced" | "deleted"
    more: bool = False  # READ_CAP reached: poll again at once
    missing: bool = False  # the file does not exist (now)


class LineTail:
    def __init__(self, path: str | os.PathLike, *, read_cap: int = READ_CAP):
        self.path = Path(path)
        self.read_cap = read_cap
        self.offset = 0  # start of the first line not yet returned
        self._ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the file being followed
        self._size = -1  # size at the last read (-1: never read)
        self._head = b""
        self.history_end = 0  # see start_at_end

    @property
    def exists(self) -> bool:
        return self._ident is not None

    def start_at_end(self, max_lines: int, max_bytes: int = 1 << 20) -> list[str]:
        """Jump to the end of the file; return its last `max_lines` complete lines.

        Afterwards `self.offset` is the end of the last complete line and `self.history_end` the
        start of the first returned line: bytes before it are history to load in the background.
        """
        self.history_end = 0
        try:
            st = os.stat(self.path)
            with open(self.path, "rb") as f:
                self._head = f.read(HEAD_BYTES)
                start = max(0, st.st_size - max_bytes)
                f.seek(start)
                block = f.read(st.st_size - start)
        except FileNotFoundError:
            return []
        self._ident, self._size = (st.st_dev, st.st_ino), st.st_size
        if start > 0:  # the block starts inside a line: drop that piece
            cut = block.find(b"\n") + 1
            block, start = block[cut:], start + cut
        end = block.rfind(b"\n") + 1  # 0 if no complete line
        lines = block[:end].split(b"\n")[:-1]
        keep = lines[-max_lines:] if max_lines > 0 else []
        self.history_end = start + end - sum(len(x) + 1 for x in keep)
        self.offset = start + end
        return [x.decode("utf-8", "replace") for x in keep]

    def poll(self) -> TailRead:
        out = TailRead()
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._ident is not None:
                out.reset = "deleted"
            self._forget()
            out.missing = True
            return out
        ident = (st.st_dev, st.st_ino)
        if self._ident is not None and ident != self._ident:
            out.reset = "replaced"
            self._forget()
        elif st.st_size < self.offset:
            out.reset = "truncated"
            self._forget()
        if ident == self._ident and st.st_size == self._size:
            return out  # idle: one stat, nothing read
        try:
            with open(self.path, "rb") as f:
                head = f.read(HEAD_BYTES)
                if self._head and head[: len(self._head)] != self._head[: len(head)]:
                    out.reset = out.reset or "replaced"
                    self.offset = 0
                self._head = head
                f.seek(self.offset)
                block = f.read(min(self.read_cap, max(0, st.st_size - self.offset)))
        except FileNotFoundError:
            out.reset = out.reset or ("deleted" if self._ident else None)
            self._forget()
            out.missing = True
            return out
        self._ident = ident
        out.more = self.offset + len(block) < st.st_size
        end = block.rfind(b"\n") + 1
        if end == 0 and len(block) >= self.read_cap:  # one line longer than the cap: skip it
            end = len(block)
        self.offset += end
        self._size = -1 if out.more else st.st_size
        if end:
            out.lines = [x.decode("utf-8", "replace") for x in block[:end].split(b"\n")[:-1]]
        return out

    def rest(self) -> str:
        """What follows the last complete line (a last line without its newline); read once."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                block = f.read()
        except FileNotFoundError:
            return ""
        self.offset += len(block)
        return block.decode("utf-8", "replace")

    def _forget(self) -> None:
        self._ident, self._size, self.offset, self._head = None, -1, 0, b""


def read_range_chunks(path: str | os.PathLike, end: int, chunk: int = 4 << 20):
    """Complete lines (bytes, no newline) in bytes [0, end) of a file, a list per chunk read."""
    with open(path, "rb") as f:
        pos, rest = 0, b""
        while pos < end:
            block = f.read(min(chunk, end - pos))
            if not block:
                break
            pos += len(block)
            block = rest + block
            cut = block.rfind(b"\n") + 1
            rest = block[cut:]
            yield block[:cut].split(b"\n")[:-1]


def last_lines(path: str | os.PathLike, n: int, *, since: int = 0, max_bytes: int = 64 * 1024) -> list[str]:
    """The last `n` lines written after byte `since` (a last line without its newline included)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(since, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-n:]


def last_json(text: str | None) -> dict | None:
    """The last line of `text` that is a JSON object: the result line a trainer module prints last
    (`--json`), after whatever progress and warnings came before it."""
    import json

    for line in reversed((text or "").strip().splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return None
