"""The argument parser of every ElasticDL command: no prefix matching, and errors that help.

- ``allow_abbrev=False``: argparse would otherwise take ``--num_worker 3`` as ``--num_workers``
  (and a later prefix would silently override an earlier full flag).
- A flag a subcommand does not take is refused by the subcommand itself, with its own usage
  (argparse leaves unknown flags to the top parser, whose usage is ``elasticdl COMMAND``),
  and with a hint (elasticdl/config/suggest.py): the Keras name's flag (``--batch_size`` ->
  ``--minibatch_size``), the command that takes it, or the nearest flag.
- A mistyped command or action gets the nearest one (``elasticdl trian``: ``'train'``).
- A usage longer than a few lines (``elasticdl train`` has some sixty flags) is shown on an
  error as one line that points at ``--help``: the error is the line to read.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

from elasticdl.config import FLAGS
from elasticdl.config.suggest import flag_hint, nearest

# On an error, a usage of more lines than this is shortened to one line.
MAX_USAGE_LINES = 4
# argparse's message for a value not among an argument's choices (a command, an action).
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


def commands_of(name: str) -> tuple[str, ...]:
    """The commands that take flag ``--name`` (none: no JobConfig flag has that name)."""
    flag = FLAGS.get(name) or next((f for f in FLAGS.values() if f"--{name}" in f.aliases), None)
    return flag.commands if flag is not None else ()


class ElasticDLParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without prefix matching, whose subparsers are strict (see
    the module's doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.is_subcommand = False

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", _Subcommand)
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if self.is_subcommand and args is not None:
            # Unknown flags first: argparse would complain of a missing required flag first, and
            # the typo that caused it (`--job_nam`) would go unmentioned.
            unknown = [a for a in self._flags_only(args) if a.partition("=")[0] not in self._option_string_actions]
            if unknown:
                self.error(self.unrecognized(unknown))
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self.is_subcommand:
            self.error(self.unrecognized(extras))
        return namespace, extras

    @staticmethod
    def _flags_only(args: Sequence[str]) -> list[str]:
        flags = []
        for arg in args:
            if arg == "--":
                break
            if arg.startswith("--"):
                flags.append(arg)
        return flags

    def unrecognized(self, extras: list[str]) -> str:
        """``unrecognized arguments: ...``, then a hint for each unknown flag that has one."""
        own = [s[2:] for action in self._actions for s in action.option_strings if s.startswith("--")]
        hints = []
        for arg in extras:
            if not arg.startswith("--") or arg == "--":
                continue
            name = arg[2:].partition("=")[0]
            command = self.prog.rsplit(" ", 1)[-1]
            others = [c for c in commands_of(name) if c != command]
            if others:
                commands = " and ".join(f"`elasticdl {c}`" for c in others)
                hints.append(f"--{name} is a flag of {commands}, not of `{self.prog}`")
            else:
                hint = flag_hint(name, own)
                hints.append(f"--{name}: {hint}" if hint else "")
        text = f"unrecognized arguments: {' '.join(extras)}"
        return "\n".join([text, *filter(None, hints)])

    def error(self, message: str):
        """argparse's error, with the nearest choice for a mistyped one (`elasticdl trian`)."""
        match = _INVALID_CHOICE.search(message)
        if match:
            close = nearest(match.group(1), re.findall(r"'([^']*)'", match.group(2)))
            message += f"; did you mean {close!r}?" if close else ""
        super().error(message)

    def format_usage(self) -> str:
        usage = super().format_usage()
        if usage.count("\n") <= MAX_USAGE_LINES:
            return usage
        return f"usage: {self.prog} [FLAGS]  (`{self.prog} --help` lists them)\n"


class _Subcommand(ElasticDLParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_subcommand = True
