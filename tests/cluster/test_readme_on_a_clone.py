"""The README's one-machine commands and its Python example, run as a new user runs them: in a
copy of this checkout's tracked files with no `../shared` beside it, on a corpus of real prose in
`corpus/`. The commands are this environment's installed `bertforge` (the checkout's code): the
copy is what they read and write, so a path an example names that a clone lacks fails here.
What the code finds beside its own checkout (`finetune`'s default data root) is not hidden by
the copy: that default has its own test (tests/cluster/test_finetune_launch.py).

The commands are read from the README itself ("Running on your own data" and the fine-tuning
lines that name only what the clone has), so an example that stops working fails here. Only
their size changes (steps, workers, epochs; `SMALLER` lists each), so that the chain takes
minutes on 2 cores; the GPU line needs a GPU and is left out. Its `train` runs to its end on
a local Ray: the test of a quiet console for a whole run (tests/cluster/test_train_from_outside.py
stops its runs).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bertforge.cluster.demo.docstring_corpus import write_docstring_corpus
from tests.support.console import foreign_lines, json_lines

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# flag -> (the README's value, the value run here): the same commands, smaller.
SMALLER = {
    "--steps": ("300", "4"),
    "--checkpoint-every": ("100", "2"),
    "--direct_num_workers": ("8", "2"),
    "--num-shards": ("64", "4"),
}
# Appended to the fine-tuning lines: a few steps instead of 3 epochs.
FINETUNE_STEPS = ["--max-steps", "3"]


def _blocks(section: str) -> list[str]:
    """The fenced code blocks of one `## section` of the README."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"^```[^\n]*\n(.*?)^```", text[start:end if end > 0 else None],
                      re.M | re.S)


def _commands(block: str) -> list[list[str]]:
    """Each `bertforge ...` line of a shell block as argv, continuations joined, comments out."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line, comments=True) for line in joined.splitlines()
            if line.strip().startswith("bertforge ")]


def _smaller(argv: list[str]) -> list[str]:
    argv = list(argv)
    for flag, (written, run) in SMALLER.items():
        if flag in argv:
            value = argv.index(flag) + 1
            assert argv[value] == written, f"the README now says {flag} {argv[value]}: {argv}"
            argv[value] = run
    return argv


def _clone(destination: Path) -> None:
    """This checkout's tracked files, as they are now (a clone's content)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no clone to make")
    clone = tmp_path_factory.mktemp("user") / "bertforge"
    _clone(clone)
    assert not (clone.parent / "shared").exists()
    corpus = clone / "corpus"
    corpus.mkdir()
    write_docstring_corpus(str(corpus / "docstrings.jsonl"), target_bytes=400_000)
    return clone


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run([str(BIN / "bertforge"), *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    console = done.stdout + done.stderr
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{console[-4000:]}"
    return done


def test_the_own_data_commands_and_the_shipped_fine_tuning_run_on_a_users_clone(clone):
    [own_data] = _blocks("Running on your own data")
    commands = [argv for argv in _commands(own_data) if "--gpu" not in argv]
    assert [argv[1] for argv in commands] == ["vocab", "prepare", "inspect", "train", "export"]
    # The lines on GLUE, SQuAD or the user's TSVs name data a clone has not got (DATA, my/).
    finetune = [argv for block in _blocks("Fine-tuning") for argv in _commands(block)
                if argv[1] == "finetune" and not any(
                    a == "DATA" or a.startswith(("DATA/", "my/")) for a in argv)]
    assert finetune, "the README has no fine-tuning line on the shipped SST-2 subset"
    done = {}
    for argv in commands:
        done[argv[1]] = _run(_smaller(argv), clone)
    for argv in finetune:
        done[argv[1]] = _run(argv + FINETUNE_STEPS, clone)
    consoles = {command: run.stdout + run.stderr for command, run in done.items()}
    # A run to its end prints the project's lines and its result only: the engines' output
    # (Ray's, DeepSpeed's, the workers') is in the run's logs.
    trained = done["train"]
    assert trained.stderr == "", trained.stderr
    assert foreign_lines(trained.stdout, json_lines(trained.stdout)) == []
    assert "[train] step 4/4 |" in trained.stdout
    work = clone / "work"
    assert (work / "shards" / "manifest.json").is_file()
    assert "instances" in consoles["inspect"]
    assert (work / "hf" / "config.json").is_file()
    checkpoints = list((work / "runs" / "bert-mini").glob("checkpoint*"))
    assert checkpoints, sorted(p.name for p in (work / "runs" / "bert-mini").iterdir())
    results = list((work / "ft").glob("*/results.json"))
    assert results, consoles["finetune"][-2000:]
    # The Python API's loader example, on the shards the commands made.
    [loader_example] = _blocks("Python API")
    done = subprocess.run([sys.executable, "-c", loader_example], cwd=clone,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
