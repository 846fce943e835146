"""What the commands' argument parsers share: errors that name the closest valid word, help that ends with a
worked example, and the name the user typed (`posdebias compare` or `python -m analysis.compare`)."""
from __future__ import annotations

import argparse
import contextlib
import difflib
from typing import Iterable, Iterator, Optional, Sequence

# Set by the `posdebias` front-end (scripts.cli) around the command it runs: the verb's name and worked example.
_invocation: Optional[tuple[str, str]] = None


@contextlib.contextmanager
def invoked_as(prog: str, example: str) -> Iterator[None]:
    """Parsers built inside this block call themselves `prog` and end their help with `example`."""
    global _invocation
    outer, _invocation = _invocation, (prog, example)
    try:
        yield
    finally:
        _invocation = outer


def closest(word: str, words: Iterable[str]) -> str:
    """'; did you mean X?' for the valid word nearest a typo, else the list of valid words."""
    words = list(words)
    near = difflib.get_close_matches(word, words, n=1, cutoff=0.5)
    return f"; did you mean {near[0]}?" if near else f"; valid: {', '.join(words)}"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class CommandParser(argparse.ArgumentParser):
    """argparse with the house rules: a mistyped option or choice fails naming the closest valid one, `example`
    (one or more command lines) closes the help, and the description keeps its line breaks."""

    def __init__(self, *args, example: str = "", **kwargs):
        if _invocation is not None and not str(kwargs.get("prog") or "").startswith(_invocation[0]):  # not a sub-parser
            kwargs["prog"], example = _invocation[0], _invocation[1] or example
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        if example:
            lines = "\n".join(f"  {line}" for line in example.strip().splitlines())
            kwargs["epilog"] = "\n\n".join(filter(None, [kwargs.get("epilog"), f"example:\n{lines}"]))
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        # argparse prints the whole usage first, which for a command of 30 flags buries the one line that matters
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help: every setting, and an example)\n")

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            first = extras[0]
            if first.startswith("-"):
                options = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
                self.error(f"unrecognized argument {first}{closest(first.split('=')[0], options)}")
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _check_value(self, action: argparse.Action, value) -> None:
        # argparse's own check, with the nearest choice named (its message lists them all)
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}{closest(str(value), map(str, action.choices))}")
