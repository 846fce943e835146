"""What conf/ offers, read from its files: each config group's options, and each option's one-line description.

A preset file opens with comment lines that say how to run it and what it is, in one of two shapes:
`# python train.py +exp=in2   (what it is ...)` or `# debias=group_dro: what it is. ...`; a file whose first line
is only a command says what it is on the next.
`posdebias ls` and `posdebias train --help` list them; train.py names the closest option for a mistyped one.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

WIDTH = 100  # a description longer than this is cut at a word
PACKAGE_LINE = re.compile(r"^#\s*@package\b")
INTERNAL_GROUPS = ("recipe",)  # chosen by a model preset (its defaults), not on the command line


def config_groups(conf_dir: Path, overrides: Sequence[str] = ()) -> dict[str, list[str]]:
    """Each config group a user picks (`model=...`, `+exp=...`) -> its options, sorted: conf_dir's, and those of the
    folders a `hydra.searchpath=[file://...]` override among `overrides` adds."""
    groups: dict[str, set[str]] = {}
    for root in (conf_dir, *searchpath_dirs(overrides)):
        for d in sorted(root.iterdir()) if root.is_dir() else ():
            if d.is_dir() and d.name not in INTERNAL_GROUPS:
                groups.setdefault(d.name, set()).update(p.stem for p in d.glob("*.yaml"))
    return {group: sorted(options) for group, options in sorted(groups.items())}


def searchpath_dirs(overrides: Sequence[str]) -> list[Path]:
    """The local folders of a `hydra.searchpath=[file://a,file://b]` override (other schemes are Hydra's own)."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key == "hydra.searchpath":
            return [Path(entry.strip()[len("file://"):]) for entry in value.strip("[]").split(",")
                    if entry.strip().startswith("file://")]
    return []


def header(path: Path) -> list[str]:
    """The comment lines that open a config file, without '# ' and the `@package` line."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not PACKAGE_LINE.match(line):
            lines.append(line.lstrip("#").strip())
    return lines


COMMAND = re.compile(r"^(python|deepspeed|torchrun)\b")


def first_sentence(text: str) -> str:
    """Up to the first full stop before a capital, or to a colon after a few words (what follows is the detail)."""
    sentence = re.split(r"\.\n|\.\s+(?=[A-Z])", text, maxsplit=1)[0].replace("\n", " ")
    head, colon, _ = sentence.partition(": ")
    return head if colon and len(head.split()) >= 4 else sentence


def description(path: Path) -> str:
    """One line saying what a preset is: the text after its `group=name:`, else the parenthesis after the command
    on its first line, else its first line that is not a command."""
    lines = header(path)
    text = "\n".join(lines)
    if match := re.search(rf"(?:^|\s)[+]?{re.escape(path.parent.name)}={re.escape(path.stem)}:\s*(.*)", text,
                          re.DOTALL):
        said = first_sentence(match.group(1))
    elif lines and "   (" in lines[0]:  # what it is, in parentheses (which may run over several lines)
        inside, depth = [], 0
        for char in text[text.index("   (") + 3:]:
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
            inside.append(char)
        said = "".join(inside)[1:].replace("\n", " ")
    else:
        said = first_sentence(next((line for line in lines if not COMMAND.match(line)), ""))
    said = said.strip().rstrip(".")
    return said if len(said) <= WIDTH else said[:WIDTH].rsplit(" ", 1)[0] + " ..."


def catalog(conf_dir: Path) -> dict[str, dict[str, str]]:
    """group -> option -> description, for every group a user picks."""
    return {group: {name: description(conf_dir / group / f"{name}.yaml") for name in names}
            for group, names in config_groups(conf_dir).items()}
