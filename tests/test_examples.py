"""Every command the README and its linked docs give, and the README's code blocks, run as written on a
fresh checkout.

The pages are read here, not copied: a command they give that this file does not
know fails the first test, so an edit to them comes with a way to run it.
Each command runs in a scratch directory that sees this checkout's examples/,
tests/, benchmarks/, scripts/ and README.md (what it writes, like plan.json, stays there),
with small sizes appended where the README's own would take minutes; the
checks after it are what the README says it shows.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

import autopar

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the pages whose commands a user copies: the README and the reference and guides it links to
DOCS = [README, ROOT / "docs" / "api.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
COMMAND_WORDS = ("python", "torchrun", "autopar", "bash", "pip")


def readme_commands() -> list[str]:
    """The shell commands of the README and the docs it links (DOCS), in order: each line of their bash
    blocks (a chain `a && b` as its commands) and each inline code span that starts with a command word."""
    text = "\n".join(page.read_text() for page in DOCS)
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            out += [c.strip() for c in line.split("&&") if c.strip()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    out += [c for c in re.findall(r"`([^`\n]+)`", prose) if c.split()[0] in COMMAND_WORDS and " " in c]
    return list(dict.fromkeys(out))


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@dataclass
class Run:
    extra: list = field(default_factory=list)          # small sizes appended to the README's command
    check: Callable | None = None                      # check(stdout, workdir, stderr) after a zero exit status
    gloo: bool = False                                  # starts gloo processes
    in_process: bool = False   # a `python SCRIPT` run here (runpy) rather than in a new interpreter's seconds of imports


def _train_gpt(out, _, err):
    assert "autopar plan" in out and "each rank reads" in out
    diff = float(re.search(r"max abs loss difference over 3 steps: ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-5


def _bounded(out, _, err):
    assert "every phase autopar bounds is within its bound" in out   # the exit status says so too
    assert re.search(r"train step 1 .* yes$", out, re.M)


def _finetune(out, _, err):
    assert re.search(r"reads share 0 of \d", out)
    losses = [float(x) for x in re.findall(r"step \d: loss ([0-9.]+)", out)]
    assert len(losses) == 2 and all(5.0 < x < 6.0 for x in losses)   # a random model over 256 tokens: ~ln 256


def _planned(out, workdir, err):
    plan = autopar.Plan.from_json((workdir / "plan.json").read_text())
    assert str(plan) in out and plan.predicted.memory.total <= 80e9
    assert "tokens/s" in out and "largest batch that fits 80GB per device: " in out
    assert "LlamaForCausalLM (llama, 8.03B parameters, on meta)" in err
    # progress while it works: the capture, the search, the prediction, each on a timed line
    for step in ("capturing", "captured", "searching (ILP", "searched in", "planned"):
        assert any(line.startswith("[") and step in line for line in err.splitlines()), step


def _compared(out, _, err):
    assert all(re.search(rf"^{re.escape(s)}\s", out, flags=re.M) for s in autopar.STRATEGIES)


def _shown(out, workdir, err):
    assert out.strip() == str(autopar.Plan.from_json((workdir / "plan.json").read_text())).strip()


NOT_RUN_HERE = "installs: scripts/test.sh, which CI runs, installs exactly this"
# README command -> how this file runs it, or why it does not
COMMANDS: dict = {
    "python -m venv .venv": NOT_RUN_HERE,
    ". .venv/bin/activate": NOT_RUN_HERE,
    "python -m pip install torch==2.13.0": NOT_RUN_HERE,
    'python -m pip install -e ".[test]"': NOT_RUN_HERE,
    'pip install -e ".[plot]"': "installs matplotlib, which the test extra has too",
    "torchrun --nproc-per-node 4 examples/train_gpt.py": Run(["--steps", "3"], _train_gpt, gloo=True),
    "bash scripts/test.sh": "it is this test suite (CI's .ci/run runs it)",
    "bash scripts/test.sh -x -q tests/test_plan.py": "it is part of this test suite",
    "bash scripts/gpu_check.sh": "needs a GPU, which CI lacks; it runs tests/test_cuda.py (in this suite, skipped "
                                 "without CUDA) and benchmarks/runtime_overhead.py on the GPUs",
    "python benchmarks/search_time.py": Run(["--layers", "1", "--batch", "1", "--seq", "256"]),
    # one row planned (the 8B on FSDP 8, ~15 s), one that autopar cannot say yet
    "python benchmarks/published.py": Run(["--rows", "t1-8b-fsdp8,perf-a100-8b-fsdp64-layer", "--no-auto"],
                                          lambda out, _, err: re.search(r"^t1-8b-fsdp8 +\d+ +5762 +\d\.\d\d", out, re.M)
                                          and re.search(r"^perf-a100-8b-fsdp64-layer +\d+ +2904 +\d\.\d\d", out, re.M)
                                          and "float8 rows" in out),
    "python examples/plan_offline.py": Run(check=lambda out, _, err: "autopar plan" in out and "batch" in out,
                                           in_process=True),
    "python examples/plan_llama3_8b.py": Run(["--layers", "1", "--batch", "8", "--seq", "512"],
                                             lambda out, _, err: "per GPU:" in out, in_process=True),
    "python examples/finetune_hf.py --make-tiny /tmp/tiny-llama": Run(in_process=True),
    "torchrun --nproc-per-node 4 examples/finetune_hf.py --model /tmp/tiny-llama": Run(["--steps", "2"], _finetune,
                                                                                        gloo=True),
    "python -m autopar": Run(["--help"], lambda out, _, err: "plan" in out and "compare" in out),
    "autopar plan tests/data/llama3_8b_config.json --mesh dp=8,tp=8 --memory 80GB --json plan.json": Run(
        check=_planned),
    "autopar compare tests/data/llama3_8b_config.json --mesh dp=8,tp=8 --memory 80GB": Run(check=_compared),
    "autopar show plan.json": Run(check=_shown),
    # 8 layers: enough that every layer's whole gradients held through backward exceed the predicted
    # total (the exit status fails), as they did before runtime/reduction/layer_groups.InFlight
    "python benchmarks/peak_memory.py": Run(["--world", "2", "--n-layer", "8", "--n-embd", "64", "--n-head", "4",
                                             "--vocab-size", "64", "--block-size", "16", "--batch", "4",
                                             "--steps", "1"], _bounded, gloo=True),
}


def test_every_readme_command_is_known_here():
    commands = readme_commands()
    assert len(commands) > 10   # the parsing found the README's commands
    unknown = [c for c in commands if c not in COMMANDS]
    assert not unknown, f"README commands no test runs (add them to COMMANDS): {unknown}"
    stale = [c for c in COMMANDS if c not in commands]
    assert not stale, f"COMMANDS the README no longer gives: {stale}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A scratch directory seeing the checkout's folders: commands run as a user runs them from the root."""
    d = tmp_path_factory.mktemp("readme")
    for name in ("examples", "tests", "benchmarks", "scripts", "README.md"):   # finetune_hf reads README.md
        (d / name).symlink_to(ROOT / name)
    return d


