"""The `kvscope` verbs as Commands (kvscope/app/commands/): every verb the parser offers is one
Command's, and the verbs that need no engine (their help, their parsers and their error paths)
run without loading torch in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvscope.app import build_parser
from kvscope.app.commands import COMMANDS

ENGINE_VERBS = {"demo", "run", "serve"}  # their bodies load torch (runner.py, serve.py, demo.py)


def test_every_verb_is_run_by_its_command() -> None:
    """The router adds nothing of its own: each verb's parser calls the run of the Command that
    declared it, and no Command is left out."""
    parser = build_parser()
    (verbs,) = [action for action in parser._actions if action.dest == "verb"]
    assert list(verbs.choices) == [command.name for command in COMMANDS]  # type: ignore[arg-type]
    for command in COMMANDS:
        assert verbs.choices[command.name].get_default("func") == command.run  # type: ignore[index]


def test_verbs_without_an_engine_never_load_torch(tmp_path: Path) -> None:
    """`kvscope --help`, every verb's --help, and the bad-input path of each verb that needs no
    engine (which imports its body) leave torch unloaded."""
    verbs = [command.name for command in COMMANDS]
    missing = str(tmp_path / "missing.db")
    runs = [
        ["runs", missing],
        ["report", "leaks", missing],
        ["report", "engine-log", missing],
        ["check", missing],
        ["diff", missing, missing],
        ["upgrade", missing],
        ["instrument"],
        ["probe-check", "--python", missing],
        ["plan", "--model", "no-such-model"],
        ["replay", missing],
        ["fleet", missing],
        ["load", "--url", "http://127.0.0.1:9", "--workload", "random", "--num-requests", "1", "--quiet"],
        ["attach", "--url", "http://127.0.0.1:9", "--timeout-s", "1", "--capture", missing],
    ]
    assert {argv[0] for argv in runs} | ENGINE_VERBS == set(verbs)
    code = (
        "import contextlib, io, sys\n"
        "from kvscope.app.cli import main\n"
        f"for argv in [['--help'], *[[verb, '--help'] for verb in {verbs!r}], ['report', 'leaks', '--help']]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        f"codes = [main(argv) for argv in {runs!r}]\n"
        "print(codes, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == f"{[2] * len(runs)} False", out.stdout + out.stderr
