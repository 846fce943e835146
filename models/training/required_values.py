"""Required config values: a `???` in a config file that nothing sets is refused at start-up, naming the key.

Hydra composes over the typed schema, and OmegaConf never lets a missing value (`???`) override one that is there:
merged over the schema's default, `model: hf`'s `pretrained: ???` became the default `None`, and a run without
`model.pretrained` built a random default Qwen2 (~7B parameters) until the machine ran out of memory. So the `???`
are read from the config files the composition chose (`hydra.runtime.choices`, and the files those list in their
own `defaults`), and each must be set by another of them or on the command line. The comment on a `???` line says
what to give, with an example (`pretrained: ???  # required: a hub id or a folder, e.g. model.pretrained=...`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from models.training.renamed_keys import override_key

MISSING = "???"
PACKAGE_HEADER = re.compile(r"^#\s*@package\s+(\S+)")
GLOBAL = "_global_"


class MissingValueError(ValueError):
    """A `???` of a config file that nothing set."""


@dataclass(frozen=True)
class ConfigFile:
    path: Path
    package: str  # where its keys go in the composed config ("" for the top)
    values: dict  # its contents as written: interpolations unresolved, a missing value as "???"


@dataclass(frozen=True)
class Required:
    key: str  # the dotted key in the composed config
    where: str  # file:line of its `???`
    hint: str  # the comment on that line: what to give


def _package(path: Path, group: str, package: Optional[str]) -> str:
    """A config file's package: the `@pkg` of its defaults entry, else its `# @package` header, else its group."""
    if package is None:
        header = PACKAGE_HEADER.match(path.read_text(encoding="utf-8").split("\n", 1)[0])
        package = header.group(1) if header else group.replace("/", ".")
    return "" if package == GLOBAL else package.removeprefix(GLOBAL + ".")


def _load(conf_dir: Path, group: str, name: str, package: Optional[str] = None) -> Iterator[ConfigFile]:
    """The file `group/name.yaml` and the plain (non-group) entries of its own defaults list, depth first."""
    path = conf_dir / group / f"{name}.yaml"
    if not path.is_file():
        return
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(values, dict):
        return
    for entry in values.get("defaults", None) or []:
        if isinstance(entry, str) and entry != "_self_":  # another config of the same group (or /absolute)
            sub_group, _, sub_name = (entry[1:] if entry.startswith("/") else f"{group}/{entry}").rpartition("/")
            yield from _load(conf_dir, sub_group, sub_name)
    yield ConfigFile(path, _package(path, group, package), values)


def chosen_files(conf_dir: Path, choices: Mapping[str, Any], primary: str = "train") -> list[ConfigFile]:
    """The project's config files a composition read: the primary config and each chosen group option (Hydra's
    own groups left out)."""
    files = list(_load(conf_dir, "", primary, GLOBAL))
    for group, name in choices.items():
        if name is None or group.startswith("hydra/"):
            continue
        group_dir, _, package = str(group).partition("@")
        files += _load(conf_dir, group_dir, str(name), package or None)
    return files


def _hint(path: Path, leaf: str) -> tuple[int, str]:
    """The line of `leaf: ???` in `path` and its comment."""
    pattern = re.compile(rf"^\s*{re.escape(leaf)}\s*:\s*['\"]?\?\?\?['\"]?\s*(?:#\s*(.*))?$")
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if m := pattern.match(line):
            return number, (m.group(1) or "").strip()
    return 0, ""


def _missing_keys(values: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(values, dict):
        for key, value in values.items():
            if key != "defaults":
                yield from _missing_keys(value, f"{prefix}{key}.")
    elif values == MISSING:
        yield prefix.rstrip(".")


def _is_set(values: dict, key: str) -> bool:
    node: Any = values
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return node != MISSING


def _relative(key: str, package: str) -> Optional[str]:
    if not package:
        return key
    return key[len(package) + 1:] if key.startswith(package + ".") else None


def required_values(conf_dir: Path, choices: Mapping[str, Any], overrides: Sequence[str],
                    primary: str = "train") -> list[Required]:
    """Every `???` of the chosen files that no other chosen file and no override sets."""
    files = chosen_files(conf_dir, choices, primary)
    groups = {str(group).partition("@")[0] for group in choices}  # `model=hf` chooses a file, it sets no value
    given = {key for o in overrides if (key := override_key(o)) is not None and key not in groups}
    left: list[Required] = []
    for f in files:
        for inner in _missing_keys(f.values):
            key = f"{f.package}.{inner}" if f.package else inner
            if key in given or any(key.startswith(g + ".") for g in given):
                continue
            if any((rel := _relative(key, other.package)) is not None and _is_set(other.values, rel)
                   for other in files if other is not f):
                continue
            line, hint = _hint(f.path, inner.rpartition(".")[2])
            left.append(Required(key, f"{f.path.relative_to(conf_dir.parent)}:{line}", hint))
    return left


def check_required(conf_dir: Path, choices: Mapping[str, Any], overrides: Sequence[str]) -> None:
    """MissingValueError naming the first required value nothing set, where it is required and what to give."""
    for r in required_values(conf_dir, choices, overrides):
        what = r.hint.removeprefix("required").lstrip(":, ") or f"give it on the command line as {r.key}=<value>"
        raise MissingValueError(f"{r.key} is required ({r.where} leaves it ???): {what}")


def choices_of(hydra_node: DictConfig) -> dict[str, Any]:
    """`hydra.runtime.choices` as a plain dict."""
    return dict(OmegaConf.to_container(hydra_node.runtime.choices))
