"""``python -m embodied train|eval|export ...``: the CLI without install."""

import sys

from embodied.cli import evaluate, export, train

if __name__ == "__main__":
    commands = {"train": train, "eval": evaluate, "export": export}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit("usage: python -m embodied {train,eval,export} [--config-name NAME] [--dry-run] [overrides]")
    commands[sys.argv[1]](sys.argv[2:])
