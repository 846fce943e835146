"""Config keys that were renamed, and keys a schema does not have: refused by name, never read silently.

An override or a config file that still spells a key the old way fails naming the new one (`debias.alpha was
renamed: use debias.prior_alpha`), where Hydra alone says only that DebiasConfig has no `alpha`. `RENAMED` lists
train.py's keys (the commit that renamed each in a comment), `EVAL_CHECKPOINT_RENAMED` scripts.eval_checkpoint's.
The run configs that older runs saved are read under the new names where they are read
(`data_builders.config.as_data_config`); what a user types now is refused.

Three hooks, one table: `check_overrides` before Hydra composes (train.py's command line, `compose_config`,
eval_checkpoint's arguments), `check_composition_error` for an old key inside a config file, and `check_keys` on the
composed config, which also refuses a key that `+key=value` appended (Hydra's own advice for a key it does not know),
which the conversion to the typed config would otherwise drop without a word.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import typing
from typing import Any, Mapping, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data_builders.config import RENAMED_IN2_KEYS

# old dotted key -> (new dotted key, what else changed, or "")
RENAMED: dict[str, tuple[str, str]] = {
    # 77294ca: one name for the Cesàro prior's weight and power, in debias and in data.in2
    "debias.alpha": ("debias.prior_alpha", ""),
    "debias.beta": ("debias.prior_power", ""),
    **{f"data.in2.{old}": (f"data.in2.{new}", "") for old, new in RENAMED_IN2_KEYS.items()},
    # e4117a7: every answer is recorded as it is made; on by default
    "eval.reuse_step0": ("eval.resume", "on by default"),
    # 0236a5e: each probe's settings in a block of its own
    "eval.needle_lens": ("eval.needle.lengths", ""),
}
EVAL_CHECKPOINT_RENAMED: dict[str, tuple[str, str]] = {
    "needle_lens": ("needle.lengths", ""),  # 0236a5e
}


class UnknownKeyError(ValueError):
    """A config key the schema does not have; a renamed one names its new name."""


def override_key(override: str) -> Optional[str]:
    """The dotted key of a Hydra override (`key=value`, `+key=value`, `++key=value`, `~key`); None for a flag
    (`-m`, `--cfg`) or an argument without a key."""
    if override.startswith("-"):
        return None
    key = override.partition("=")[0] if "=" in override else (override if override.startswith("~") else "")
    return key.lstrip("+~") or None


def renamed(key: str, table: Mapping[str, tuple[str, str]] = RENAMED) -> Optional[str]:
    """'KEY was renamed: use NEW' when `key` (or a node above it) is an old name in `table`, else None."""
    for old, (new, note) in table.items():
        if key == old or key.startswith(old + "."):
            return f"{key} was renamed: use {new}{key[len(old):]}" + (f" ({note})" if note else "")
    return None


def check_overrides(overrides: Sequence[str], table: Mapping[str, tuple[str, str]] = RENAMED) -> None:
    """UnknownKeyError for the first override that sets a renamed key."""
    for override in overrides:
        key = override_key(override)
        if key is not None and (message := renamed(key, table)):
            raise UnknownKeyError(message)


def exit_on_renamed_overrides(argv: Sequence[str]) -> None:
    """train.py's command line, before Hydra sees it: a renamed key prints one line and exits 1 (as Hydra's own
    refusal of an unknown key does)."""
    try:
        check_overrides(argv)
    except UnknownKeyError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from err


def check_composition_error(err: Exception, table: Mapping[str, tuple[str, str]] = RENAMED) -> None:
    """UnknownKeyError, from `err`, when Hydra failed to compose over a renamed key: set by a config file
    (`In 'exp/old': ... full_key: debias.alpha`) or by an override. Returns for any other error."""
    said = f"{err}\n{err.__cause__ or ''}"
    keys = re.findall(r"full_key: (\S+)", said) + re.findall(r"override '([^']+)'", said)
    where = re.match(r"In '([^']+)'", said)
    for key in keys:
        if message := renamed(key, table):
            raise UnknownKeyError(message + (f", in {where.group(1)}.yaml" if where else "")) from err


def one_line(err: OmegaConfBaseException) -> str:
    """An OmegaConf error as one line, naming the key: `examples: Value 'many' ... could not be converted to
    Integer` (its message alone runs over several, the key on the second)."""
    first = str(getattr(err, "msg", None) or err).splitlines()[0]
    key = getattr(err, "full_key", None)
    return f"{key}: {first}" if key else first


def _schema_of(hint: Any) -> Optional[type]:
    """The dataclass a field's type names (also inside Optional[...]), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def check_keys(cfg: DictConfig, schema: type, table: Mapping[str, tuple[str, str]] = RENAMED,
               prefix: str = "") -> None:
    """UnknownKeyError for the first key of `cfg` that the dataclass `schema` (and those of its fields) does not
    have, naming its new name when it was renamed, else the closest known key. Free-form fields (a dict, Any) are
    not looked into."""
    hints = typing.get_type_hints(schema)
    fields = [f.name for f in dataclasses.fields(schema)]
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if key not in fields:
            if message := renamed(full, table):
                raise UnknownKeyError(message)
            raise UnknownKeyError(_no_such_setting(str(key), prefix, schema))
        sub = _schema_of(hints[key])
        if sub is not None and not OmegaConf.is_missing(cfg, key) and isinstance(child := cfg.get(key), DictConfig):
            check_keys(child, sub, table, f"{full}.")


def _no_such_setting(key: str, prefix: str, schema: type) -> str:
    fields = [f.name for f in dataclasses.fields(schema)]
    close = difflib.get_close_matches(key, fields, n=1)
    hint = f"; did you mean {prefix}{close[0]}?" if close else f"; its keys: {', '.join(fields)}"
    return f"{prefix}{key}: no such setting in {prefix.rstrip('.') or 'the config'} ({schema.__name__}){hint}"


def unknown_override(overrides: Sequence[str], schema: type,
                     groups: Optional[Mapping[str, Sequence[str]]] = None) -> Optional[str]:
    """What is wrong with the first override a mistyped word spoils, naming the closest valid word: a key the
    dataclass `schema` does not have (`trainer.lrr: no such setting ...; did you mean trainer.lr?`), or an option
    that a config group (`groups`: group -> its options) does not have. None when every key and option exists
    (free-form fields, a dict or Any, are not looked into; `hydra.*` keys are Hydra's)."""
    for override in overrides:
        key = override_key(override)
        if key is None or key.startswith("hydra."):
            continue
        value = override.partition("=")[2]
        if groups and key in groups:
            options = groups[key]
            for option in value.strip("[]").split(","):
                if option and option not in options:
                    close = difflib.get_close_matches(option, options, n=1)
                    plus = override[:len(override) - len(override.lstrip("+"))]  # `+exp=...` as typed
                    hint = f"did you mean {plus}{key}={close[0]}?" if close else f"its options: {', '.join(options)}"
                    return f"{plus}{key}={option}: no such option of the config group {key}; {hint}"
            continue
        current: Any = schema
        for depth, part in enumerate(parts := key.split(".")):
            if (current := _schema_of(current)) is None:
                break  # a free-form field, or a leaf whose value Hydra checks itself
            if part not in {f.name for f in dataclasses.fields(current)}:
                return _no_such_setting(part, "".join(f"{p}." for p in parts[:depth]), current)
            current = typing.get_type_hints(current)[part]
    return None
