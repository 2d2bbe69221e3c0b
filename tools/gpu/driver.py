"""The driver of the prepared GPU check (tools/gpu_check.sh): runs the stages of `plan.py` one after
another, each under its own timeout, and keeps one record per stage in OUT/results.json.

    python tools/gpu/driver.py --out OUT --work WORK [--dry-run] [--only a,b] [--skip c]

A record is {"stage", "status": "pass" | "fail" | "skip" | "dry", "reason", "seconds", ...the stage's
figures}. results.json is written before the first stage (every stage "fail", "not run: the check
stopped before this stage") and again after each one, so a check killed from outside still leaves
an honest file. A stage killed by its timeout is "fail", "timeout after N s", with its log's last
lines. Every stage's output goes to OUT/gpu_check.log, and the metrics of its `moe-rl train` runs
to OUT/train_metrics.json: with results.json and the benchmark's report that is everything the
machine returns (it returns at most 8 files from OUT's top level).

Dry run (`--dry-run`, no GPU): every stage prints the exact commands it would run and gets a "dry"
record; the overrides of each `moe-rl train` command are checked by the project's config loader
and preflight, and its server placement against a machine with one GPU, without running anything
(a refused command makes its stage "fail").

Environment: GPU_CHECK_BUDGET_S (default plan.BUDGET_S) less SETUP_S (the seconds the wheel
install took) is the whole check's time; GPU_CHECK_TIMEOUT_<STAGE> (e.g. GPU_CHECK_TIMEOUT_ASYNC=90)
changes one stage's timeout; GPU_CHECK_ALLOW_CPU=1 runs the stages without CUDA (tests only: on
CPU the stages would run and could pass without answering any GPU question).

Stdlib only (and this directory's stdlib-only modules), so that it runs whatever is broken in the
GPU environment; the environment stage reports that.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import checks  # noqa: E402 - this directory's modules
import plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KILL_GRACE_S = 5.0  # after SIGTERM at a timeout, before SIGKILL
MIN_STAGE_S = 10    # a stage is not started with less time than this left of the budget


# ----------------------------------------------------------------------------- records

class Results:
    """OUT/results.json: one record per selected stage, rewritten (atomically) after each change."""

    def __init__(self, out: Path, stages: list[plan.Stage], budget_s: float, dry: bool):
        self.path = out / "results.json"
        self.budget_s, self.dry, self.start = budget_s, dry, time.monotonic()
        # the selected stages' own timeouts and expected times, SGLang's apart (they skip without sglang)
        kinds = (("gpu", False), ("sglang", True))
        self.timeouts_s = {k: sum(s.timeout_s for s in stages if s.sglang == g) for k, g in kinds}
        self.expected_s = {k: sum(s.expected_s for s in stages if s.sglang == g) for k, g in kinds}
        self.records: dict[str, dict[str, Any]] = {
            s.name: {"stage": s.name, "status": "fail", "reason": "not run: the check stopped before this stage",
                     "seconds": 0.0, "timeout_s": s.timeout_s, "question": s.question} for s in stages}
        self.write()

    def set(self, name: str, record: dict[str, Any]) -> None:
        self.records[name] = {**self.records[name], **record}
        self.write()

    def summary(self) -> dict[str, Any]:
        counts = {k: sum(r["status"] == k for r in self.records.values()) for k in ("pass", "fail", "skip", "dry")}
        return {**counts, "ok": counts["fail"] == 0, "dry_run": self.dry, "budget_s": self.budget_s,
                "timeouts_s": self.timeouts_s, "expected_s": self.expected_s,
                "seconds": round(time.monotonic() - self.start, 1)}

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"summary": self.summary(), "stages": list(self.records.values())}, indent=1,
                                  default=str) + "\n")
        os.replace(tmp, self.path)

    def table(self, stages: list[plan.Stage]) -> str:
        rows = [("stage", "status", "seconds", "figures / reason")]
        for s in stages:
            r = self.records[s.name]
            figs = ", ".join(f"{k}={_short(r[k])}" for k in s.headline if r.get(k) is not None)
            rows.append((s.name, r["status"], f"{r['seconds']:.1f}", figs if r["status"] == "pass" and figs
                         else str(r["reason"])[:160]))
        width = [max(len(row[i]) for row in rows) for i in range(3)]
        return "\n".join(f"{a:<{width[0]}}  {b:<{width[1]}}  {c:>{width[2]}}  {d}" for a, b, c, d in rows)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return "[" + ",".join(_short(x) for x in v) + "]"
    return str(v)


# ----------------------------------------------------------------------------- one stage

class Stopped(Exception):
    """SIGTERM reached the driver (the lease ends): the running stage is stopped and recorded."""


def _stopped(signum: int, _frame: Any) -> None:
    raise Stopped(f"signal {signum}")


def run_command(argv: list[str], log_path: Path, timeout_s: float, env: dict[str, str]) -> int | None:
    """Run `argv` in its own session with stdout + stderr appended to `log_path`; its exit status,
    or None when it ran past `timeout_s` (then its whole process group got SIGTERM, and SIGKILL
    KILL_GRACE_S later: servers it started in sessions of their own die with it, as they are
    started with a parent-death signal)."""
    with open(log_path, "ab") as log:
        log.write(f"$ {shlex.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            return proc.wait(timeout=max(timeout_s, 0.1))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None
        except BaseException:  # stopped from outside: the stage's processes go too
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def run_stage(stage: plan.Stage, *, py: str, work: Path, out: Path, timeout_s: float,
              env: dict[str, str]) -> dict[str, Any]:
    """Run the stage's commands under one timeout, then read its figures (its figures file, or its
    check on the runs' metrics). The record, without "seconds"."""
    stage_dir = work / stage.name
    shutil.rmtree(stage_dir, ignore_errors=True)  # no figures or metrics of an earlier check
    stage_dir.mkdir(parents=True)
    log = stage_dir / "stage.log"
    deadline = time.monotonic() + timeout_s
    failed = None
    for cmd in stage.commands:
        rc = run_command(cmd.render(py, str(work), str(out)), log, deadline - time.monotonic(), env)
        if rc is None:
            return {"status": "fail", "reason": f"timeout after {timeout_s:.0f} s (in {cmd.name})",
                    "log_tail": tail(log)}
        if rc != 0 and failed is None:
            failed = f"{cmd.name} exited with status {rc}"
    figures = _figures(stage, work, log)
    if failed:
        figures = {**figures, "status": "fail", "reason": failed + (f"; {figures['reason']}" if figures.get(
            "status") == "fail" else ""), "log_tail": tail(log)}
    elif figures.get("status") == "fail":
        figures["log_tail"] = tail(log)
    return figures