def _argv(command: str, workdir: Path) -> list:
    argv = shlex.split(command.replace("/tmp/tiny-llama", str(workdir / "tiny-llama")))
    if argv[0] == "python":
        return [sys.executable] + argv[1:]
    if argv[0] == "torchrun":   # the same launcher; --standalone picks a free port for each run
        return [sys.executable, "-m", "torch.distributed.run", "--standalone"] + argv[1:]
    if argv[0] == "autopar":    # the console script, or the same entry point where it is not installed
        return ([shutil.which("autopar")] if shutil.which("autopar") else [sys.executable, "-m", "autopar"]) + argv[1:]
    return argv


def _run(argv, cwd, timeout=600):
    # this checkout's autopar, whatever the environment has installed
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _in_process(argv: list, run, cwd) -> subprocess.CompletedProcess:
    """run() in this process, from `cwd`, with sys.argv = argv: its exit status and what it printed, as a
    subprocess's. Warnings filters it sets stay inside."""
    out, err = io.StringIO(), io.StringIO()
    here, argv_before = os.getcwd(), sys.argv
    os.chdir(cwd)
    sys.argv = list(argv)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            try:
                code = run()
            except SystemExit as e:   # argparse's --help and usage errors, sys.exit(message)
                code = e.code
    finally:
        os.chdir(here)
        sys.argv = argv_before
    return subprocess.CompletedProcess(argv, code or 0, out.getvalue(), err.getvalue())


def _run_cli(args, cwd) -> subprocess.CompletedProcess:
    """`autopar ARGS` in this process: the command's own function (cli.main, which the console script calls),
    without a new interpreter's 3-7 s of imports. `python -m autopar` still starts one."""
    from autopar import cli
    return _in_process(["autopar", *args], lambda: cli.main(args), cwd)


def _run_script(path: str, args: list, cwd) -> subprocess.CompletedProcess:
    """`python PATH ARGS` in this process (runpy, as `__main__`)."""
    return _in_process([path, *args], lambda: runpy.run_path(path, run_name="__main__") and 0, cwd)


RUNNABLE = [c for c, how in COMMANDS.items() if isinstance(how, Run)]


@pytest.mark.parametrize("command", [pytest.param(c, marks=[pytest.mark.gloo] if COMMANDS[c].gloo else [])
                                     for c in RUNNABLE])
def test_readme_command_runs(command, workdir):
    """In README order, in one scratch directory: `autopar show plan.json` reads what `autopar plan` wrote."""
    if command.startswith(("autopar", "python -m autopar")) or "finetune_hf" in command:
        pytest.importorskip("transformers")
    how = COMMANDS[command]
    if command.startswith("autopar "):
        proc = _run_cli(shlex.split(command)[1:] + how.extra, workdir)
    elif how.in_process:
        argv = _argv(command, workdir)
        proc = _run_script(argv[1], argv[2:] + how.extra, workdir)
    else:
        proc = _run(_argv(command, workdir) + how.extra, workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if how.check is not None:
        assert how.check(proc.stdout, workdir, proc.stderr) is not False, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_readme_offline_plan_block_runs_and_its_figure_is_true():
    """The "Plan offline" block, executed as it stands; the symbolic memory it quotes in a comment
    starts as the one it computes."""
    block = next(b for b in _python_blocks() if "autopar.plan(" in b)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    quoted = re.search(r"# the same in sympy: (\S+)", block).group(1)
    assert str(scope["plan"].symbolic.memory.total).startswith(quoted)


@pytest.mark.gloo
def test_readme_training_block_runs_under_torchrun(workdir):
    """The "Train" block, saved as a script and started on 4 gloo ranks as the README says."""
    block = next(b for b in _python_blocks() if "init_process_group" in b)
    script = workdir / "readme_train.py"
    script.write_text(block + "\ndist.barrier()\ndist.destroy_process_group()\n")
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                 str(script)], workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("autopar plan") == 1    # printed on rank 0 only


def test_train_gpt_without_torchrun_says_how_to_run_it():
    proc = _run([sys.executable, "examples/train_gpt.py"], ROOT)
    assert proc.returncode != 0
    assert "torchrun --nproc-per-node 4" in proc.stdout + proc.stderr
