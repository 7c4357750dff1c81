"""JSON read from disk as hostile input: a size cap, strict UTF-8, bounded depth and integer size.

Every JSON file shardprep reads (the manifest, safetensors headers, index files, config.json, presets)
goes through `parse_json` or `read_json_file`, so a malformed file is one `IntegrityError` naming it,
never a MemoryError, RecursionError or UnicodeError. Types are checked by each reader afterwards.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import IntegrityError
from .exact_read import open_for_reading, read_exact

# Deeper than any file shardprep reads needs (a manifest is 5 levels deep).
MAX_DEPTH = 64
# No byte count or shape is longer than this; Python itself refuses above 4300 digits with a ValueError.
MAX_INT_DIGITS = 24
_INT_BOUND = 10**MAX_INT_DIGITS
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class _Refused(Exception):
    pass


def _no_constants(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


def _unique_keys(allow_duplicates: bool) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    if allow_duplicates:
        return dict  # the last value of a key wins, as in json.loads

    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)  # one call per object: a loop over its keys here costs more than the parse itself
        if len(out) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    raise _Refused(f"key {key[:80]!r} appears twice in one object")
                seen.add(key)
        return out

    return build


def _loads(text: str, allow_duplicate_keys: bool, parse_int: Callable[[str], int] | None = None) -> Any:
    return json.loads(text, object_pairs_hook=_unique_keys(allow_duplicate_keys), parse_int=parse_int,
                      parse_constant=_no_constants)


def parse_json(raw: bytes | str, where: str, *, allow_duplicate_keys: bool = False) -> Any:
    """Parse hostile JSON; every failure is one IntegrityError (code `invalid_json`) naming `where`.

    Refused: invalid UTF-8, lone surrogates, NaN/Infinity, integers over 24 digits, nesting deeper than
    64, and (unless allowed) a key twice in one object.

    >>> parse_json(b'{"a": [1, 2]}', "x.json")
    {'a': [1, 2]}
    >>> parse_json(b'[' * 30000, "x.json")
    Traceback (most recent call last):
    ...
    shardprep.errors.IntegrityError: x.json: not valid JSON (nested more than 64 levels deep)
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        try:
            data = _loads(text, allow_duplicate_keys)
        except ValueError as exc:
            if isinstance(exc, json.JSONDecodeError):
                raise
            # Python's own limit on an integer's digits: parse again, counting each integer's, to say which.
            data = _loads(text, allow_duplicate_keys, parse_int=_bounded_int)
        # Encoding every string costs a call per string: only a \u escape can make a lone surrogate (strict
        # UTF-8 decoding refuses a surrogate's encoded bytes), so it runs only when the text holds one.
        _check_values(data, strings=_SURROGATE_ESCAPE.search(text) is not None)
    except RecursionError:
        raise _invalid(where, f"not valid JSON (nested more than {MAX_DEPTH} levels deep)") from None
    except UnicodeError:
        raise _invalid(where, "not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise _invalid(where, f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except _Refused as exc:
        raise _invalid(where, f"not valid JSON ({exc})") from None
    except (ValueError, MemoryError) as exc:
        raise _invalid(where, f"not valid JSON ({type(exc).__name__})") from None
    return data


def read_capped(path: str | Path, *, max_bytes: int, what: str) -> bytes:
    """A whole file of at most `max_bytes`; missing, unreadable or too large is an IntegrityError.

    Codes: `missing_file`, `unreadable_file`, `file_too_large`.

    >>> read_capped("out/model.safetensors.index.json", max_bytes=1 << 20, what="index")  # doctest: +SKIP
    """
    where = str(path)
    with open_for_reading(path, what) as fd:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise IntegrityError(f"{where}: {size} bytes, more than a {what} may be ({max_bytes}); refusing to "
                                 "read it", code="file_too_large", file=where)
        return read_exact(fd, size, 0, where)


def read_json_file(path: str | Path, *, max_bytes: int, what: str, allow_duplicate_keys: bool = False) -> Any:
    """Read (see `read_capped`) and parse (see `parse_json`) a JSON file.

    >>> read_json_file("out/shard_manifest.json", max_bytes=256 << 20, what="manifest")  # doctest: +SKIP
    """
    raw = read_capped(path, max_bytes=max_bytes, what=what)
    return parse_json(raw, str(path), allow_duplicate_keys=allow_duplicate_keys)


def is_int(value: object) -> bool:
    """True for a JSON integer: an int that is not a bool (JSON true is not 1 here), never a float.

    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def is_str_dict(value: object) -> bool:
    """True for a dict whose keys and values are all strings (safetensors metadata, for example).

    >>> is_str_dict({"format": "pt"}), is_str_dict({"n": 1})
    (True, False)
    """
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _check_values(data: Any, *, strings: bool) -> None:
    """Refuse nesting deeper than MAX_DEPTH, integers of more than MAX_INT_DIGITS digits and, with `strings`,
    lone surrogates (the escape \\ud800 parses to one, and no file name or message can be encoded with it).

    Iterative, so checking a deep document cannot itself recurse. The types are json.loads's exactly, and a
    `type() is` test costs half an isinstance, on every value of the document.
    """
    level = [data] if type(data) in (dict, list) else []
    if not level:
        _check_scalar(data, strings)
    depth = 1
    while level:  # one depth at a time: the containers at `depth`
        if depth > MAX_DEPTH:
            raise RecursionError
        deeper = []
        for item in level:
            if type(item) is dict:
                if strings:
                    for key in item:
                        key.encode("utf-8")
                item = item.values()
            for value in item:
                kind = type(value)
                if kind is dict or kind is list:
                    deeper.append(value)
                elif kind is int:
                    if not -_INT_BOUND < value < _INT_BOUND:
                        _check_scalar(value, strings)
                elif strings and kind is str:
                    value.encode("utf-8")
        level, depth = deeper, depth + 1


def _check_scalar(value: Any, strings: bool) -> None:
    if type(value) is int and not -_INT_BOUND < value < _INT_BOUND:
        raise _Refused(f"an integer of {len(str(abs(value)))} digits")
    if strings and type(value) is str:
        value.encode("utf-8")


def _invalid(where: str, why: str) -> IntegrityError:
    return IntegrityError(f"{where}: {why}", code="invalid_json", file=where)

