"""Stand-ins for `srun`, `sbatch` and `scontrol`: run a rendered batch script on one machine.

The CPU rehearsal of a multi-node job. "Nodes" are names that resolve to this
machine (loopback addresses such as 127.0.0.1 and 127.0.0.2, so each node's
servers can bind the same ports); a node's tasks of one srun step form one local
process group, so a test can kill a whole "node" with one signal.

What they do, as far as the rendered scripts rely on it:

- `sbatch [--parsable] SCRIPT`: reads `#SBATCH` lines (--nodes, --ntasks-per-node,
  --cpus-per-task, --output, --chdir, --job-name), gives the job the first N stand-in
  nodes and runs the script with bash in the background, with SLURM_JOB_ID,
  SLURM_JOB_NODELIST, SLURM_JOB_NUM_NODES, SLURM_RESTART_COUNT (after a requeue) set,
  and, as sbatch does for --ntasks-per-node, the job's SLURM_NTASKS,
  SLURM_NTASKS_PER_NODE and SLURM_TASKS_PER_NODE (SLURM_CPUS_PER_TASK likewise). When the script ends, every process the
  job started that is still alive is recorded as a leftover and killed (SLURM kills
  them at job end too; a correct script leaves none). A requeued job runs again.
- `srun`: --nodes, --ntasks, --ntasks-per-node, --nodelist, --output (%j %s %N %n %t),
  --label, --kill-on-bad-exit, --export=ALL,K=V; other options are accepted and
  ignored. As SLURM 22.05's srun, a step takes --ntasks and --ntasks-per-node it does
  not give from SLURM_NTASKS / SLURM_NTASKS_PER_NODE (the job's, inside a batch script),
  and when --ntasks over --nodes disagrees with --ntasks-per-node it prints "can't
  honor --ntasks-per-node" (only when the tasks outnumber it, as srun) and drops it. Tasks are placed in blocks over the nodes and get SLURM_PROCID,
  SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS, SLURM_NNODES, SLURM_STEP_NODELIST,
  SLURM_TASKS_PER_NODE, SLURMD_NODENAME and SLURM_STEP_ID, like real srun. There is
  no container runtime here: with pyxis' --container-image the tasks run on the host
  all the same, with `MOE_RL_STANDIN_CONTAINER=<image>` in their environment, so a
  test can tell what the job would have run inside the image from what it would have
  run on the bare host (--container-mounts is accepted and ignored). Signals
  srun receives (TERM, INT, USR1, USR2, HUP) are passed to every task; after TERM or
  INT, tasks still alive KILL_WAIT seconds later get SIGKILL (slurmstepd's KillWait).
  When its tasks have exited, what is left in their process groups is killed.
- `scontrol show hostnames [LIST]`, `scontrol requeue JOBID`.

State lives under `$MOE_RL_STANDIN_DIR`; the stand-in nodes are `$MOE_RL_STANDIN_NODES`
(comma-separated). `install()` writes the three commands into a directory to put
first on PATH. Every process of a job carries `MOE_RL_STANDIN_JOB=<id>` in its
environment, which is how leftovers are found.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator, Mapping, Sequence

STATE_ENV = "MOE_RL_STANDIN_DIR"
NODES_ENV = "MOE_RL_STANDIN_NODES"
JOB_ENV = "MOE_RL_STANDIN_JOB"
KILL_WAIT_ENV = "MOE_RL_STANDIN_KILL_WAIT"
CONTAINER_ENV = "MOE_RL_STANDIN_CONTAINER"  # set in the tasks of a step started with --container-image
MAX_REQUEUES = 3
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


class StandinError(RuntimeError):
    """A request the stand-ins (or SLURM itself) would refuse."""


# ----------------------------------------------------------------------------- host lists

def expand_hostlist(text: str) -> list[str]:
    """`gpu[01-03,7],cpu1` -> gpu01 gpu02 gpu03 gpu7 cpu1 (zero padding kept), as scontrol does."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,]*)", text.strip()):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise StandinError(f"bad host range {part!r} in {text!r}")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}{suffix}")
    return hosts


# ----------------------------------------------------------------------------- state

def _state() -> Path:
    path = os.environ.get(STATE_ENV)
    if not path:
        raise StandinError(f"{STATE_ENV} is not set: install the stand-ins with moe_rl.launch.standin.install()")
    return Path(path)


