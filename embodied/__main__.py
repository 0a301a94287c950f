"""``python -m embodied train ...`` / ``python -m embodied eval ...``: the CLI without install."""

import sys

from embodied.cli import evaluate, train

if __name__ == "__main__":
    commands = {"train": train, "eval": evaluate}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit("usage: python -m embodied {train,eval} [--config-name NAME] [--dry-run] [overrides]")
    commands[sys.argv[1]](sys.argv[2:])
