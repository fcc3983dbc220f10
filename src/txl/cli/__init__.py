"""The ``txl`` command line: one module per command (``txl.cli.train``, ``txl.cli.evaluate``, ...) over shared
helpers (``txl.cli.common``); ``txl.cli.app`` builds the parser and runs a command. ``txl --help`` lists them."""

from txl.cli.app import ALIASES, COMMANDS, HELP, _description, _summary, build_parser, main, normalize_argv, run

__all__ = ["ALIASES", "COMMANDS", "HELP", "_description", "_summary", "build_parser", "main", "normalize_argv", "run"]
