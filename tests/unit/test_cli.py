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


@pytest.mark.parametrize("argv, needle", [
    (["check-parity", "--hf-model", "UNSUPPORTED", "--layouts", "single"], "topk_group=1 is not supported"),
    (["serve", "--model", "MISSING", "--port", "0"], "does not exist"),
    (["drift", "--before", "MISSING", "--after", "MISSING", "--data", "MISSING", "--out", "OUT"], "does not exist"),
    (["report", "MISSING"], "not found"),
    (["export", "--checkpoint", "MISSING", "--out", "OUT"], "missing does not exist"),
    (["launch", "slurm", "--config", "MISSING", "--nodes", "2"], "not found"),
    (["train", "--config", "MISSING"], "not found"),
    (["config", "no.such.key"], "unknown key"),
])
def test_input_a_command_cannot_take_is_one_line_and_exit_2(tmp_path, capfd, argv, needle):
    """Every subcommand, as `moe-rl train` does: what it cannot take is one line naming it on stderr, exit
    status 2, no traceback (check-parity printed 20 lines of one for an unsupported model, serve for a
    missing model directory, drift and report exited 1)."""
    from moe_rl.testing import make_tiny_deepseek_v3

    paths = {"MISSING": str(tmp_path / "missing"), "OUT": str(tmp_path / "out")}
    if "UNSUPPORTED" in argv:
        paths["UNSUPPORTED"] = str(make_tiny_deepseek_v3(tmp_path / "dsv3", n_group=2, topk_group=1,
                                                         num_experts_per_tok=4))
    capfd.readouterr()
    assert cli.main([paths.get(a, a) for a in argv]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    err = [line for line in err if "Loading weights" not in line]  # transformers' progress bar
    assert len(err) == 1 and needle in err[0] and err[0].startswith(f"moe-rl {argv[0]}"), err