def _next_number(state: Path, name: str, start: int) -> int:
    """Atomically increment the counter file `state/name` (job ids, step ids)."""
    state.mkdir(parents=True, exist_ok=True)
    with open(state / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = state / name
        value = int(path.read_text()) if path.is_file() else start
        path.write_text(str(value + 1))
    return value


def job_dir(state: Path, job: str | int) -> Path:
    return Path(state) / "jobs" / str(job)


# ----------------------------------------------------------------------------- srun

@dataclass
class _Task:
    rank: int
    node: str
    node_index: int
    local_id: int
    proc: subprocess.Popen | None = None


def _srun_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="srun", allow_abbrev=False)
    p.add_argument("-N", "--nodes", type=int)
    p.add_argument("-n", "--ntasks", type=int)
    p.add_argument("--ntasks-per-node", type=int)
    p.add_argument("-w", "--nodelist")
    p.add_argument("-o", "--output")
    p.add_argument("-e", "--error")
    p.add_argument("-l", "--label", action="store_true")
    p.add_argument("-K", "--kill-on-bad-exit", nargs="?", const="1", default="0")
    p.add_argument("--export", default="ALL")
    for flag in ("--overlap", "--exclusive", "--exact"):
        p.add_argument(flag, action="store_true")
    for opt in ("--container-image", "--container-mounts", "--gpus-per-node", "--gpus-per-task", "--cpu-bind",
                "--mpi", "--mem", "--cpus-per-task", "--gres", "-J", "--job-name", "-W", "--wait"):
        p.add_argument(opt)
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def _inherit_counts(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Fill --ntasks / --ntasks-per-node from the environment where the command line leaves them
    out: srun reads SLURM_NTASKS (and the older SLURM_NPROCS) and SLURM_NTASKS_PER_NODE as those
    options, and a batch script's environment holds the job's values."""
    if args.ntasks is None:
        value = environ.get("SLURM_NTASKS") or environ.get("SLURM_NPROCS")
        args.ntasks = int(value) if value else None
    if args.ntasks_per_node is None and environ.get("SLURM_NTASKS_PER_NODE"):
        args.ntasks_per_node = int(environ["SLURM_NTASKS_PER_NODE"])


def _reconcile_counts(nodes: int, ntasks: int | None, per_node: int | None) -> int | None:
    """SLURM 22.05 srun's rule (opt.c, _opt_verify) when --nodes and --ntasks are both set: a
    --ntasks-per-node that disagrees with ntasks / nodes is dropped, with a warning when the
    tasks outnumber it. Returns the per-node count that stands."""
    if ntasks is None or per_node is None or per_node == ntasks // nodes:
        return per_node
    if ntasks > per_node:
        print(f"srun: Warning: can't honor --ntasks-per-node set to {per_node} which doesn't match the requested "
              f"tasks {ntasks} with the number of requested nodes {nodes}. Ignoring --ntasks-per-node.",
              file=sys.stderr, flush=True)
    return None


def _place_tasks(nodes: list[str], ntasks: int | None, per_node: int | None) -> list[_Task]:
    """Block distribution: node 0 gets the first tasks, as srun's default."""
    per_node = _reconcile_counts(len(nodes), ntasks, per_node)
    if per_node is not None:
        counts = [per_node] * len(nodes)
    else:
        n = ntasks if ntasks is not None else len(nodes)
        if n < len(nodes):
            raise StandinError(f"srun: error: {n} task(s) cannot cover {len(nodes)} node(s)")
        counts = [n // len(nodes) + (1 if i < n % len(nodes) else 0) for i in range(len(nodes))]
    if ntasks is not None and ntasks != sum(counts):
        raise StandinError(f"srun: error: --ntasks={ntasks} does not match {len(nodes)} node(s) x {per_node}")
    tasks, rank = [], 0
    for i, (node, count) in enumerate(zip(nodes, counts)):
        for local in range(count):
            tasks.append(_Task(rank, node, i, local))
            rank += 1
    return tasks


def _tasks_per_node_text(counts: list[int]) -> str:
    """SLURM's compressed form: `2(x3)` or `2,1`."""
    out: list[str] = []
    i = 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        out.append(f"{counts[i]}(x{j - i})" if j - i > 1 else str(counts[i]))
        i = j
    return ",".join(out)


def _step_nodes(args: argparse.Namespace, job_nodes: list[str]) -> list[str]:
    if args.nodelist:
        nodes = expand_hostlist(args.nodelist)
        unknown = [n for n in nodes if n not in job_nodes]
        if unknown:
            raise StandinError(f"srun: error: node(s) {','.join(unknown)} are not in the job ({','.join(job_nodes)})")
        if args.nodes is not None and args.nodes != len(nodes):
            raise StandinError(f"srun: error: --nodes={args.nodes} but --nodelist names {len(nodes)} node(s)")
        return nodes
    count = args.nodes if args.nodes is not None else (1 if args.ntasks_per_node is None and args.ntasks == 1
                                                        else len(job_nodes))
    if count > len(job_nodes):
        raise StandinError(f"srun: error: --nodes={count} but the job has {len(job_nodes)} node(s)")
    return job_nodes[:count]


def _export_env(spec: str) -> dict[str, str]:
    """`--export=ALL,K=V,...`: the K=V pairs (ALL keeps the caller's environment, as we always do)."""
    extra = {}
    for item in spec.split(","):
        if "=" in item:
            key, _, value = item.partition("=")
            extra[key] = value
    return extra


def _output_path(pattern: str, job: str, step: int, task: _Task) -> str:
    subs = {"j": job, "J": f"{job}.{step}", "s": str(step), "N": task.node, "n": str(task.node_index),
            "t": str(task.rank), "%": "%"}
    return re.sub(r"%([jJsNnt%])", lambda m: subs[m.group(1)], pattern)


class _Outputs:
    """Output files of a step, opened once each; --label prefixes each line with the task id."""

    def __init__(self, label: bool):
        self.label = label
        self.files: dict[str, IO[bytes]] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.threads: list[threading.Thread] = []

    def target(self, path: str | None) -> tuple[IO[bytes] | None, threading.Lock | None]:
        if path is None:
            return None, None
        if path not in self.files:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.files[path] = open(path, "ab", buffering=0)
            self.locks[path] = threading.Lock()
        return self.files[path], self.locks[path]

    def pump(self, rank: int, stream: IO[bytes], dest: IO[bytes] | None, lock: threading.Lock | None) -> None:
        """Copy a task's output line by line with its label, in a thread."""
        def run() -> None:
            for line in iter(stream.readline, b""):
                data = f"{rank}: ".encode() + line
                if dest is None:
                    sys.stdout.buffer.write(data)
                    sys.stdout.flush()
                else:
                    with lock:  # type: ignore[union-attr]
                        dest.write(data)
            stream.close()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def close(self) -> None:
        for t in self.threads:
            t.join(5)
        for f in self.files.values():
            f.close()


class _Step:
    """One srun invocation: its tasks, their process groups (one per node), signal forwarding."""

    def __init__(self, args: argparse.Namespace, job: str, job_nodes: list[str], state: Path):
        self.args, self.job, self.state = args, job, state
        nodes = _step_nodes(args, job_nodes)  # before the inherited counts: the step's own flags pick its nodes
        _inherit_counts(args, os.environ)
        self.tasks = _place_tasks(nodes, args.ntasks, args.ntasks_per_node)
        self.nodes = nodes
        self.step = _next_number(job_dir(state, job), "next_step", 0)
        self.groups: dict[str, list[int]] = {}  # node -> process group ids of its tasks
        self.kill_at: float | None = None
        self.kill_wait = float(os.environ.get(KILL_WAIT_ENV, "10"))
        self.outputs = _Outputs(args.label)

    def env(self, task: _Task) -> dict[str, str]:
        counts = [sum(1 for t in self.tasks if t.node == n) for n in self.nodes]
        # A task "in the container" is marked; one outside must not inherit its caller's mark.
        container = {CONTAINER_ENV: self.args.container_image} if self.args.container_image else {}
        env = {k: v for k, v in os.environ.items() if k != CONTAINER_ENV}
        return {**env, **_export_env(self.args.export), **container, JOB_ENV: self.job,
                "SLURM_PROCID": str(task.rank), "SLURM_LOCALID": str(task.local_id),
                "SLURM_NODEID": str(task.node_index), "SLURM_NTASKS": str(len(self.tasks)),
                "SLURM_NPROCS": str(len(self.tasks)), "SLURM_NNODES": str(len(self.nodes)),
                "SLURM_STEP_NUM_TASKS": str(len(self.tasks)), "SLURM_STEP_NUM_NODES": str(len(self.nodes)),
                "SLURM_STEP_NODELIST": ",".join(self.nodes), "SLURM_TASKS_PER_NODE": _tasks_per_node_text(counts),
                "SLURM_STEP_TASKS_PER_NODE": _tasks_per_node_text(counts), "SLURMD_NODENAME": task.node,
                "SLURM_STEP_ID": str(self.step), "SLURM_STEPID": str(self.step)}

    def start(self) -> None:
        for task in self.tasks:
            self._spawn(task)

    def _spawn(self, task: _Task) -> None:
        pattern = self.args.output
        dest, lock = self.outputs.target(_output_path(pattern, self.job, self.step, task) if pattern else None)
        # One process group per node and step, inside srun's session (setpgid cannot cross
        # sessions). Popen's process_group needs Python 3.11; before, each task gets a session.
        first = task.node not in self.groups
        group: dict = {"start_new_session": True}
        if sys.version_info >= (3, 11):
            group = {"process_group": 0 if first else self.groups[task.node][0]}
        stdout = subprocess.PIPE if self.args.label else (dest if dest is not None else None)
        task.proc = subprocess.Popen(self.args.command, env=self.env(task), stdin=subprocess.DEVNULL,
                                     stdout=stdout, stderr=subprocess.STDOUT, **group)
        if self.args.label:
            self.outputs.pump(task.rank, task.proc.stdout, dest, lock)  # type: ignore[arg-type]
        if first or "start_new_session" in group:
            self.groups.setdefault(task.node, []).append(task.proc.pid)
            node_dir = Path(self.state) / "nodes" / task.node
            node_dir.mkdir(parents=True, exist_ok=True)
            with open(node_dir / f"{self.job}.{self.step}.pgid", "a") as f:
                f.write(f"{task.proc.pid}\n")

    def signal(self, sig: int) -> None:
        for pgid in (g for groups in self.groups.values() for g in groups):
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig in (signal.SIGTERM, signal.SIGINT) and self.kill_at is None:
            self.kill_at = time.monotonic() + self.kill_wait

    def wait(self) -> int:
        """Wait for every task; returns srun's exit code (the first failure's)."""
        failed: int | None = None
        pending = list(self.tasks)
        while pending:
            for task in list(pending):
                rc = task.proc.poll()  # type: ignore[union-attr]
                if rc is None:
                    continue
                pending.remove(task)
                if rc != 0:
                    what = f"Exited with exit code {rc}" if rc > 0 else f"Killed by signal {-rc}"
                    print(f"srun: error: {task.node}: task {task.rank}: {what}", file=sys.stderr, flush=True)
                    failed = failed if failed is not None else (rc if rc > 0 else 128 - rc)
                    if self.args.kill_on_bad_exit not in ("0", None) and pending:
                        self.signal(signal.SIGTERM)
            if self.kill_at is not None and time.monotonic() > self.kill_at and pending:
                self.signal(signal.SIGKILL)
            time.sleep(0.05)
        self.signal(signal.SIGKILL)  # the step is over: nothing it started outlives it
        self.outputs.close()
        return failed or 0


def srun_main(argv: Sequence[str]) -> int:
    args = _srun_parser().parse_args(list(argv))
    if not args.command:
        raise StandinError("srun: fatal: no command to run")
    job, nodelist = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_JOB_NODELIST")
    if not job or not nodelist:
        raise StandinError("srun: error: the stand-in srun runs inside a stand-in sbatch job only")
    step = _Step(args, job, expand_hostlist(nodelist), _state())
    for sig in _FORWARDED:
        signal.signal(sig, lambda s, _f: step.signal(s))
    step.start()
    return step.wait()


# ----------------------------------------------------------------------------- sbatch

def sbatch_directives(script: str) -> list[str]:
    """Options from the `#SBATCH` lines before the first command, as sbatch reads them."""
    opts = []
    for line in script.splitlines()[1:]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        if stripped.startswith("#SBATCH"):
            opts += shlex.split(stripped[len("#SBATCH"):], comments=False)
    return opts


def _option(opts: Sequence[str], *names: str) -> str | None:
    """Last value of an option given as `--name=value`, `--name value` or `-X value`."""
    value = None
    for i, opt in enumerate(opts):
        for name in names:
            if opt.startswith(name + "="):
                value = opt[len(name) + 1:]
            elif opt == name and i + 1 < len(opts):
                value = opts[i + 1]
    return value


def sbatch_main(argv: Sequence[str]) -> int:
    argv = list(argv)
    script_at = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if script_at is None:
        raise StandinError("sbatch: error: no batch script given")
    cli_opts, script = argv[:script_at], Path(argv[script_at]).absolute()
    opts = sbatch_directives(script.read_text()) + cli_opts  # the command line wins
    available = [n for n in os.environ.get(NODES_ENV, "").split(",") if n]
    wanted = int(_option(opts, "--nodes", "-N") or 1)
    if wanted > len(available):
        raise StandinError(f"sbatch: error: Requested node configuration is not available "
                           f"({wanted} nodes, the stand-in has {len(available)})")
    state = _state()
    job = str(_next_number(state, "next_job", 1000))
    jd = job_dir(state, job)
    jd.mkdir(parents=True)
    spec = {"script": str(script), "args": argv[script_at + 1:], "nodes": available[:wanted],
            "output": _option(opts, "--output", "-o") or str(Path.cwd() / "slurm-%j.out"),
            "chdir": _option(opts, "--chdir", "-D") or str(Path.cwd()),
            "name": _option(opts, "--job-name", "-J") or script.name,
            "task_env": _job_task_env(opts, wanted)}
    (jd / "spec.json").write_text(json.dumps(spec, indent=1))
    subprocess.Popen([sys.executable, "-m", "moe_rl.launch.standin", "_job", str(state), job],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
    print(job if "--parsable" in cli_opts else f"Submitted batch job {job}", flush=True)
    return 0


# Variables sbatch sets from the job's task options; the batch script's srun steps read them.
_TASK_VARS = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_CPUS_PER_TASK")


def _job_task_env(opts: Sequence[str], nodes: int) -> dict[str, str]:
    """SLURM_NTASKS & co. as sbatch sets them for `--ntasks-per-node` / `--cpus-per-task`."""
    env = {}
    per_node = _option(opts, "--ntasks-per-node")
    if per_node is not None:
        env.update({"SLURM_NTASKS_PER_NODE": per_node, "SLURM_NTASKS": str(nodes * int(per_node)),
                    "SLURM_NPROCS": str(nodes * int(per_node)),
                    "SLURM_TASKS_PER_NODE": _tasks_per_node_text([int(per_node)] * nodes)})
    cpus = _option(opts, "--cpus-per-task", "-c")
    if cpus is not None:
        env["SLURM_CPUS_PER_TASK"] = cpus
    return env


def _job_processes(job: str) -> Iterator[tuple[int, str]]:
    """(pid, command line) of live processes carrying the job's marker in their environment."""
    marker = f"{JOB_ENV}={job}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if marker not in (d / "environ").read_bytes().split(b"\0"):
                continue
            stat = (d / "stat").read_text()
            if stat[stat.rfind(")") + 2:].split()[0] == "Z":
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        yield int(d.name), cmd


def live_job_processes(job: str | int) -> list[tuple[int, str]]:
    """Processes of a stand-in job that are still alive (for tests: none once the job is done)."""
    return list(_job_processes(str(job)))


def _sweep(job: str, jd: Path, run: int) -> None:
    """Record and kill what the batch script left running, as SLURM's job cleanup would."""
    left = list(_job_processes(job))
    if left:
        with open(jd / "leftovers.txt", "a") as f:
            for pid, cmd in left:
                f.write(f"run {run}: pid {pid}: {cmd}\n")
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def job_main(state: str, job: str) -> int:
    """Run a submitted job's script (again after each requeue) and clean up after it."""
    os.environ[STATE_ENV] = state
    jd = job_dir(Path(state), job)
    spec = json.loads((jd / "spec.json").read_text())
    rc = 0
    for run in range(MAX_REQUEUES + 1):
        outer = {k: v for k, v in os.environ.items() if k not in _TASK_VARS}  # only this job's counts
        env = {**outer, **spec.get("task_env", {}), JOB_ENV: job, "SLURM_JOB_ID": job, "SLURM_JOBID": job,
               "SLURM_JOB_NODELIST": ",".join(spec["nodes"]), "SLURM_NODELIST": ",".join(spec["nodes"]),
               "SLURM_JOB_NUM_NODES": str(len(spec["nodes"])), "SLURM_NNODES": str(len(spec["nodes"])),
               "SLURM_JOB_NAME": spec["name"], "SLURM_SUBMIT_DIR": spec["chdir"],
               "SLURMD_NODENAME": spec["nodes"][0], "SLURM_RESTART_COUNT": str(run)}
        if run == 0:
            env.pop("SLURM_RESTART_COUNT")
        out = Path(spec["output"].replace("%j", job).replace("%x", spec["name"]))
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "ab") as log:
            proc = subprocess.Popen(["bash", spec["script"], *spec["args"]], cwd=spec["chdir"], env=env,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            (jd / "batch.pid").write_text(str(proc.pid))
            rc = proc.wait()
        (jd / f"run{run}.rc").write_text(str(rc))
        _sweep(job, jd, run)
        if not (jd / "requeue").exists():
            break
        (jd / "requeue").unlink()
    (jd / "done").write_text(str(rc))
    return rc


# ----------------------------------------------------------------------------- scontrol

def scontrol_main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv[:2] == ["show", "hostnames"]:
        text = argv[2] if len(argv) > 2 else os.environ.get("SLURM_JOB_NODELIST", "")
        print("\n".join(expand_hostlist(text)))
        return 0
    if argv[:1] == ["requeue"] and len(argv) == 2:
        jd = job_dir(_state(), argv[1])
        if not (jd / "spec.json").is_file():
            raise StandinError(f"scontrol: error: Invalid job id specified: {argv[1]}")
        (jd / "requeue").touch()
        return 0
    raise StandinError(f"scontrol: the stand-in knows `show hostnames` and `requeue`, not {' '.join(argv)!r}")


# ----------------------------------------------------------------------------- for tests

def install(bin_dir: str | Path, state_dir: str | Path, nodes: Sequence[str]) -> dict[str, str]:
    """Write `srun`, `sbatch`, `scontrol` into `bin_dir`; returns the environment that uses them."""
    bin_dir, state_dir = Path(bin_dir), Path(state_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    for name in ("srun", "sbatch", "scontrol"):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m moe_rl.launch.standin {name} \"$@\"\n")
        path.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", STATE_ENV: str(state_dir),
            NODES_ENV: ",".join(nodes), KILL_WAIT_ENV: os.environ.get(KILL_WAIT_ENV, "10")}


def wait_job(state_dir: str | Path, job: str | int, timeout: float) -> int:
    """Block until the job (with its requeues) is over; returns the last run's exit code."""
    done = job_dir(Path(state_dir), job) / "done"
    deadline = time.monotonic() + timeout
    while not done.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"stand-in job {job} still runs after {timeout:g} s")
        time.sleep(0.2)
    return int(done.read_text())


def kill_node(state_dir: str | Path, node: str, sig: int = signal.SIGKILL) -> int:
    """Send `sig` to every process group that runs on `node` (a node failure); returns how many."""
    hit = 0
    for f in (Path(state_dir) / "nodes" / node).glob("*.pgid"):
        for pgid in f.read_text().split():
            try:
                os.killpg(int(pgid), sig)
                hit += 1
            except ProcessLookupError:
                pass
    return hit


def signal_batch(state_dir: str | Path, job: str | int, sig: int) -> None:
    """Signal the job's batch shell, as `--signal=B:SIG@N` does before the time limit."""
    os.kill(int((job_dir(Path(state_dir), job) / "batch.pid").read_text()), sig)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"srun": srun_main, "sbatch": sbatch_main, "scontrol": scontrol_main}
    try:
        if argv[:1] == ["_job"]:
            return job_main(argv[1], argv[2])
        if not argv or argv[0] not in commands:
            raise StandinError(f"usage: python -m moe_rl.launch.standin {{{','.join(commands)}}} ARGS...")
        return commands[argv[0]](argv[1:])
    except StandinError as e:
        print(str(e), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
