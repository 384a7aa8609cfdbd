"""Problem: one finding of `validate` (or of composing a config), with its file and line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    severity: str  # "error" | "warning" | "info"
    file: str | None
    line: int | None
    key: str | None
    message: str
    hint: str | None = None

    def where(self) -> str:
        if self.file is None:
            return "command line"
        return f"{self.file}:{self.line}" if self.line else str(self.file)

    def to_json(self) -> dict[str, Any]:
        return {"severity": self.severity, "file": self.file, "line": self.line, "key": self.key,
                "message": self.message, "hint": self.hint}
