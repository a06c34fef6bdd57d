"""`kvscope instrument`: sets the probe's environment and execs the engine's command; bad input is
one line and exit 2 (the command never starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHOW_ENV = "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('KVSCOPE_')}))"
SHOW_PLUGINS = "import os; print(os.environ.get('VLLM_PLUGINS', '<unset>'))"


def kvscope(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVSCOPE_", "VLLM_PLUGINS"))}
    return subprocess.run(
        [sys.executable, "-m", "kvscope", "instrument", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**base, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=120,
        check=False,
    )


def test_it_execs_the_command_with_the_probes_environment(tmp_path: Path) -> None:
    capture = tmp_path / "probe.db"
    out = kvscope("--capture", str(capture), "--level", "summary", "--", sys.executable, "-c", SHOW_ENV)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "KVSCOPE_CAPTURE": str(capture),
        "KVSCOPE_LEVEL": "summary",
        "KVSCOPE_PYTHON": sys.executable,
    }
    assert out.stderr == (
        f"kvscope instrument: recording into {capture} (level summary; VLLM_PLUGINS=kvscope); "
        f"then kvscope check {capture}\n"
    )
    assert not capture.exists()  # NOTE: the recorder's host makes it; its directory was checked (below)


@pytest.mark.parametrize(
    ("environment", "shown"), [({}, "full on vLLM, summary on SGLang"), ({"KVSCOPE_LEVEL": "full"}, "full")]
)
def test_without_level_the_environments_stays_else_each_engine_takes_its_default(
    tmp_path: Path, environment: dict[str, str], shown: str
) -> None:
    """No --level: KVSCOPE_LEVEL as the environment has it; unset, the probe takes its engine's default
    (DEFAULT_LEVEL), and the line says which that is."""
    capture = tmp_path / "probe.db"
    out = kvscope("--capture", str(capture), "--", sys.executable, "-c", SHOW_ENV, env=environment)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout).get("KVSCOPE_LEVEL") == environment.get("KVSCOPE_LEVEL")
    assert out.stderr.startswith(f"kvscope instrument: recording into {capture} (level {shown}; "), out.stderr


def test_a_level_in_the_environment_that_is_neither_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Kept without --level, so checked here: the probe would refuse it inside the engine."""
    out = kvscope("--capture", str(tmp_path / "c.db"), "--", "true", env={"KVSCOPE_LEVEL": "verbose"})
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == "kvscope instrument: error: KVSCOPE_LEVEL must be summary or full, got 'verbose'\n"


def test_census_options_set_their_variables_over_the_environments(tmp_path: Path) -> None:
    capture = tmp_path / "probe.db"
    args = ("--capture", str(capture), "--census-every-steps", "5", "--linger-s", "30")
    out = kvscope(
        *args,
        "--",
        sys.executable,
        "-c",
        SHOW_ENV,
        env={"KVSCOPE_CENSUS_EVERY_STEPS": "7", "KVSCOPE_LINGER_STEPS": "9"},
    )
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert {name: shown[name] for name in shown if "CENSUS" in name or "LINGER" in name} == {
        "KVSCOPE_CENSUS_EVERY_STEPS": "5",  # the option over the environment's 7
        "KVSCOPE_LINGER_S": "30",
        "KVSCOPE_LINGER_STEPS": "9",  # no option: the environment's stays
    }


def test_a_capture_whose_directory_it_cannot_make_is_one_line(tmp_path: Path) -> None:
    """Checked before the engine starts, as the recorder's host would fail on it inside the engine."""
    (tmp_path / "file").write_text("")
    capture = tmp_path / "file" / "c.db"
    out = kvscope("--capture", str(capture), "--", "true")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == f"kvscope instrument: error: {capture}: cannot create its directory (File exists)\n"


