"""`moe-rl config`: the reference of every config key, generated from the `RunConfig` tree.

The reference is read from the declarations themselves (`moe_rl.configurable`): the type is
the field's annotation, the default the dataclass default, the allowed values the field's
`choice(...)` options (a registry's names for `registry_names`) or its `ranged(...)` bounds,
and the doc the attribute docstring on the line(s) after the field. So it cannot drift
from the code, and `docs/reference/config.md` is this module's Markdown output:

    moe-rl config                      # every section with its keys
    moe-rl config algo                 # one section (nested sections included)
    moe-rl config algo.max_staleness   # one key with its whole doc
    moe-rl config --markdown > docs/reference/config.md

An unknown name exits 2 with the nearest valid names (the "did you mean" of `moe_rl.config`).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import sys
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator

from moe_rl.config import RunConfig, _field_names, _hints, _unknown_key_message

REGENERATE = "moe-rl config --markdown > docs/reference/config.md"


@dataclass(frozen=True)
class KeyDoc:
    """One leaf key of the config: what `moe-rl config KEY` prints."""

    key: str
    """Dotted name, e.g. `log.report`."""
    type: str
    """The annotation as declared, e.g. `str | None`."""
    default: Any
    """The dataclass default (a default_factory's value for lists)."""
    doc: str
    """The whole attribute docstring, dedented; '' when the field has none."""
    meta: Any = dataclasses.field(default=None, repr=False, compare=False)
    """The field's metadata, where `choice(...)` and `ranged(...)` put what is allowed."""

    @property
    def allowed(self) -> str:
        """`choice(...)` options or `ranged(...)` bounds; '' when the type says it all.

        Read when asked: a registry's names import the registry (and torch)."""
        choices, bounds = self.meta.get("choices"), self.meta.get("range")
        if choices is not None:
            return ", ".join(choices)
        return str(bounds) if bounds is not None else ""

    @property
    def summary(self) -> str:
        return first_sentence(self.doc)


@dataclass(frozen=True)
class Section:
    """A dataclass section (`algo`, `model.tiny`, ...): its doc and its own leaf keys."""

    name: str
    cls: type
    keys: tuple[KeyDoc, ...]

    @property
    def summary(self) -> str:
        return first_sentence(inspect.getdoc(self.cls) or "")


# --------------------------------------------------------------------------
# Reading the tree
# --------------------------------------------------------------------------

@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: `name: type = ...` followed by a string statement."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def first_sentence(doc: str) -> str:
    """The first sentence of a doc's first paragraph, on one line."""
    para = " ".join(doc.split("\n\n", 1)[0].split())
    m = re.search(r"(?<!\be\.g)(?<!\bi\.e)\.(\s|$)", para)
    return para[:m.start() + 1] if m else para


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _type_name(f: dataclasses.Field, tp: Any) -> str:
    return f.type if isinstance(f.type, str) else getattr(tp, "__name__", str(tp))


def sections(cls: type = RunConfig, prefix: str = "") -> Iterator[Section]:
    """Every section below `cls`, depth first, each before its nested sections."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if not dataclasses.is_dataclass(tp):
            continue
        name = f"{prefix}{f.name}"
        yield Section(name, tp, tuple(_keys(tp, name + ".")))
        yield from sections(tp, name + ".")


def _keys(cls: type, prefix: str) -> Iterator[KeyDoc]:
    hints, docs = _hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        if not dataclasses.is_dataclass(hints[f.name]):
            yield KeyDoc(f"{prefix}{f.name}", _type_name(f, hints[f.name]), _default(f),
                         docs.get(f.name, ""), f.metadata)


def reference() -> list[KeyDoc]:
    """Every leaf key of `RunConfig`, in section order."""
    return [k for s in sections() for k in s.keys]


def show_default(value: Any) -> str:
    """A default as it would be written in YAML: null, true/false, quoted strings."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, list, dict)):
        return json.dumps(value)
    return repr(value)


# --------------------------------------------------------------------------
# Looking a name up
# --------------------------------------------------------------------------

def lookup(name: str) -> Section | KeyDoc:
    """The section or key called `name`; KeyError with a "did you mean" message otherwise."""
    cls: Any = RunConfig
    parts = name.split(".")
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i]) + "." if i else ""
        if not dataclasses.is_dataclass(cls) or part not in _hints(cls):
            raise KeyError(_unknown(name, part, prefix, cls))
        cls = _hints(cls)[part]
    if dataclasses.is_dataclass(cls):
        return next(s for s in sections() if s.name == name)
    return next(k for k in reference() if k.key == name)


