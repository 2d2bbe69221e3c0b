"""The `moe-rl` dispatcher: fast top-level help, every subcommand's parser builds, help text
that reads as written."""
from __future__ import annotations

import subprocess
import sys

import pytest

from moe_rl import cli


def test_top_level_help_imports_no_subcommand():
    """`moe-rl --help` names every command without importing torch, megatron or a command module
    (it took 3.5 s when it built every subcommand's parser)."""
    probe = ("import sys\nfrom moe_rl import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
             "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformers')\n"
             "               or m in [mod for mod, _ in cli.SUBCOMMANDS.values()])\n"
             "print('HEAVY', heavy)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120).stdout
    assert "HEAVY []" in out, out[-2000:]
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    ") and line.split()]
    assert set(cli.SUBCOMMANDS) <= set(listed), listed


@pytest.mark.parametrize("name", list(cli.SUBCOMMANDS))
def test_every_subcommand_builds_its_parser(name):
    parser, mod = cli.command_parser(name)
    assert parser.prog == f"moe-rl {name}" and callable(mod.run)


def test_launch_slurm_help_keeps_its_paragraphs_apart(capsys):
    """The example command and the paragraph after it were joined (`...train.steps=3` then
    ` Trailing ...` on the next line, indented)."""
    with pytest.raises(SystemExit):
        cli.main(["launch", "slurm", "--help"])
    text = capsys.readouterr().out
    assert "train.steps=3\n\nTrailing `key.sub=value` words override the config for the trainer" in text