def test_it_imports_neither_sqlalchemy_nor_pandas_nor_numpy(tmp_path: Path) -> None:
    """Its start is the engine's: the modules loaded when it would exec the engine."""
    script = (
        "import os, sys\n"
        "def show(*_):\n"
        "    print(' '.join(sorted({m.split('.')[0] for m in sys.modules} & {'sqlalchemy', 'pandas', 'numpy'})))\n"
        "    sys.exit(0)\n"
        "os.execvpe = show\n"
        "from kvscope.__main__ import main\n"
        f"main(['instrument', '--capture', {str(tmp_path / 'c.db')!r}, '--', 'true'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert (out.returncode, out.stdout) == (0, "\n"), out.stderr


def engine_like_venv(tmp_path: Path) -> Path:
    """A venv without kvscope's dependencies, kvscope on its path (as pip install --no-deps -e leaves it)."""
    venv = tmp_path / "engine-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    )
    Path(site.stdout.strip(), "kvscope-checkout.pth").write_text(f"{ROOT}\n")
    return python


def in_venv(python: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVSCOPE_", "VLLM_PLUGINS", "PYTHONPATH"))}
    return subprocess.run(
        [str(python), "-m", "kvscope", *args],
        capture_output=True,
        text=True,
        cwd=python.parent,
        env={**base, **(env or {})},
        timeout=120,
        check=False,
    )


def test_in_an_engines_venv_without_its_dependencies_each_verb_says_which_kvscope_to_run(tmp_path: Path) -> None:
    python = engine_like_venv(tmp_path)
    for args in (("runs", "c.db"), ("check", "c.db"), ("report", "leaks", "c.db"), ("--help",)):
        out = in_venv(python, *args)
        verb = "" if args[0].startswith("-") else f" {args[0]}"
        assert (out.returncode, out.stdout) == (2, ""), out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
        assert out.stderr.startswith(f"kvscope{verb}: error: numpy is not installed in this python ({python})")
        assert "run the kvscope of a venv where it is installed with them" in out.stderr


def test_instrument_in_an_engines_venv_needs_a_recorder_python_and_takes_kvscope_python(tmp_path: Path) -> None:
    python = engine_like_venv(tmp_path)
    capture = tmp_path / "c.db"
    out = in_venv(python, "instrument", "--capture", str(capture), "--", "true")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == (
        f"kvscope instrument: error: this python ({python}) has no sqlalchemy, numpy, which the probe's recorder "
        "needs: set KVSCOPE_PYTHON to the python of a venv where kvscope is installed with its dependencies, or "
        "run that venv's kvscope instrument (the engine's venv needs kvscope only with --no-deps: docs/probe.md)\n"
    )
    out = in_venv(python, "instrument", "--capture", str(capture), "--", "true", env={"KVSCOPE_PYTHON": str(python)})
    assert out.returncode == 2 and out.stderr.startswith(f"kvscope instrument: error: KVSCOPE_PYTHON ({python}) has no")
    out = in_venv(
        python,
        "instrument",
        "--capture",
        str(capture),
        "--",
        str(python),
        "-c",
        SHOW_ENV,
        env={"KVSCOPE_PYTHON": sys.executable, "VLLM_PLUGINS": "kvscope"},
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["KVSCOPE_PYTHON"] == sys.executable


def test_the_commands_exit_code_is_its_own(tmp_path: Path) -> None:
    out = kvscope("--capture", str(tmp_path / "c.db"), "--", sys.executable, "-c", "raise SystemExit(7)")
    assert out.returncode == 7


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (
            (),
            None,
            "kvscope instrument: error: name the engine's command after --, e.g. kvscope instrument -- vllm serve "
            "MODEL",
        ),
        (("--", "no-such-engine-cmd"), None, "kvscope instrument: error: no-such-engine-cmd: command not found"),
        (
            ("--level", "debug", "--", "true"),
            None,
            "kvscope instrument: error: argument --level: invalid choice: 'debug' (choose from 'summary', 'full')",
        ),
        (
            ("--", "true"),
            {"KVSCOPE_CENSUS_EVERY_STEPS": "often"},
            "kvscope instrument: error: KVSCOPE_CENSUS_EVERY_STEPS must be a whole number >= 0, got 'often'",
        ),
        (
            ("--census-every-s", "soon", "--", "true"),
            None,
            "kvscope instrument: error: KVSCOPE_CENSUS_EVERY_S must be a number of seconds >= 0, got 'soon'",
        ),
        (
            ("--", "true"),
            {"KVSCOPE_LINGER_S": "-1"},
            "kvscope instrument: error: KVSCOPE_LINGER_S must be a number of seconds >= 0, got '-1'",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str] | None, line: str
) -> None:
    out = kvscope("--capture", str(tmp_path / "c.db"), *args, env=env)
    assert (out.returncode, out.stderr, out.stdout) == (2, line + "\n", "")


def test_a_capture_it_cannot_write_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_text("not a database")
    out = kvscope("--capture", str(bad), "--", "true")
    assert (out.returncode, out.stderr) == (
        2,
        f"kvscope instrument: error: {bad}: not a kvscope capture (not a SQLite database)\n",
    )


def fake_plugins(root: Path) -> Path:
    """A site directory holding one installed distribution with vLLM plugins of three groups."""
    info = root / "fake_plugins-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-plugins\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nmy_general = fake:register\n\n"
        "[vllm.platform_plugins]\nmy_platform = fake:platform\n\n"
        "[vllm.endpoint_plugins]\nmy_route = fake:Route\n"
    )
    return root


@pytest.mark.parametrize(
    ("plugins", "seen"),
    [
        ("lora_filesystem_resolver", "lora_filesystem_resolver,kvscope"),  # the user's list stays, kvscope joins it
        ("kvscope,lora_hf_hub_resolver", "kvscope,lora_hf_hub_resolver"),
        ("", "kvscope"),  # vLLM reads "" as a list naming nothing
    ],
)
def test_a_plugin_allowlist_gets_kvscope_appended(tmp_path: Path, plugins: str, seen: str) -> None:
    out = kvscope(
        "--capture", str(tmp_path / "c.db"), "--", sys.executable, "-c", SHOW_PLUGINS, env={"VLLM_PLUGINS": plugins}
    )
    assert (out.returncode, out.stdout) == (0, seen + "\n"), out.stderr
    assert f"VLLM_PLUGINS={seen})" in out.stderr


def test_without_an_allowlist_it_names_the_engines_own_plugins_and_kvscope(tmp_path: Path) -> None:
    """Unset, vLLM loads every general plugin but no endpoint plugin: the verb lists what the engine's
    interpreter has (not its endpoint plugins, which were off) so the census route loads and nothing
    vLLM loaded before is dropped. The command here is a script whose #! names that interpreter."""
    site = fake_plugins(tmp_path / "site")
    script = tmp_path / "engine"
    script.write_text(f"#!{sys.executable}\n{SHOW_PLUGINS}\n")
    script.chmod(0o755)
    out = kvscope(
        "--capture", str(tmp_path / "c.db"), "--", str(script), env={"PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
    )
    assert (out.returncode, out.stdout) == (0, "kvscope,my_general,my_platform\n"), out.stderr


def test_an_engine_without_kvscope_installed_is_one_line_and_exit_2(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            "instrument",
            "--capture",
            str(tmp_path / "c.db"),
            "--",
            str(python),
            "-c",
            "print('served')",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith(("KVSCOPE_", "VLLM_PLUGINS", "PYTHONPATH"))},
        timeout=120,
        check=False,
    )
    # NOTE: no PYTHONPATH and not in the checkout (kvscope's own venv has it installed): with the checkout on the
    # engine's path (`-c` puts the cwd first), the kvscope.egg-info an editable install leaves there shows it the probe
    assert (out.returncode, out.stdout) == (2, ""), out.stderr
    assert out.stderr == (
        f"kvscope instrument: error: kvscope is not installed beside the engine ({python}): vLLM "
        "would not load the probe; install it there with pip install --no-deps (docs/probe.md)\n"
    )


def test_a_command_whose_python_it_cannot_tell_keeps_the_allowlist_unset_and_says_so(tmp_path: Path) -> None:
    out = kvscope("--capture", str(tmp_path / "c.db"), "--", "sh", "-c", "echo ${VLLM_PLUGINS-unset}")
    assert (out.returncode, out.stdout) == (0, "unset\n")
    assert "VLLM_PLUGINS unset: GET /kvscope/census is off (set VLLM_PLUGINS to your plugins and kvscope)" in out.stderr
