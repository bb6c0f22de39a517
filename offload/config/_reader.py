"""Typed, path-aware reading of one JSON object of a config, with errors that name the key and the source.

Every section parser wraps its raw mapping in a :class:`Section`, which rejects unknown keys up front (with
a did-you-mean) and then hands out validated values. Keeping the checks here means every section words its
errors the same way: ``"<dotted.key> in <source>: <what was wrong>"``.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

logger = logging.getLogger("offload.config")

# The integers a config value may hold: a signed 64-bit integer, what torch and the I/O core take.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1

_HF_AUTO_HINT = (
    " ('auto' is filled in by the HuggingFace Trainer's DeepSpeed integration before DeepSpeed sees the"
    " config; pass the resolved value)"
)


class ConfigError(ValueError):
    """A DeepSpeed-style config that zero-offload cannot accept; the message names the key and source."""


class Context:
    """Per-load state: where the config came from, and which ignored keys were already warned about."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._warned: set = set()

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s (in %s)", message, self.source)


def closest(name: str, candidates: Iterable[str]) -> Optional[str]:
    """The valid key a misspelled ``name`` most likely meant, or None when nothing is close."""
    candidates = list(candidates)
    lowered = {c.lower(): c for c in candidates}
    if name.lower() in lowered:
        return lowered[name.lower()]
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def describe(value: Any) -> str:
    """A short description of a bad value for error messages: its JSON type and (clipped) repr."""
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    kind = names.get(type(value), type(value).__name__)
    if value is None:
        return "null"
    text = _repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind} {text}"


def _repr(value: Any) -> str:
    """repr(value), or for an integer too long to print (Python's digit limit) its digit count."""
    try:
        return repr(value)
    except ValueError:
        return f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"


