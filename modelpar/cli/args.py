"""Command-line parsers built from typed dataclasses (jsonargparse), one spelling: dashes.

`add_fields(parser, cls)` adds one flag per dataclass field: ``--global-batch-size`` for
``global_batch_size``, its type from the annotation, its default from the field, its help from the
class docstring (``Args:`` / ``Attributes:``). Booleans are bare and negated (``--compile``,
``--no-compile``). A field added to `TrainConfig` or `ParallelPlan` therefore appears on the command
line by itself. `normalize_argv` accepts the old underscore spellings of ``train`` for one release
(with a deprecation note) and ``--flag true|false`` for booleans.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import typing
from argparse import RawDescriptionHelpFormatter

BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def flag(name: str) -> str:
    """``global_batch_size`` -> ``--global-batch-size``."""
    return "--" + name.replace("_", "-")


def make_parser(prog: str, description: str, *, epilog: str = "", config_file: bool = False):
    """A jsonargparse parser that keeps the description's and epilog's line breaks (examples)."""
    from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

    class _Formatter(DefaultHelpFormatter, RawDescriptionHelpFormatter):
        """jsonargparse's formatter, keeping line breaks."""

    p = ArgumentParser(prog=prog, description=description, epilog=epilog, formatter_class=_Formatter,
                       default_config_files=[], default_env=False, exit_on_error=False,
                       print_config="--print-config" if config_file else None)
    if config_file:
        p.add_argument("--config", action=ActionConfigFile, help="YAML/JSON file of the options below "
                       "(keys as the field names, e.g. global_batch_size: 64; plan fields under layout:, e.g. "
                       "layout: {tp: 2}); flags after it override it")
    return p


def field_docs(cls) -> dict[str, str]:
    """Field name -> its description in ``cls``'s docstring (one line)."""
    import docstring_parser

    doc = docstring_parser.parse(cls.__doc__ or "")
    return {p.arg_name: " ".join(p.description.split()) for p in doc.params if p.description}


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_fields(parser, cls, *, only=None, skip=(), dest_prefix: str = "", defaults: dict | None = None,
               group: str | None = None, docs: dict | None = None) -> list[str]:
    """Add a flag per field of dataclass ``cls`` (``only`` / ``skip`` filter by name; ``defaults``
    replaces field defaults; ``dest_prefix`` nests the values, e.g. ``"layout."``). Returns the
    added field names."""
    from jsonargparse import ActionYesNo

    hints = typing.get_type_hints(cls)
    docs = {**field_docs(cls), **(docs or {})}
    target = parser.add_argument_group(group) if group else parser
    added = []
    for f in dataclasses.fields(cls):
        if (only is not None and f.name not in only) or f.name in skip:
            continue
        default = (defaults or {}).get(f.name, _default(f))
        tp = hints[f.name]
        help_ = docs.get(f.name, "")
        dest = dest_prefix + f.name
        if tp is bool or tp == bool | None:          # bare and negated (None: not given)
            target.add_argument(flag(f.name), dest=dest, action=ActionYesNo(no_prefix="no-"), default=default,
                                help=help_)
        else:
            target.add_argument(flag(f.name), dest=dest, type=_cli_type(tp), default=default, help=help_)
        added.append(f.name)
    return added


def _cli_type(tp):
    """Tuples of the plan (``tuple[int, ...] | None``) are given as lists on the command line."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is tuple:
        return list[args[0]] if args else list
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and typing.get_origin(inner[0]) is tuple:
            return list[typing.get_args(inner[0])[0]] | None
    return tp


def bool_dests(parser) -> dict[str, str]:
    """Option string -> dest of every boolean (yes/no) flag."""
    from jsonargparse import ActionYesNo

    out = {}
    for a in parser._actions:
        if isinstance(a, ActionYesNo):
            for s in a.option_strings:
                if not s.startswith("--no-"):
                    out[s] = a.dest
    return out


def option_strings(parser) -> set[str]:
    """Every flag the parser accepts (including ``-h``/``--help``)."""
    return {s for a in parser._actions for s in a.option_strings}


def normalize_argv(argv: list[str], parser, *, prog: str, legacy_underscores: bool = False) -> list[str]:
    """``--flag true|false`` of a boolean -> ``--flag`` / ``--no-flag``; with ``legacy_underscores``,
    an old underscore spelling (``--global_batch_size``) -> its dashed flag, with one deprecation
    note on stderr naming the new spellings."""
    known = option_strings(parser)
    bools = bool_dests(parser)
    out, renamed = [], []
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        if legacy_underscores and name.startswith("--") and "_" in name and name not in known:
            new = "--" + name[2:].replace("_", "-")
            if new in known:
                renamed.append(f"{name} -> {new}")
                name = new
        if name in bools:
            nxt = val if eq else (argv[i + 1] if i + 1 < len(argv) else None)
            if nxt is not None and nxt.lower() in BOOL_WORDS:
                out.append(name if BOOL_WORDS[nxt.lower()] else "--no-" + name[2:])
                i += 1 if eq else 2
                continue
        out.append(name + eq + val if eq else name)
        i += 1
    if renamed:
        print(f"{prog}: note: underscore spellings are deprecated and will be removed in the next release; "
              f"use {', '.join(renamed)}", file=sys.stderr)
    return out


def parse(parser, argv: list[str]):
    """Parse; a bad argument raises ValueError with jsonargparse's one-line message (the caller
    prints it as ``modelpar CMD: error: ...`` and exits 2); ``--help`` exits 0 as usual."""
    from argparse import ArgumentError

    try:
        return parser.parse_args(argv)
    except ArgumentError as e:
        msg = " ".join(str(e).split())
        m = re.match(r'Parser key "(\w+)": Expected a <class \'dict\'>\. Got value: (.*)$', msg)
        if m:               # a JSON object option (--model-config): say what JSON found wrong
            key, value = m.groups()
            try:
                json.loads(value)
                why = "not an object"
            except json.JSONDecodeError as je:
                why = f"JSON: {je}"
            msg = (f"--{key.replace('_', '-')} must be a JSON object, e.g. '{{\"n_layer\": 8}}'; got {value!r} "
                   f"({why})")
        m = re.match(r'Parser key "(?:\w+\.)?(\w+)": Does not validate against any of the Union subtypes '
                     r'Subtypes: \[list\[(\w+)\]', msg)
        if m:               # a list option given as separate words or with commas only (--stage-boundaries 1 2)
            key, item = m.groups()
            example = "'[4,8]'" if item == "int" else "'[\"cpu\",\"cpu\"]'"
            msg = f"--{key.replace('_', '-')} takes a JSON list in one argument, e.g. --{key.replace('_', '-')} {example}"
        raise ValueError(msg) from None


def given_fields(parser, argv: list[str]) -> set[str]:
    """Dests the user set on the command line (or in a --config file), defaults excluded."""
    from argparse import ArgumentError

    try:
        ns = parser.parse_args(argv, defaults=False)
    except ArgumentError:
        return set()
    d = ns.as_dict()
    out = set()

    def walk(prefix, x):
        for k, v in x.items():
            if isinstance(v, dict) and k in ("plan_options", "layout"):
                walk(prefix + k + ".", v)
            elif k not in ("config", "__path__"):
                out.add(prefix + k)
    walk("", d)
    return out


def report_errors(main, argv: list[str], prog: str) -> int:
    """``main(argv)`` with bad input (a ValueError) reported as one line ``PROG: error: ...`` on stderr
    and exit code 2, no traceback: the one place every command's entry point does this."""
    import sys

    try:
        return main(argv)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
