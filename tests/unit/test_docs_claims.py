"""What README and the documentation say about defaults and capabilities, held against the code.

A sentence that states a default (```recovery.in_process: auto``, the default``, ```snapshot.verify``, on by
default``, ``launch gives a restart budget of 100``) is checked against the value the code has; a page that says
something is not built, measured or run yet says it in a section about what is missing, where the change that
builds it will find it — never in the README, which says what exists."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from elastic_runner.agent.launch import MAX_RESTARTS_DEFAULT, RDZV_DEFAULTS
from elastic_runner.config import SECTIONS

from ..support import ROOT

#: The prose a user reads: README and the site, less the generated reference (the code's own words) and the changelog
#: (what was true then).
PAGES = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").rglob("*.md"))
                               if "reference" not in p.parts and p.name != "changelog.md")]
#: Defaults that a page may describe by what they mean rather than by their value.
DESCRIBED = {"snapshot.dir"}  # None: RUN_DIR/snapshots


def defaults() -> dict[str, Any]:
    out = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            out[f"{section}.{f.name}"] = value
    return out


def prose(page: Path) -> str:
    """The page with its lines joined (a sentence may wrap anywhere) and code blocks left out."""
    return re.sub(r"```.*?```", " ", page.read_text(), flags=re.S).replace("\n", " ")


def stated_defaults(text: str, keys: set[str]) -> Iterator[tuple[str, str, str]]:
    """(key, value as written, the words around it) for each sentence of ``text`` that states a key's default; a
    key may be written without its section where its name is one section's only (``memory_every_steps``)."""
    fields: dict[str, list[str]] = {}
    for k in keys:
        fields.setdefault(k.split(".", 1)[1], []).append(k)
    key = r"`(?P<key>(?:[a-z_]+\.)?[a-z_]+)"
    patterns = [
        key + r": (?P<value>[^`]+)`(?:, | \(| is | )(?:the |its |by )default\b",  # `k: v`, the default
        key + r"`,? (?:default|defaults to) `?(?P<value>[\w.\-]+)`?",  # `k`, default 6 / `k` defaults to `v`
        key + r"`,? (?P<value>on|off) by default\b",  # `k`, on by default
    ]
    for pattern in patterns:
        for m in re.finditer(pattern, text):
            name = m.group("key")
            full = name if name in keys else (fields.get(name, []) + [""])[0] if len(fields.get(name, [])) == 1 else ""
            if full:
                yield full, m.group("value"), text[max(0, m.start() - 40):m.end() + 20]


def same(written: str, default: Any) -> bool:
    value: Any = {"on": True, "off": False}.get(written, None)
    if value is None:
        try:
            value = yaml.safe_load(written)
        except yaml.YAMLError:
            value = written
    return value == default or str(value) == str(default)


def test_every_default_a_page_states_is_the_codes() -> None:
    values = defaults()
    stated, wrong = 0, []
    for page in PAGES:
        for key, written, context in stated_defaults(prose(page), set(values)):
            if key in DESCRIBED:
                continue
            stated += 1
            if not same(written, values[key]):
                wrong.append(f"{page.relative_to(ROOT)}: {key} is {values[key]!r} in the code, the page says "
                             f"{written!r}: …{context}…")
    assert not wrong, "\n".join(wrong)
    assert stated >= 8, f"only {stated} stated defaults found: has the phrasing changed? (the patterns find too few)"


@pytest.mark.parametrize(("claim", "value"), [
    ("recovery.in_process", "auto"), ("dist.gradient_sync", "ordered"), ("snapshot.memory_every_steps", "auto"),
])
def test_the_defaults_the_recovery_guides_lean_on_are_stated_and_right(claim: str, value: str) -> None:
    """These three decide what a user's job does after a fault; a page that states them must state them right."""
    assert str(defaults()[claim]) == value, f"{claim}'s default changed: update the guides that state it, then here"
    found = [key for page in PAGES for key, written, _ in stated_defaults(prose(page), {claim}) if same(written, value)]
    assert found, f"no page states {claim}'s default ({value})"


def test_what_launch_is_said_to_add_is_what_it_adds() -> None:
    text = " ".join(prose(page) for page in PAGES)
    budgets = re.findall(r"`launch` gives (?:a restart budget of |\*\*)(\d+)|`--max-restarts=(\d+)` unless", text)
    assert budgets and {int(a or b) for a, b in budgets} == {MAX_RESTARTS_DEFAULT}, budgets
    row = re.search(r"`--rdzv_conf` defaults for keys you did not set: ((?:`\w+=\w+`,? ?)+)", text)
    assert row is not None, "getting-started's table of what launch adds lost its --rdzv_conf row"
    assert dict(re.findall(r"`(\w+)=(\w+)`", row.group(1))) == RDZV_DEFAULTS


#: Words that say something is missing *for now* (a scope, "not measured at other sizes", is no such claim).
ABSENT = re.compile(r"\bnot (?:yet (?:built|implemented|measured|run)|(?:built|implemented|measured|run) yet)\b|"
                    r"\bcan be added\b|\bhas not yet run\b", re.I)
#: Headings of the sections where a page lists what is missing.
MISSING_SECTIONS = re.compile(r"not there yet|not covered|what is missing|left for later|limitations", re.I)


def test_nothing_is_called_missing_outside_a_pages_list_of_what_is_missing() -> None:
    found = []
    for page in PAGES:
        heading = ""
        for line in re.sub(r"```.*?```", "", page.read_text(), flags=re.S).splitlines():
            if line.startswith("#"):
                heading = line
            elif ABSENT.search(line) and (page.name == "README.md" or not MISSING_SECTIONS.search(heading)):
                found.append(f"{page.relative_to(ROOT)} ({heading.strip('# ') or 'top'}): …{line.strip()[:120]}…")
    assert not found, ("say what exists, or move the gap to the page's list of what is missing:\n"
                       + "\n".join(found))
