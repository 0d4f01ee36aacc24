"""What every configuration section shares: the one-line error, field help, import paths."""

from __future__ import annotations

import re
from dataclasses import field
from typing import Any

IMPORT_PATH_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


_CREDENTIALS_IN_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\"]*@")


class ConfigError(ValueError):
    """A configuration problem, phrased as one line the user can act on."""

    def __init__(self, key: str, problem: str, fix: str, source: str = "") -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        where = f"{self.source}: " if self.source else ""
        # A URL's user:password (an object-store location, an endpoint) never reaches a message or a log.
        return _CREDENTIALS_IN_URL.sub(r"\1***@", f"{where}{self.key}: {self.problem}. {self.fix}")

    def with_source(self, source: str) -> "ConfigError":
        return ConfigError(self.key, self.problem, self.fix, source)


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)


def is_import_path(value: str) -> bool:
    """True for ``package.module:callable`` references (user components)."""
    return bool(IMPORT_PATH_RE.match(value))
