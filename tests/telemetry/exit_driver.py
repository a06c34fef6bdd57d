"""A process recording through the probe's path (KVSCOPE_CAPTURE, open_recorder: a RemoteRecorder)
that stores one passing census and then ends one way, in itself or in a multiprocessing child (as
vLLM's EngineCore and SGLang's scheduler run):

    python exit_driver.py HOW [plain|fork|spawn]

HOW: close (its owner closes the run), end (the program ends), exit0, exit3, exit-text (sys.exit(N)),
raise-exit3 (SystemExit(3) raised directly), raise (ValueError), interrupt (KeyboardInterrupt),
kill (SIGKILL), term (SIGTERM, default action). Prints nothing; the capture says how it ended."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys

from kvscope.probe.census import BlockView, census_checks, take_census
from kvscope.probe.core import open_recorder, settings_from_env


def engine(how: str) -> None:
    settings = settings_from_env(engine="vllm")
    assert settings is not None
    config = {"source": {"kind": "probe", "engine": "vllm", "version": "0.32.0"}}
    rec = open_recorder(settings, label="exit driver", config=config)
    rec.step = 1
    for check in census_checks(1, take_census(BlockView({1: 0}, set(), [1], 1), [], [], set(), {})):
        rec.leak_check(check)
    rec.idle()
    if how == "close":
        rec.close()
    elif how == "exit0":
        sys.exit(0)
    elif how == "exit3":
        sys.exit(3)
    elif how == "exit-text":
        sys.exit("the model failed to load\nsecond line")
    elif how == "raise-exit3":
        raise SystemExit(3)
    elif how == "raise":
        raise ValueError("block 27 ref -1\nmore")
    elif how == "interrupt":
        raise KeyboardInterrupt
    elif how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "term":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def main(how: str, mode: str) -> None:
    if mode == "plain":
        engine(how)
        return
    child = multiprocessing.get_context(mode).Process(target=engine, args=(how,))
    child.start()
    child.join(timeout=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "plain")
