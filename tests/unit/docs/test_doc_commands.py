"""Every `moe-rl` command the README and the manual (docs/) show parses with the current CLI, and a
`moe-rl train` command's overrides are keys of the current config (a renamed flag or key fails here, not
in a user's terminal). The README tells the reader to activate the venv once and then uses bare
`moe-rl` / `python`, as the manual does."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from moe_rl.cli import SUBCOMMANDS, build_parser, command_parser
from moe_rl.config import load_config

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").rglob("*.md"))


def _shell_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S)


def _commands(text: str) -> list[list[str]]:
    """The `moe-rl ...` commands of the shell blocks, as argv after `moe-rl` (continuations joined,
    here-documents, comments, `[optional]` parts and leading VAR=value assignments dropped)."""
    out = []
    for block in _shell_blocks(text):
        heredoc = None
        for line in block.replace("\\\n", " ").splitlines():
            if heredoc is not None:
                heredoc = None if line.strip() == heredoc else heredoc
                continue
            if m := re.search(r"<<-?\s*'?\"?(\w+)", line):
                heredoc = m.group(1)
            line = re.sub(r"\[--?\w[^\]]*\]", "", line)  # an optional flag shown as [--dtype bf16]
            lex = shlex.shlex(line, posix=True, punctuation_chars=True)
            lex.whitespace_split, lex.commenters = True, "#"
            try:
                words, part = list(lex), []
            except ValueError:  # a quote spanning lines (a curl body): not a moe-rl command
                assert "moe-rl " not in line, line
                continue
            for w in words + [";"]:
                if w in ("&&", "||", ";", "|", "&", ">", ">>", "<", "<<"):
                    while part and re.match(r"^[A-Z_][A-Z0-9_]*=", part[0]):
                        part = part[1:]
                    if part and part[0] == "moe-rl" and len(part) > 1:
                        out.append(part[1:])
                    part = [] if w != ">" and w != ">>" else ["<redirect>"]
                else:
                    part.append(w)
    return out


README_COMMANDS = _commands(README.read_text())
COMMANDS = [argv for page in PAGES for argv in _commands(page.read_text())]


def test_the_readme_shows_commands_and_says_to_activate_the_venv_first():
    text = README.read_text()
    assert len(README_COMMANDS) >= 8 and len(COMMANDS) >= 60
    assert "source .venv/bin/activate" in text
    assert text.index("source .venv/bin/activate") < text.index("moe-rl train")
    for page in PAGES:  # one way of calling, not two
        body = page.read_text()
        assert ".venv/bin/moe-rl" not in body and ".venv/bin/python " not in body, page.relative_to(ROOT)


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a)[:60] for a in COMMANDS])
def test_a_documented_command_parses_with_the_current_cli(argv):
    if argv[0] in ("--help", "-h") or argv[-1] in ("--help", "-h"):
        assert argv[0] in SUBCOMMANDS or argv[0].startswith("-")
        return
    if argv[0].startswith("-"):  # a top-level option (moe-rl --markdown)
        build_parser().parse_args(argv)
        return
    assert argv[0] in SUBCOMMANDS, f"moe-rl {argv[0]}: no such subcommand"
    parser, _ = command_parser(argv[0])
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"moe-rl {' '.join(argv)}: the CLI refuses these arguments")
    config = getattr(args, "config", None)
    if argv[0] == "train" and config and (ROOT / config).is_file():
        overrides = [o for o in getattr(args, "overrides", []) if "=" in o]
        load_config(str(ROOT / config), overrides)  # ConfigError names an unknown or mistyped key
