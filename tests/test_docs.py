"""Every command README.md, CONTRIBUTING.md and docs/ show in a fenced block runs as written, at a small size.

A block is a command block unless it is marked with a language other than a shell's (```python is a
snippet). Its lines are commands (a trailing backslash continues one, `#` starts a comment, `&&` chains
several); each command is either run, with SMALLER's options appended so that it finishes in seconds to a
minute (argparse takes the last value of an option given twice, so a documented value is overridden,
while a documented option the program no longer has still fails it), or listed in NOT_RUN with the reason,
or in RUN_ELSEWHERE with the test that runs it.
A command that is neither fails the test, naming itself. Commands run in a temporary directory, with
`benchmarks/` and `configs/` reachable as in the repository, so what they write stays out of the tree.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "examples" / "README.md",
]
SHELLS = ("", "bash", "sh", "shell", "console")

# A command's start -> why it is not run here.
NOT_RUN = {
    "pip install": "installs into the environment the tests run in; CI's first step runs exactly this",
    "python3 -m venv": "makes the virtual environment the commands after it run in; .ci/run runs the tests in one",
    ". .venv/bin/activate": "enters that virtual environment (a shell's own command)",
    "odc-check": "needs GPUs; benchmarks/gpu_check.py runs it, and tests/check runs its parts on CPU",
    "python -m pytest": "the test suite itself, of which this test is part",
    "python -m verl.trainer.main_ppo": "a user's own config on GPUs with vLLM; on CPU the same trainer runs "
    "through odc-grpo-cpu, below and in tests/verl",
    "torchrun --nproc-per-node 8 -m verl.trainer.sft_trainer": "a user's own SFT config on GPUs; on CPU the same "
    "trainer runs through odc-sft-cpu, below and in tests/verl/test_sft.py",
    "python -m verl.trainer.sft_trainer_ray": "a user's own SFT config on GPUs; on CPU the same trainer runs "
    "through odc-sft-cpu --ray, in tests/verl/test_sft.py",
    "PYTHONPATH=. python": "beside the GPU check (docs/gpu.md): needs a GPU",
    "for n in": "beside the GPU check: real compute at 4-16 ranks, minutes of a 16-core machine",
    "python3 benchmarks/gpu_check.py": "needs a GPU; tests/benchmarks/test_gpu_check.py runs its dry run and "
    "its runner",
    "python examples/preprocess_data.py": "downloads GSM8K and MATH from the Hugging Face Hub",
    "python examples/ab_report.py": "two GPU runs' metrics; tests/verl/test_ab_report.py reports on real ones",
}
# A whole command (a regular expression) -> the test that runs it as written, or with more (both strategies,
# more steps), so that it is not run again here.
RUN_ELSEWHERE = {
    r"odc-grpo-cpu( --steps 3)?": "tests/verl/test_main_ppo.py: odc-grpo-cpu --steps 3 with the KL loss (grpo_cli)",
    r"odc-grpo-cpu --emulate \S+ --compare fsdp2,lockstep,odc --ranks \d+ --steps \d+( --slow-ranks \d+:\S+)?": "tests/"
    "verl/test_trainer_emulated.py: the same runs at 4 ranks, 2 steps, the last rank 1.5x slow",
    r"odc-grpo-cpu --steps 2 trainer\.v1\.trainer_mode=separate_async .*": "tests/verl/test_trainer_modes.py: "
    "separate_async with these settings (and the KL loss) under fsdp2 and odc",
    r"odc-sft-cpu --ranks 2 --steps 4": "tests/verl/test_sft.py: these runs, through odc-sft-cpu's own functions; "
    "the emulated command below runs odc-sft-cpu itself",
}
# A command's start -> options that shrink it to a small size.
SMALLER = {
    "odc-grpo-cpu": ["--steps", "1", "--compare", "odc", "--ranks", "2"],
    "odc-sft-cpu": ["--ranks", "2", "--steps", "3"],
    "odc-demo": ["--steps", "1", "--mini-batch-size", "2"],
    "odc-plan": ["--draws", "2"],
    "odc-spes": ["--nodes", "2", "--steps", "10"],
    "python benchmarks/bench_odc_core.py": ["--steps", "1", "--model-size", "tiny"],
    "python benchmarks/bench_split.py": ["--steps", "1", "--ranks", "4", "--time-scale", "0.02"],
    "python benchmarks/bench_balance.py": ["--draws", "2", "--timing-runs", "1", "--plan-draws", "1"],
    "ruff": [],
}
# further options for some forms of a command
EMULATED = ["--time-scale", "0.02"]
SWEEP = ["--sweep-ranks", "2", "--workload", "rl"]
TIMEOUT_S = 600


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) of every command in a command block of README.md and docs/, in order."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in re.finditer(r"^```([^\n`]*)\n(.*?)^```", text, re.S | re.M):
            if match.group(1).strip() not in SHELLS:
                continue
            line_no = text[: match.start()].count("\n") + 2
            joined = re.sub(r"\\\n\s*", " ", match.group(2))
            for line in joined.splitlines():
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                for command in line.split("&&"):
                    found.append((f"{doc.relative_to(ROOT)}:{line_no}", " ".join(command.split())))
    return found


def _start(command: str, table: dict) -> str | None:
    return next((start for start in table if command == start or command.startswith(start + " ")), None)


def to_run(command: str) -> list[str] | None:
    """The argv the test runs for a documented command, None if it is not run (NOT_RUN)."""
    if _start(command, NOT_RUN) or any(re.fullmatch(pattern, command) for pattern in RUN_ELSEWHERE):
        return None
    words = shlex.split(command, comments=True)
    variables = []
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        variables.append(words.pop(0))
    if words[:1] == ["bash"] and words[1].startswith("examples/"):
        # an example runs an A/B on GPUs (vLLM rollout, 8 GPUs a node); its dry run prints the commands and
        # odc-plan's prediction, run here with this interpreter (and every script's: test_example_dry_run_*)
        return ["env", f"PYTHON={sys.executable}", *variables, *words] if "DRY_RUN=1" in variables else None
    start = _start(command, SMALLER)
    if start is None:
        raise AssertionError(
            f"{command!r} is shown in the docs but neither run by tests/test_docs.py (SMALLER) nor listed in its "
            f"NOT_RUN with a reason"
        )
    argv = shlex.split(command) + SMALLER[start]
    if "--emulate" in argv:
        argv += EMULATED
    if "--sweep-ranks" in argv:
        argv += SWEEP
    if argv[0] == "python":
        argv[0] = sys.executable
    return argv


COMMANDS = documented_commands()


def test_the_docs_show_commands_and_every_one_is_run_or_said_why_not():
    assert len(COMMANDS) >= 10
    for _, command in COMMANDS:
        to_run(command)  # raises for a command nobody decided about
    assert not [c for _, c in COMMANDS if "<" in c and to_run(c) is not None], "placeholders must not be run"


def test_every_file_of_the_repository_a_command_names_exists():
    """Also in the commands not run here (the GPU checklist): a renamed test or benchmark fails this."""
    named = {
        (where, word.split("::")[0])
        for where, command in COMMANDS
        for word in shlex.split(command)
        if re.match(r"(tests|benchmarks|configs|examples)/", word)
    }
    assert named and not [(w, p) for w, p in named if not (ROOT / p).exists()]


def test_ci_runs_the_readmes_test_command_in_a_virtual_environment_made_from_nothing():
    """`.ci/run` makes a virtual environment as the README says, `.venv` being a temporary folder it removes
    at exit, and runs the README's test command in it as written."""
    readme = (ROOT / "README.md").read_text()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    [test_command] = [line for line in readme.splitlines() if line.startswith("pip install") and "pytest" in line]
    make_venv = "python3 -m venv .venv && . .venv/bin/activate"
    assert readme.find(make_venv) in range(readme.index(test_command))
    assert 'venv="$(mktemp -d)"' in ci and "trap 'rm -rf \"$venv\"' EXIT" in ci
    assert ci.index(make_venv.replace(".venv", '"$venv"')) < ci.index(test_command)
    assert "--system-site-packages" not in "\n".join(ci)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs_commands")
    for name in ("benchmarks", "configs", "examples"):
        (path / name).symlink_to(ROOT / name)
    return path