def _number(value: Any) -> str:
    """A number for an error message, clipped to 40 characters (a huge integer is not echoed whole)."""
    text = _repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _as_float(value: Any) -> Optional[float]:
    """float(value) for an int or float; None when it is not finite or too large for a float."""
    try:
        out = float(value)
    except OverflowError:
        return None
    return out if math.isfinite(out) else None


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class Section:
    """One JSON object at ``path`` (dotted; "" for the top level) with a closed set of valid keys."""

    def __init__(self, raw: Any, path: str, ctx: Context, valid: Sequence[str]) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            where = path or "the config"
            raise ConfigError(f"{where} in {ctx.source}: expected an object ({{...}}), got {describe(raw)}")
        self.raw: Mapping[str, Any] = raw
        self.path = path
        self.ctx = ctx
        self.valid = list(valid)
        self._check_unknown()

    def _check_unknown(self) -> None:
        valid = set(self.valid)
        for key in self.raw:
            if not isinstance(key, str):
                raise ConfigError(
                    f"key {key!r} in {self.ctx.source} at {self.path or 'top level'} is not a string"
                )
            if key in valid:
                continue
            guess = closest(key, self.valid)
            hint = f"; did you mean '{guess}'?" if guess else ";"
            raise ConfigError(
                f"unknown key '{join(self.path, key)}' in {self.ctx.source}{hint}"
                f" valid keys: {', '.join(sorted(valid))}"
            )

    # --- access -------------------------------------------------------------------------------------------

    def key(self, name: str) -> str:
        return join(self.path, name)

    def has(self, name: str) -> bool:
        return name in self.raw

    def get(self, name: str, default: Any = None) -> Any:
        return self.raw.get(name, default)

    def fail(self, name: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.key(name)} in {self.ctx.source}: {problem}")

    def _type_error(self, name: str, expected: str, value: Any) -> ConfigError:
        hint = _HF_AUTO_HINT if value == "auto" else ""
        return self.fail(name, f"expected {expected}, got {describe(value)}{hint}")

    def not_supported(self, name: str, what: str) -> ConfigError:
        return self.fail(name, f"{what} is not supported yet by zero-offload")

    # --- typed getters ------------------------------------------------------------------------------------

    def bool(self, name: str, default: Optional[bool]) -> Optional[bool]:
        value = self.raw.get(name, default)
        if value is None and name not in self.raw:
            return None
        if not isinstance(value, bool):
            raise self._type_error(name, "true or false", value)
        return value

    def int(
        self,
        name: str,
        default: Optional[int],
        *,
        min: Optional[int] = None,
        max: Optional[int] = None,
        allow_none: bool = False,
        why: Optional[str] = None,
    ) -> Optional[int]:
        """An integer in [min, max]; ``why`` (what the bound protects) is added to an out-of-range error."""
        value = self.raw.get(name, default)
        if value is None and (allow_none or name not in self.raw):
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._type_error(name, "an integer", value)
        if isinstance(value, float):
            # DeepSpeed configs routinely write sizes as 5e8; JSON makes those floats.
            if not math.isfinite(value) or value != int(value):
                raise self._type_error(name, "an integer", value)
            value = int(value)
        if not INT_MIN <= value <= INT_MAX:  # nothing downstream (torch, the I/O core) takes more
            raise self.fail(name, f"must be a 64-bit integer, got {_number(value)}")
        self._check_range(name, value, min, max, why)
        return value

    def float(
        self,
        name: str,
        default: Optional[float],
        *,
        min: Optional[float] = None,
        max: Optional[float] = None,
        min_exclusive: bool = False,
        max_exclusive: bool = False,
        allow_none: bool = False,
    ) -> Optional[float]:
        value = self.raw.get(name, default)
        if value is None and (allow_none or name not in self.raw):
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._type_error(name, "a number", value)
        number = _as_float(value)
        if number is None:
            raise self.fail(name, f"must be a finite number, got {_number(value)}")
        value = number
        if min is not None and (value < min or (min_exclusive and value == min)):
            raise self.fail(name, f"must be {'>' if min_exclusive else '>='} {min}, got {value}")
        if max is not None and (value > max or (max_exclusive and value == max)):
            raise self.fail(name, f"must be {'<' if max_exclusive else '<='} {max}, got {value}")
        return value

    def _check_range(
        self, name: str, value: int, lo: Optional[int], hi: Optional[int], why: Optional[str] = None
    ) -> None:
        if (lo is None or value >= lo) and (hi is None or value <= hi):
            return
        if why is not None and lo is not None and hi is not None:
            bound = f"in [{lo}, {hi}]"
        elif lo is not None and value < lo:
            bound = f">= {lo}"
        else:
            bound = f"<= {hi}"
        reason = f" ({why})" if why else ""
        raise self.fail(name, f"must be {bound}, got {value}{reason}")

    def str(self, name: str, default: Optional[str], *, allow_none: bool = False) -> Optional[str]:
        value = self.raw.get(name, default)
        if value is None and (allow_none or name not in self.raw):
            return None
        if not isinstance(value, str):
            raise self._type_error(name, "a string", value)
        return value

    def choice(
        self, name: str, default: str, choices: Sequence[str], *, case_insensitive: bool = True
    ) -> str:
        """One of ``choices``; returned in the spelling ``choices`` uses."""
        value = self.raw.get(name, default)
        if not isinstance(value, str):
            raise self._type_error(name, f"one of {_quoted(choices)}", value)
        for choice in choices:
            if value == choice or (case_insensitive and value.lower() == choice.lower()):
                return choice
        guess = closest(value, choices)
        hint = f"; did you mean '{guess}'?" if guess else ""
        raise self.fail(name, f"must be one of {_quoted(choices)}, got '{value}'{hint}")

    def float_pair(self, name: str, default: tuple, *, lo: float = 0.0, hi: float = 1.0) -> tuple:
        """Two numbers in [lo, hi), e.g. Adam's betas; JSON arrays become tuples."""
        value = self.raw.get(name, default)
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise self._type_error(name, "an array of two numbers", value)
        out = []
        for item in value:
            if isinstance(item, bool) or not isinstance(item, (int, float)) or _as_float(item) is None:
                raise self._type_error(name, "an array of two finite numbers", value)
            if not lo <= item < hi:
                raise self.fail(name, f"each value must be in [{lo}, {hi}), got {list(value)}")
            out.append(float(item))
        return tuple(out)

    def mapping(self, name: str) -> Optional[Mapping[str, Any]]:
        value = self.raw.get(name)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise self._type_error(name, "an object ({...})", value)
        return value

    # --- keys we accept without implementing them --------------------------------------------------------

    def off_only(self, name: str, is_off: Callable[[Any], bool], what: str) -> None:
        """Accept ``name`` only while its value leaves the feature off (equivalent to leaving it out)."""
        if name in self.raw and not is_off(self.raw[name]):
            raise self.not_supported(name, what)

    def ignored(self, name: str, reason: str) -> None:
        """Accept ``name`` without acting on it; warn once unless its value leaves it off anyway."""
        if name in self.raw and not is_off_value(self.raw[name]):
            self.ctx.warn_once(
                self.key(name), f"config key '{self.key(name)}' is accepted but ignored: {reason}"
            )

    def ignored_unless(self, name: str, value: Any, honoured: Any, reason: str) -> None:
        """Warn once when ``name`` is given with a ``value`` other than ``honoured`` (what the engine does
        anyway): accepted, but not acted on."""
        if name in self.raw and value != honoured:
            self.ctx.warn_once(
                self.key(name),
                f"config key '{self.key(name)}' = {value!r} is accepted but ignored: {reason} (the engine "
                f"behaves as with {honoured!r})",
            )


def is_off_value(value: Any) -> bool:
    """True for values that mean "feature not used": false, null, {}, or an object with enabled=false."""
    if value is None or value is False:
        return True
    if isinstance(value, Mapping):
        return len(value) == 0 or value.get("enabled", True) is False
    return False


def _quoted(choices: Sequence[str]) -> str:
    return ", ".join(f"'{c}'" for c in choices)


def read_json_file(path: str) -> Any:
    """Parse a JSON file; missing files and syntax errors become ConfigErrors naming file, line, column."""

    def no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
        # DeepSpeed refuses duplicate keys as well; json would silently keep the last one.
        out: Dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"config file {path}: duplicate key '{key}'")
            out[key] = value
        return out

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror} (errno {e.errno})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text: {e}") from None
    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"config file {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:
        raise ConfigError(
            f"config file {path} nests arrays or objects too deeply to be a config (Python's recursion "
            "limit was reached while parsing it)"
        ) from None
    except ValueError as e:  # an integer longer than Python converts (sys.get_int_max_str_digits)
        raise ConfigError(f"config file {path} holds a number that cannot be read: {e}") from None
