"""JSON read from disk as hostile input: a size cap, strict UTF-8, bounded depth and integer size.

Every JSON file shardprep reads (the manifest, safetensors headers, index files, config.json, presets)
goes through `parse_json` or `read_json_file`, so a malformed file is one `IntegrityError` naming it,
never a MemoryError, RecursionError or UnicodeError. Types are checked by each reader afterwards.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import IntegrityError
from .exact_read import open_for_reading, read_exact

# Deeper than any file shardprep reads needs (a manifest is 5 levels deep).
MAX_DEPTH = 64
# No byte count or shape is longer than this; Python itself refuses above 4300 digits with a ValueError.
MAX_INT_DIGITS = 24


class _Refused(Exception):
    pass


def _no_constants(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


def _unique_keys(allow_duplicates: bool) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out and not allow_duplicates:
                raise _Refused(f"key {key[:80]!r} appears twice in one object")
            out[key] = value
        return out

    return build


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
        data = json.loads(text, object_pairs_hook=_unique_keys(allow_duplicate_keys), parse_int=_bounded_int,
                          parse_constant=_no_constants)
        _check_depth_and_strings(data)
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


def _check_depth_and_strings(data: Any) -> None:
    # Iterative, so checking a deep document cannot itself recurse. "\ud800" parses to a lone surrogate,
    # which no file name or message can be encoded with: encoding every string finds them.
    stack = [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            item.encode("utf-8")
        elif isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise RecursionError
            if isinstance(item, dict):
                for key in item:
                    key.encode("utf-8")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))


def _invalid(where: str, why: str) -> IntegrityError:
    return IntegrityError(f"{where}: {why}", code="invalid_json", file=where)

