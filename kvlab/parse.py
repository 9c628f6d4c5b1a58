"""Reading what a user types: lists in every spelling, token counts, close-match hints, YAML as a user means
it, and an argparse parser whose errors fit on one line. The bottom of the package: no kvlab imports.

What a user types for a list is accepted in every spelling: ``1024,4096``, ``[1024, 4096]`` (YAML) and, for
token counts, ``1k,32k``. A bad value is a ValueError (or a UsageError on the command line) naming the value
and what is valid.
"""

from __future__ import annotations

import argparse
import difflib
import numbers
import re

__all__ = ["check_int", "UsageError", "name_list", "token_list", "suggest", "yaml_load", "YAMLInputError", "MAX_YAML_BYTES",
           "OneLineParser"]


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


MAX_YAML_BYTES = 1 << 20  # a parameter value or a sweep grid: larger is not typed by a person
MAX_YAML_DEPTH = 32


class YAMLInputError(ValueError):
    """YAML that kvlab does not take: not valid, too large or deep, with anchors or aliases, or a key twice."""


def yaml_load(text: str, where: str = "YAML"):
    """YAML as a user means it: only true/false are booleans (PyYAML follows YAML 1.1, where on/off/yes/no are too,
    so a grid's `attribution: [off]` became the text "False", issue 16); no anchors or aliases (a 600-byte grid of
    nested aliases expanded into 138 MB of error text); a key given twice is refused, not silently the last; at most
    MAX_YAML_BYTES of text and MAX_YAML_DEPTH levels. Anything else is a YAMLInputError naming `where` and the line."""
    import yaml

    if not isinstance(text, str):
        raise YAMLInputError(f"{where}: expected text, got {type(text).__name__}")
    if len(text.encode("utf-8", "replace")) > MAX_YAML_BYTES:
        raise YAMLInputError(f"{where}: {len(text):,} characters of YAML; kvlab takes at most {MAX_YAML_BYTES:,} bytes")

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent) or getattr(self.peek_event(), "anchor", None):
                mark = self.peek_event().start_mark
                raise YAMLInputError(f"{where}: line {mark.line + 1}: YAML anchors and aliases (&x, *x) are not "
                                     "accepted; write each value out")
            self._depth = getattr(self, "_depth", 0) + 1
            try:
                if self._depth > MAX_YAML_DEPTH:
                    mark = self.peek_event().start_mark
                    raise YAMLInputError(f"{where}: line {mark.line + 1}: nested deeper than {MAX_YAML_DEPTH} levels")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                    seen.add(key)
                except TypeError:
                    raise YAMLInputError(f"{where}: line {key_node.start_mark.line + 1}: a key must be a plain value, "
                                         f"not {type(key).__name__}") from None
                if dup:
                    raise YAMLInputError(f"{where}: line {key_node.start_mark.line + 1}: key {key!r} is given twice; "
                                         "give each key once")
            return super().construct_mapping(node, deep)

    Loader.yaml_implicit_resolvers = {
        k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
        for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
    try:
        return yaml.load(text, Loader=Loader)
    except YAMLInputError:
        raise
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        what = getattr(err, "problem", None) or str(err).splitlines()[0]
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise YAMLInputError(f"{where} is not valid YAML ({what}{at})") from None
    except (RecursionError, ValueError, OverflowError) as err:  # a number too large for a float, deep recursion
        raise YAMLInputError(f"{where}: cannot be read ({type(err).__name__}: {str(err)[:80]})") from None


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


def check_int(name: str, value: object, minimum: int) -> int:
    """`value` as an int, or ValueError naming `name` unless it is an integer (a numpy one too) >= `minimum`."""
    # bool is an int subclass; True as a repeat count is almost certainly a bug
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")
    return int(value)