def _unknown(name: str, part: str, prefix: str, cls: Any) -> str:
    if not dataclasses.is_dataclass(cls):  # a name below a leaf key, e.g. algo.loss.x
        return f"{name}: unknown key: {prefix.rstrip('.')} is a key, not a section"
    message = _unknown_key_message(part, prefix, _field_names(cls), "in the config reference")
    if name != f"{prefix}{part}":
        message = f"{name}: unknown key; " + message
    same_leaf = [k.key for k in reference() if k.key.rsplit(".", 1)[-1] == name]
    if same_leaf:  # a bare leaf name: say which sections have it
        message += f"; did you mean {' or '.join(repr(k) for k in same_leaf)}?"
    return message


# --------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------

def _text_section(s: Section) -> list[str]:
    lines = [f"{s.name}: {s.summary}" if s.summary else s.name]
    for k in s.keys:
        allowed = f"; {'one of ' if ', ' in k.allowed else ''}{k.allowed}" if k.allowed else ""
        lines.append(f"  {k.key} = {show_default(k.default)}  ({k.type}{allowed})")
        if k.summary:
            lines.append(f"      {k.summary}")
    return lines


def render_text(name: str | None = None) -> str:
    """Plain-text reference of everything, of one section (with its nested ones) or of one key."""
    if name is None:
        return "\n\n".join("\n".join(_text_section(s)) for s in sections()) + "\n"
    found = lookup(name)
    if isinstance(found, KeyDoc):
        lines = [found.key, f"  type:    {found.type}", f"  default: {show_default(found.default)}"]
        if found.allowed:
            lines.append(f"  allowed: {found.allowed}")
        if found.doc:
            lines += [""] + [f"  {line}" if line else "" for line in found.doc.splitlines()]
        return "\n".join(lines) + "\n"
    chosen = [s for s in sections() if s.name == name or s.name.startswith(name + ".")]
    return "\n\n".join("\n".join(_text_section(s)) for s in chosen) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown() -> str:
    """The whole reference as Markdown: one table per section (what docs/reference/config.md holds)."""
    out = ["# Config reference", "",
           f"Generated from the `RunConfig` dataclass tree (`moe_rl/config.py`) by `{REGENERATE}`;",
           "do not edit by hand. Set a key in the YAML file or as a `key.sub=value` override of",
           "`moe-rl train`; `moe-rl config KEY` prints a key's whole doc.", ""]
    for s in sections():
        out += [f"## `{s.name}`", ""]
        if s.summary:
            out += [s.summary, ""]
        if not s.keys:
            continue
        out += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
        for k in s.keys:
            allowed = f"`{_cell(k.allowed)}`" if k.allowed else ""
            out.append(f"| `{k.key}` | `{_cell(k.type)}` | `{_cell(show_default(k.default))}` | {allowed} "
                       f"| {_cell(k.summary)} |")
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------
# The subcommand
# --------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `moe-rl config`."""
    parser.add_argument("name", nargs="?", default=None, metavar="SECTION|KEY",
                        help="a section (algo, model.tiny) or a dotted key (algo.max_staleness); "
                             "default: every section")
    parser.add_argument("--markdown", action="store_true",
                        help=f"print the whole reference as Markdown ({REGENERATE})")


def run(args: argparse.Namespace) -> int:
    """Print the reference; exit 2 naming the nearest valid names when the name is unknown."""
    if args.markdown:
        if args.name is not None:
            print("moe-rl config: --markdown prints the whole reference; give no SECTION|KEY", file=sys.stderr)
            return 2
        sys.stdout.write(render_markdown())
        return 0
    try:
        sys.stdout.write(render_text(args.name))
    except KeyError as e:
        print(f"moe-rl config: {e.args[0]}", file=sys.stderr)
        return 2
    return 0