def _figures(stage: plan.Stage, work: Path, log: Path) -> dict[str, Any]:
    if stage.check is None:
        path = Path(stage.figures_file.format(work=work))
        try:
            figures = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            return {"status": "fail", "reason": f"no figures from the stage ({type(e).__name__}: {e})"}
        return figures
    runs = {c.name: Path(c.run_dir.format(work=work)) for c in stage.commands if c.run_dir}
    try:
        return checks.CHECKS[stage.check](runs, log.read_text(errors="replace"), **stage.check_args)
    except Exception as e:  # noqa: BLE001 - a check that cannot read the runs fails the stage, not the driver
        return {"status": "fail", "reason": f"check {stage.check} failed: {type(e).__name__}: {e}"}


# ----------------------------------------------------------------------------- probes

def probe(py: str, code: str, env: dict[str, str], timeout: float = 60.0) -> tuple[bool, str]:
    """(it ran, the last line it printed) of `py -c code`."""
    try:
        res = subprocess.run([py, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"no answer in {timeout:g} s"
    lines = (res.stdout + res.stderr).strip().splitlines()
    return res.returncode == 0, (lines[-1] if lines else f"exit status {res.returncode}")


def sglang_problem(py: str, env: dict[str, str]) -> str | None:
    """Why the SGLang stages cannot run here (None when `import sglang` works)."""
    ok, last = probe(py, "import sglang", env)
    return None if ok else f"sglang does not import ({last[:200]}): its CUDA wheels are not on this machine"


def cuda_problem(py: str, env: dict[str, str]) -> str | None:
    ok, last = probe(py, "import torch; print(torch.cuda.is_available())", env)
    if ok and last == "True":
        return None
    return f"no CUDA device (torch.cuda.is_available(): {last[:200]}); see the environment stage"


# ----------------------------------------------------------------------------- dry run

def validate_train(argv: list[str], gpus: int = 1) -> str | None:
    """The problem the project's config loader or `moe-rl train`'s preflight finds in a `moe-rl train
    --config C overrides...` command, as on a machine with `gpus` GPUs, without running it (None: accepted)."""
    from unittest import mock

    from moe_rl.config import ConfigError, load_config
    from moe_rl.reward.registry import get_reward
    from moe_rl.train.preflight import preflight

    i = argv.index("--config")
    config, overrides = argv[i + 1], argv[i + 2:]
    try:
        cfg = load_config(str(ROOT / config), overrides)
    except (ConfigError, FileNotFoundError) as e:
        return str(e)
    # the preflight's server placement counts this machine's GPUs (moe_rl.dist.devices.gpu_count)
    with mock.patch("moe_rl.dist.devices.gpu_count", return_value=gpus):
        problem = preflight(cfg, cfg.train.world_size)
    if problem:
        return problem
    try:  # a `module:function` reward is only imported when the run builds
        get_reward(cfg.reward.name, data=cfg.data.train)
    except Exception as e:  # noqa: BLE001 - whatever the import raises is the answer
        return f"reward.name={cfg.reward.name}: {type(e).__name__}: {e}"
    return None


def validate_python(argv: list[str]) -> str | None:
    """A `tools/gpu/stages.py` command's arguments parsed by its own parser (nothing runs)."""
    import stages  # noqa: PLC0415 - torch only on first use of a stage body, not at import

    try:
        stages.build_parser().parse_args(argv[2:])
    except SystemExit as e:
        return f"stages.py refused its arguments (exit {e.code})"
    return None


def dry_record(stage: plan.Stage, py: str, work: Path, out: Path, sglang: str | None) -> dict[str, Any]:
    commands, problems = [], []
    for cmd in stage.commands:
        argv = cmd.render(py, str(work), str(out))
        commands.append(shlex.join(argv))
        problem = validate_train(argv) if cmd.is_train else (
            validate_python(argv) if argv[1:2] == ["tools/gpu/stages.py"] else None)
        if problem:
            problems.append(f"{cmd.name}: {problem}")
    reason = "dry run: commands printed" + (", configs accepted" if any(c.is_train for c in stage.commands) else "")
    if stage.sglang and sglang:
        reason += f"; would skip: {sglang}"
    return {"status": "fail" if problems else "dry", "reason": "; ".join(problems) or reason, "commands": commands}


# ----------------------------------------------------------------------------- the check

def train_metrics(stages: list[plan.Stage], work: Path) -> dict[str, Any]:
    """Every train run's metric rows, by stage/run (a few steps of tiny runs: small)."""
    out = {}
    for s in stages:
        for c in s.commands:
            if c.run_dir:
                rows = checks.read_metrics(c.run_dir.format(work=work))
                if rows:
                    out[f"{s.name}/{c.name}"] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results.json, gpu_check.log, ... (returned from the machine)")
    p.add_argument("--work", required=True, help="scratch: run directories, models, logs of each stage")
    p.add_argument("--dry-run", action="store_true", help="print each stage's commands, check configs, run nothing")
    p.add_argument("--only", default="", help="comma-separated stages to run (default: all)")
    p.add_argument("--skip", default="", help="comma-separated stages to leave out")
    p.add_argument("--python", default=sys.executable, help="interpreter of the stages")
    a = p.parse_args(argv)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    try:
        stages = plan.select(split(a.only), split(a.skip))
    except ValueError as e:
        p.error(str(e))
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    budget = float(os.environ.get("GPU_CHECK_BUDGET_S", plan.BUDGET_S)) - float(os.environ.get("SETUP_S", 0) or 0)
    results = Results(out, stages, budget, a.dry_run)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x),
           "PYTHONUNBUFFERED": "1"}
    sglang = sglang_problem(a.python, env) if any(s.sglang for s in stages) else None
    cuda = None if a.dry_run or os.environ.get("GPU_CHECK_ALLOW_CPU") == "1" else cuda_problem(a.python, env)
    log_all = out / "gpu_check.log"
    log_all.write_text("")

    def say(text: str) -> None:  # the console and gpu_check.log
        print(text, flush=True)
        with open(log_all, "a") as f:
            f.write(text + "\n")

    deadline = results.start + budget
    signal.signal(signal.SIGTERM, _stopped)
    stage, t0 = None, time.monotonic()
    try:
        for stage in stages:
            say(f"=== {stage.name}: {stage.question}")
            timeout = min(float(os.environ.get(f"GPU_CHECK_TIMEOUT_{stage.name.upper()}", stage.timeout_s)),
                          deadline - time.monotonic())
            t0 = time.monotonic()
            if a.dry_run:
                record, timeout = dry_record(stage, a.python, work, out, sglang), stage.timeout_s
                for c in record["commands"]:
                    say(f"  $ {c}")
            elif stage.sglang and sglang:
                record = {"status": "skip", "reason": sglang}
            elif cuda and stage.name != "environment":
                record = {"status": "fail", "reason": cuda}
            elif timeout < MIN_STAGE_S:
                record = {"status": "fail",
                          "reason": f"not run: {max(timeout, 0):.0f} s left of the {budget:.0f} s budget"}
            else:
                results.set(stage.name, {"reason": f"running when the check stopped (its timeout: {timeout:.0f} s)"})
                record = run_stage(stage, py=a.python, work=work, out=out, timeout_s=timeout, env=env)
                stage_log = work / stage.name / "stage.log"
                with open(log_all, "ab") as f:
                    f.write(stage_log.read_bytes() if stage_log.is_file() else b"(no output)\n")
            results.set(stage.name, {**record, "seconds": round(time.monotonic() - t0, 1),
                                     "timeout_s": round(timeout, 1)})
            r = results.records[stage.name]
            say(f"--- {stage.name}: {r['status']} ({r['seconds']:.1f} s): {str(r['reason'])[:300]}")
    except (Stopped, KeyboardInterrupt) as e:  # the lease ends: the stage's processes are gone, say so
        if stage is None:
            raise
        results.set(stage.name, {"status": "fail", "reason": f"stopped from outside ({e or 'interrupt'}) after "
                                 f"{time.monotonic() - t0:.0f} s", "seconds": round(time.monotonic() - t0, 1)})
        say(f"--- {stage.name}: stopped from outside")
    if not a.dry_run:
        (out / "train_metrics.json").write_text(json.dumps(train_metrics(stages, work), default=str) + "\n")
    s = results.summary()
    say("\n" + results.table(stages) + f"\n\n{s['pass']} passed, {s['fail']} failed, {s['skip']} skipped, "
        f"{s['dry']} dry; {s['seconds']:.0f} s of the {budget:.0f} s budget; records in {results.path}")
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