def _effective(argv: list[str]) -> tuple:
    """What a command line does: its options with the last value given (as argparse takes them)."""
    options: dict[str, tuple] = {}
    positional, name = [], None
    for arg in argv:
        if arg.startswith("--"):
            name = arg
            options[name] = ()
        elif name is None:
            positional.append(arg)
        else:
            options[name] += (arg,)
    return (*positional, *sorted(options.items()))


def _runnable() -> list:
    """Each documented command once per distinct effect (the four scales of a table shrink to one run)."""
    seen, params = set(), []
    for where, command in COMMANDS:
        argv = to_run(command)
        if argv is None or _effective(argv) in seen:
            continue
        seen.add(_effective(argv))
        params.append(pytest.param(argv, id=f"{where} {command}"[:120]))
    return params


@pytest.mark.parametrize("argv", _runnable())
def test_documented_command_runs(argv, workdir):
    cwd = ROOT if argv[0] == "ruff" else workdir  # ruff checks the tree it is run in
    proc = subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.returncode == 0, f"{shlex.join(argv)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


# --- the examples: every script's dry run ---------------------------------------------------------------------

EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("grpo_*.sh"))


def _dry_run(script: str, *args: str, cwd: Path, **env: str) -> tuple[list[list[str]], str]:
    """(the two runs' argument lists, odc-plan's printed prediction) of `DRY_RUN=1 bash examples/SCRIPT ARGS`."""
    proc = subprocess.run(
        ["bash", str(ROOT / "examples" / script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, "DRY_RUN": "1", **env},
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    commands, plan = proc.stdout.split("# odc-plan ", 1)
    lines = commands.splitlines()
    starts = [i for i, line in enumerate(lines) if lines[i : i + 3] == [sys.executable, "-m", "verl.trainer.main_ppo"]]
    return [lines[a + 3 : b] for a, b in zip(starts, [*starts[1:], len(lines)])], plan


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_dry_run_forwards_arguments_and_prints_its_plan(script, tmp_path):
    """Both runs get the arguments after the script's name (last, after everything the script sets) and
    EXTRA_ARGS as one argument, on two nodes each shards inside a node (fsdp_size = GPUs per node), the cost
    model is left at the plugin's default, and odc-plan's prediction for the script's own settings follows."""
    user = ["trainer.total_training_steps=3", "trainer.experiment_name=mine x"]
    runs, plan = _dry_run(script, *user, cwd=tmp_path, NNODES="2", NGPUS="4", EXTRA_ARGS="data.seed=1 2")
    assert len(runs) == 2  # fsdp2, then odc
    for run in runs:
        assert run[-3:] == ["data.seed=1 2", *user]
        assert "actor_rollout_ref.actor.fsdp_config.fsdp_size=4" in run
        assert "actor_rollout_ref.ref.fsdp_config.fsdp_size=4" in run
        assert "trainer.nnodes=2" in run and "trainer.logger=[console,file]" in run
        assert not [arg for arg in run if "odc_cost_model" in arg]
    assert "actor_rollout_ref.actor.strategy=fsdp2" in runs[0] and "model_engine=odc" in runs[1]
    assert "--nodes 2 --gpus-per-node 4" in plan and "pick: " in plan, plan


def test_example_dry_run_plans_with_a_local_model_and_data(tmp_path):
    """One node, wandb on, EXTRA_ARGS an array of a script that sources the example, and MODEL a local
    directory with preprocessed data: the prediction uses the model's config.json and its tokenizer's counts
    of the data set's prompts."""
    from odc_plugin.verl.cpu.text_assets import build_model, build_tokenizer, make_problems, write_parquet

    problems = make_problems(32, seed=0)
    tokenizer = build_tokenizer(problems)
    tokenizer.save_pretrained(tmp_path / "model")
    build_model(tokenizer, seed=0).config.save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    write_parquet(problems, str(tmp_path / "data" / "train.parquet"), "train")
    wrapper = tmp_path / "mine.sh"
    wrapper.write_text(
        "EXTRA_ARGS=(data.seed=1 'trainer.experiment_name=a b')\n"
        f"source {ROOT / 'examples' / 'grpo_gsm8k_qwen2.5_0.5b.sh'} trainer.total_training_steps=3\n"
    )
    env = {"MODEL": str(tmp_path / "model"), "DATA_DIR": str(tmp_path / "data"), "WANDB": "1", "STRATEGY": "odc"}
    (run,), plan = _dry_run(str(wrapper), cwd=tmp_path, **env)
    assert run[-3:] == ["data.seed=1", "trainer.experiment_name=a b", "trainer.total_training_steps=3"]
    assert "trainer.logger=[console,file,wandb]" in run and not [a for a in run if "fsdp_size" in a]
    assert f"--model {tmp_path / 'model'}" in plan and "--ranks 8" in plan
    assert f"32 prompts of {tmp_path / 'data' / 'train.parquet'}:prompt (chat template of" in plan
    assert "model_type qwen2" in plan and "ODC+LB-Mini" in plan
