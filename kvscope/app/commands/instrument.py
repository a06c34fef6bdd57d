"""`kvscope instrument -- CMD ...`: its options; the body is kvscope/app/instrument.py."""

from __future__ import annotations

import argparse

# NOTE: each sets its KVSCOPE_* variable over the environment's; the probe's settings check the value
CENSUS_OPTIONS = (
    (
        "--census-every-steps",
        "KVSCOPE_CENSUS_EVERY_STEPS",
        "N",
        "a census while busy after N engine steps since the last (0: off; default 100)",
    ),
    (
        "--census-every-s",
        "KVSCOPE_CENSUS_EVERY_S",
        "SECONDS",
        "or after this long since the last (0: off; default 10)",
    ),
    (
        "--linger-steps",
        "KVSCOPE_LINGER_STEPS",
        "N",
        "a finished request still holding blocks is a leak after N steps (default 1000)",
    ),
    (
        "--linger-s",
        "KVSCOPE_LINGER_S",
        "SECONDS",
        "and after this long (default 600)",
    ),
)


class InstrumentCommand:
    name = "instrument"
    help = "run vLLM or SGLang with kvscope's probe recording its KV memory inside the engine"
    description = (
        "Set KVSCOPE_CAPTURE, KVSCOPE_PYTHON and (--level) KVSCOPE_LEVEL, then exec CMD (as opentelemetry-instrument "
        "does). kvscope must be installed in the engine's venv (pip install --no-deps, docs/probe.md): the "
        "engine then loads the probe through its plugin entry point (vLLM: vllm.general_plugins, in every "
        "process; SGLang: sglang.srt.plugins, in the scheduler); the engine records (level full) every block or "
        "page alloc, touch, cache, free and eviction with its request, and a census of every block's references "
        "(vLLM) or every page's place (SGLang) at each busy -> idle edge, while busy (--census-every-steps / "
        "--census-every-s) and at shutdown, stored as leak checks: `kvscope "
        "check CAPTURE` exits 0 (clean), 1 (a leak, with the block and the request that last took it) or 3. "
        "Releases are supported by the shapes of their code (docs/probe.md's version table); a release "
        "whose code differs is refused in one line naming the target while the engine runs unrecorded. "
        "The probe says which as it loads; --probe-check (or kvscope probe-check beforehand) says it "
        "before the engine starts, at the cost of importing the engine's modules once more. "
        "VLLM_PLUGINS gets kvscope (appended to a list you set; unset: the "
        "engine's own plugins and kvscope) so that GET /kvscope/census loads; a SGLANG_PLUGINS list you set "
        "gets kvscope appended. "
        "KVSCOPE_PYTHON (the python of the probe's recorder) stays as you set it, else is this python; "
        "either needs kvscope's dependencies (SQLAlchemy), which an engine's venv lacks. "
        "Exit 2 on bad input (no command, a bad capture, kvscope not installed beside a vLLM engine, "
        "a recorder python without kvscope's dependencies)."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--capture", metavar="PATH|URL", help="capture file or database URL (default runs/<time>-instrument.db)"
        )
        parser.add_argument(
            "--level",
            choices=["summary", "full"],
            help=(
                "summary: census, usage and requests (on SGLang without touching its allocators and trees: "
                "no per-operation cost; who freed a page or locked a node is then not named); full: and every "
                "block or page event, each page's releaser and each lock's holder (on SGLang 2-3 µs per "
                "allocator or tree call: a level for debugging). Default: KVSCOPE_LEVEL, else full on vLLM and "
                "summary on SGLang, each within the probe's 1 µs per call"
            ),
        )
        parser.add_argument(
            "--probe-check",
            action="store_true",
            help=(
                "before the engine starts, check in the command's python whether the probe will load on its "
                "code (kvscope probe-check's first line). Off by default: the check imports the engine's "
                "modules, seconds before the engine starts, and the probe says the same as it loads"
            ),
        )
        for option, env, kind, text in CENSUS_OPTIONS:
            parser.add_argument(option, metavar=kind, dest=env, help=f"{text} (sets {env}; docs/probe.md)")
        parser.add_argument(
            "command",
            nargs=argparse.REMAINDER,
            metavar="-- CMD ...",
            help="the engine's command, e.g. -- vllm serve MODEL",
        )

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.instrument import instrument_verb

        return instrument_verb(args)
