"""What the prose says a default is, it is: every sentence of README.md and docs/ that names a config key's default
agrees with the config itself (the source of the generated reference), so a default that changes cannot leave a
guide behind it (README once said in-process recovery was not built while the reference had it on by default).

A claim is one of the shapes the pages use:

- `` `recovery.in_process: auto`, the default `` — also ``(the default)``, and ``(the defaults)`` after several
  `` `key: value` `` joined by "and" or commas;
- `` `recovery.straggler_ratio` (default 1.3) `` — also ``(default: 1.3)``, ``, default `X` ``, a unit after a
  number (``60 s``, ``60s``); a bare word there (``default behaviour``) is no claim, a backticked one is;
- `` `snapshot.verify`, on by default `` — also ``is off by default``;
- ``by default (`snapshot.mode: private`)``.

A key is written in full (``section.key``) or by its name alone where no other section has one of that name; a full
key of a known section that the config does not have (renamed, removed) is a contradiction too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from elastic_runner.config import Config

from ..support import ROOT

PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "reference" not in p.parts)]

_SPAN = r"`([a-z_]+(?:\.[a-z_]+)?): ([^`]+)`"
_THE_DEFAULT = re.compile(r"((?:" + _SPAN + r"(?:,? and |, ))*" + _SPAN + r"),? \(?the defaults?\b")
_BY_DEFAULT = re.compile(r"by default \(" + _SPAN + r"\)")
_VALUE = r"(`[^`]+`|-?\d[\w.+-]*(?: ?(?:s|ms|%)\b)?|true\b|false\b|null\b|none\b|on\b|off\b)"
_DEFAULT_VALUE = re.compile(r"`([a-z_]+(?:\.[a-z_]+)?)`(?: \(|, )default:? " + _VALUE)
_ON_OFF = re.compile(r"`([a-z_]+(?:\.[a-z_]+)?)`\)?,? (?:is )?\(?(on|off) by default\b")


def defaults() -> dict[str, Any]:
    """Every key's default, by its full name and by its name alone where that name is unique."""
    full = {f"{section}.{key}": value for section, values in Config().to_dict().items()
            for key, value in values.items()}
    names: dict[str, list[str]] = {}
    for key in full:
        names.setdefault(key.split(".", 1)[1], []).append(key)
    return full | {name: full[keys[0]] for name, keys in names.items() if len(keys) == 1}


def claims(text: str) -> Iterator[tuple[str, str, int]]:
    """(key, claimed default, line) for each claim in a page's text; a claim may wrap across lines."""
    for paragraph in re.finditer(r"(?:[^\n]+\n?)+", text):
        flat, first_line = " ".join(paragraph.group(0).split()), text.count("\n", 0, paragraph.start()) + 1
        for match in _THE_DEFAULT.finditer(flat):
            for key, value in re.findall(_SPAN, match.group(1)):
                yield key, value, first_line
        for match in _BY_DEFAULT.finditer(flat):
            yield match.group(1), match.group(2), first_line
        for match in _DEFAULT_VALUE.finditer(flat):
            yield match.group(1), match.group(2).strip("`"), first_line
        for match in _ON_OFF.finditer(flat):
            yield match.group(1), "true" if match.group(2) == "on" else "false", first_line


def agrees(claimed: str, default: Any) -> bool:
    number = re.fullmatch(r"(-?\d[\d.]*(?:e[+-]?\d+)?) ?(?:s|ms|%)?", claimed)
    if number is not None and isinstance(default, (int, float)) and not isinstance(default, bool):
        return float(number.group(1)) == float(default)
    try:
        value = None if claimed.lower() == "none" else yaml.safe_load(claimed)
    except yaml.YAMLError:
        value = claimed
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    return value == default


def contradictions(text: str, known: dict[str, Any]) -> list[str]:
    sections = {key.split(".", 1)[0] for key in known if "." in key}
    found = []
    for key, claimed, line in claims(text):
        where = f"the paragraph at line {line}: `{key}`"
        if key in known and not agrees(claimed, known[key]):
            found.append(f"{where} said to default to {claimed!r}, but its default is {known[key]!r}")
        elif key not in known and "." in key and key.split(".", 1)[0] in sections:
            found.append(f"{where} said to default to {claimed!r}, but the config has no such key")
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_page_says_a_default_that_the_config_does_not_have(page: Path) -> None:
    found = contradictions(page.read_text(), defaults())
    assert not found, f"{page.relative_to(ROOT)} (fix the sentence or the default; the reference is generated " \
        "from the config): " + "; ".join(found)


def test_the_defaults_users_ask_about_most_are_stated_and_checked() -> None:
    """Not a check of nothing: the pages do state these defaults in the shapes above."""
    known = defaults()
    stated = {key if "." in key else next(k for k in known if k.endswith("." + key))
              for page in PAGES for key, _, _ in claims(page.read_text()) if key in known}
    assert {"recovery.in_process", "dist.gradient_sync", "snapshot.memory_every_steps"} <= stated, sorted(stated)


@pytest.mark.parametrize("sentence", [
    "`recovery.in_process: true`, the default, keeps the survivors' processes.",
    "with `parallel.strategy: ddp` and `dist.gradient_sync: ddp` (the defaults) every replica",
    "the shards are copied every `snapshot.memory_every_steps`\n(default 10) steps",
    "Loading checks the checksum (`snapshot.verify`, off by default).",
    "`memory_every_steps: 50` (the default) refreshes",
    "a rank 1.3 times slower (`recovery.straggler_window_seconds`, default: 30 s) is named",
    "`recovery.straggler_window_seconds` (default 30s)",
    "files are shared by default (`snapshot.mode: shared`)",
    "the check (`snapshot.verify`) is off by default",
    "`recovery.no_such_key: true` (the default) does a thing",
])
def test_a_sentence_that_contradicts_a_default_is_caught(sentence: str) -> None:
    assert len(contradictions(sentence, defaults())) == 1, list(claims(sentence))


def test_a_sentence_that_agrees_or_names_no_config_key_passes() -> None:
    text = ("`recovery.in_process: auto`, the default, and `snapshot.verify`, on by default; `--shutdown_timeout` "
            "(default 30) is torch's; `every_steps: 7` (the default) names a key of several sections; "
            "`recovery.straggler_window_seconds` (default: 60 s) and `recovery.straggler_ratio` (default 1.3); "
            "`snapshot.dir`, default behaviour is the run's; private by default (`snapshot.mode: private`); "
            "`map_location` (default CPU) is load_model's.")
    assert contradictions(text, defaults()) == [] and len(list(claims(text))) == 6, list(claims(text))
