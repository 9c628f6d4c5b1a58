"""Reading what a user types: lists in every spelling, token counts, close-match hints, YAML as a user means
it, and an argparse parser whose errors fit on one line. The bottom of the package: no kvlab imports.

What a user types for a list is accepted in every spelling: ``1024,4096``, ``[1024, 4096]`` (YAML) and, for
token counts, ``1k,32k``. A bad value is a ValueError (or a UsageError on the command line) naming the value
and what is valid.
"""

from __future__ import annotations

import argparse
import difflib
import re

__all__ = ["UsageError", "name_list", "token_list", "suggest", "yaml_load", "OneLineParser"]


class UsageError(Exception):
    """Bad input on the command line; the message says what was wrong and what is valid."""


def name_list(value, what: str = "value") -> list[str]:
    """``"a,b"``, ``"[a, b]"``, ``["a", "b"]`` or ``"a"`` → ``["a", "b"]``; empty → ValueError."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        items = [v.strip().strip("'\"") for v in text.split(",")]
    elif isinstance(value, (list, tuple)):
        items = [str(v).strip() for v in value]
    else:
        items = [str(value).strip()]
    items = [v for v in items if v]
    if not items:
        raise ValueError(f"{what} = {value!r} is empty: give at least one, e.g. a,b or [a, b]")
    return items


def token_list(value, what: str = "contexts", minimum: int = 1) -> list[int]:
    """Token counts in any spelling a user types: ``1024,4096``, ``[1024, 4096]``, ``1k,32k``, ``2048``, or a
    list of ints → ``[1024, 4096]``; anything else → ValueError naming the value and the accepted forms."""
    out = []
    for item in name_list(value, what):
        t = item.lower().replace("_", "")
        try:
            n = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
        except ValueError:
            raise ValueError(f"{what} = {value!r}: {item!r} is not a token count; give ints such as 1024,4096, "
                             "[1024, 4096] or 1k,32k") from None
        if n < minimum:
            raise ValueError(f"{what} = {value!r}: {n} is too small; give token counts ≥ {minimum}")
        out.append(n)
    return out


def suggest(name: str, known) -> str:
    """"; did you mean 'x'?" for the closest of ``known`` to ``name`` (empty when none is close)."""
    close = difflib.get_close_matches(str(name).lower(), list(dict.fromkeys(k.lower() for k in known)), n=2,
                                      cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def yaml_load(text: str):
    """YAML as a user means it: only true/false are booleans. PyYAML follows YAML 1.1, where on/off/yes/no are too,
    so a grid's `attribution: [off]` became the text "False" (issue 16)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
        for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
    return yaml.load(text, Loader=Loader)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line: the message, a close match for a mistyped option or command,
    and where the valid ones are listed — instead of the usage block above the message."""

    def error(self, message: str):
        hint = ""
        words = message.split(": ", 1)[1].split() if message.startswith("unrecognized arguments: ") else []
        words = words[:words.index("--")] if "--" in words else words  # nothing after "--" is an option
        options = [o for o in self._option_string_actions if o.startswith("--")]
        for w in (w.split("=", 1)[0] for w in words if w.startswith("-")):
            near = [o for o in difflib.get_close_matches(w, options, n=2, cutoff=0.6) if o != w]
            if near:
                hint = f"; did you mean {near[0]}?"
                break
        if not hint and message.startswith("argument COMMAND: invalid choice: '"):
            bad = message.split("invalid choice: '", 1)[1].split("'", 1)[0]
            near = difflib.get_close_matches(bad, re.findall(r"'([^']+)'", message.split("choose from", 1)[-1]), n=1,
                                             cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else ""
        self.exit(2, f"{self.prog}: error: {message}{hint} ({self.prog} -h lists what is valid)\n")
