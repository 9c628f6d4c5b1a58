"""Which known model an unknown model name may mean: the same model (family, version and size) spelled another way.

A spelling-distance hint alone suggests a different model: "llama-3.2-1b" is three characters from
"llama-3.1-8b", yet another model with another KV cache. So a name is read as its parts — family ("llama",
"qwen"), version ("3.1", "v3") and size ("8b", "8x7b"; a bare last number is the size when a version comes
first: "llama-3.1-8") — with the words of a variant that shares the base shape dropped ("instruct", "chat",
"hf", "it", "base"), and a known spelling is close only when its version and size are the same and its family
is, or differs by a typo ("lama", "mixtral" for "mistral").

Pure: kvlab.models passes its table of spellings (normalised spelling → registry name).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

__all__ = ["NameParts", "readings", "close_names", "unknown_model"]

# words of a variant of the same shape (instruct/chat tunes, the Hugging Face conversion, Gemma's "-it")
VARIANT_WORDS = frozenset({"instruct", "chat", "hf", "it", "base"})
# how alike two families must be (difflib's ratio) to count as one spelled two ways: "lama"/"llama" 0.89,
# "mixtral"/"mistral" 0.86, "gemma"/"llama" 0.6
FAMILY_RATIO = 0.8

_SIZE = re.compile(r"^(?:\d+x)?\d+(?:\.\d+)?[bmt]$")  # 7b, 0.5b, 8x7b, 1t
_BARE_SIZE = re.compile(r"^(?:\d+x)?\d+(?:\.\d+)?$")  # 8, 8x7 (the size without its unit)
_VERSION = re.compile(r"^v?(\d+(?:\.\d+)*)$")  # 3.1, v3, v0.1
_WORD = re.compile(r"^([a-z]+)(\d+(?:\.\d+)*)?$")  # llama, qwen2.5, gemma2


class NameParts(NamedTuple):
    """A model name in parts: family letters, version digits (dots dropped: "3.1" and "31" read alike) and size
    ("8b", "8x7b", "" when the name gives none)."""

    family: str
    version: str
    size: str


def _has_version(word: str) -> bool:
    m = _WORD.match(word)
    return bool(_VERSION.match(word) or (m and m.group(2)))


def readings(name: str) -> list[NameParts]:
    """`name` (already lower-case, separators as "-", no "org/" prefix) as family, version and size: one reading,
    or two when a bare last number may be either the version or the size ("mistral-7": version 7, or size 7b)."""
    words = [w for w in re.split(r"-+", name.strip().lower()) if w and w not in VARIANT_WORDS]
    size = next((w for w in reversed(words) if _SIZE.match(w)), "")
    if size:
        words.remove(size)
        return [_read(words, size)]
    if len(words) > 1 and _BARE_SIZE.match(words[-1]):
        as_size = _read(words[:-1], words[-1] + "b")  # "llama-3.1-8", "qwen2.5-7": the size with its "b" left off
        if any(_has_version(w) for w in words[:-1]):
            return [as_size]
        return [_read(words, ""), as_size]
    return [_read(words, "")]


def _read(words: list[str], size: str) -> NameParts:
    family, version = [], []
    for w in words:
        if m := _VERSION.match(w):
            version.append(m.group(1))
        elif m := _WORD.match(w):
            family.append(m.group(1))
            if m.group(2):
                version.append(m.group(2))
        else:
            family.append(w)
    return NameParts("".join(family), "".join(version).replace(".", ""), size)


def _same_family(a: str, b: str) -> bool:
    return a == b or (bool(a) and bool(b) and difflib.SequenceMatcher(None, a, b).ratio() >= FAMILY_RATIO)


def close_names(name: str, spellings: Mapping[str, str], most: int = 2) -> list[str]:
    """The registry names (at most `most`, closest family first) whose spellings in `spellings` (normalised
    spelling → registry name) have the version and size of `name` and its family or one a typo away; [] when
    none has."""
    wanted = readings(name)
    scored = {}
    for spelling, key in spellings.items():
        for got in readings(spelling):
            for want in wanted:
                if got.version == want.version and got.size == want.size and _same_family(got.family, want.family):
                    score = difflib.SequenceMatcher(None, got.family, want.family).ratio()
                    scored[key] = max(score, scored.get(key, 0.0))
    return sorted(scored, key=lambda k: -scored[k])[:most]


def unknown_model(name: str, normalised: str, spellings: Mapping[str, str], known: Sequence[str]) -> str:
    """The message for an unknown model `name` (`normalised`: as `spellings` spells names): the close registry names
    when there are any, else that there is none, then every known name."""
    close = close_names(normalised, spellings)
    hint = (f"did you mean {' or '.join(repr(c) for c in close)}? " if close
            else "no known model has that family, version and size; ")
    return f"unknown model {name!r}; {hint}known models: {', '.join(known)}"
