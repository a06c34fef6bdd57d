"""`kvscope report TOPIC`: its topics' options; the bodies are in kvscope/app/report.py."""

from __future__ import annotations

import argparse

from kvscope.app.commands.base import Command, add_command


class LeaksTopic:
    name = "leaks"
    help = "name the culprits of every leak"
    description = (
        "For each leak: the pool, the slots, the request that last owned them and its principal, the step and "
        "event that allocated them, the free that never came, the first failing leak check and the onset "
        "step; then the verdict `kvscope check` gives. A capture recorded below level full has no slot "
        "indices: the report says what it can and cannot show, and works from the leak checks and the "
        "requests table."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("capture", help="a capture file or a SQLAlchemy URL")
        parser.add_argument("--run", type=int, help="run id (default: the latest run)")
        parser.add_argument("--json", action="store_true", help="print the report and its verdict as JSON")
        parser.add_argument(
            "--replay",
            action="store_true",
            help="replay the capture's events even when the leak report stored at close still describes the run",
        )

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.report import report_verb

        return report_verb(args)


class EngineLogTopic:
    name = "engine-log"
    help = "explain the leak messages in an SGLang server log"
    description = (
        "Find SGLang's leak-check messages (every release's text: 0.1 to 0.5.23, idle and busy checks, SWA "
        "and mamba pools, the request pool, use-after-free) in a server log, and explain each in the words of "
        "`report leaks`: per pool, the invariant's terms and how many tokens are missing or counted twice, "
        "the line and time, the release family, and what the message cannot tell (no culprit) with the "
        "kvscope command that would. Exit 0 once the log is read, leak messages or not (the JSON's verdict "
        "says which), 2 when the file cannot be read as a text log. See docs/cli.md."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("log", metavar="FILE", help="the server's log (any size; read line by line)")
        parser.add_argument(
            "--json", action="store_true", help="print the messages as JSON (the exit code is the same)"
        )

    def run(self, args: argparse.Namespace) -> int:
        from kvscope.app.report import engine_log_verb

        return engine_log_verb(args)


class ReportCommand:
    name = "report"
    help = "explain a capture or a server log (report leaks CAPTURE, report engine-log FILE)"
    description = "Reports over a capture, or over an SGLang server's log."
    topics: tuple[Command, ...] = (LeaksTopic(), EngineLogTopic())

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        topics = parser.add_subparsers(dest="topic", required=True, metavar="TOPIC")
        for topic in self.topics:
            add_command(topics, topic)

    def run(self, args: argparse.Namespace) -> int:
        (topic,) = [topic for topic in self.topics if topic.name == args.topic]
        return topic.run(args)
