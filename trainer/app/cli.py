"""The `dutycycle` command. Each package registers its own subcommands; heavy imports happen inside them."""

from __future__ import annotations

import argparse
import importlib
import sys

from dutycycle.engine.errors import DutycycleError

# Modules that expose `register(subparsers)`, in the order their commands are listed.
COMMAND_MODULES = [
    "dutycycle.engine.cli",
    "dutycycle.engine.cache.cli",
    "dutycycle.loader.cli",
    "dutycycle.trainer.app.commands",
    "dutycycle.trainer.serve.evaluate_cli",
    "dutycycle.trainer.serve.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dutycycle",
        description="Keep training accelerators busy: curate, cache, load and train, and account for every second.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except DutycycleError as e:
        print(f"dutycycle {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C; or SIGTERM, which a diagnosis turns into one carrying ``signum``
        print(f"dutycycle {args.command}: interrupted", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)
    except BrokenPipeError:
        # `dutycycle plan | head`: the reader left; stop quietly, as Unix tools do. Point stdout at /dev/null so
        # the interpreter's final flush does not raise the same error again (Python's documented recipe).
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool stopped by a closed pipe
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
