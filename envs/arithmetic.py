"""An arithmetic prompt set for math GRPO on a CPU: ``a+b=`` / ``a-b=`` with ``a`` up to 99 and
``b`` up to 9 (2,000 problems: small enough for a tiny model to learn in minutes, carries and
negative answers included), written as JSONL files (``prompt``, ``answer``) with a disjoint
train/test split.

The answer is the plain integer; math-verify checks it (``envs/verifier.py``), and a response
that merely repeats the question's expression does not count as that answer there.

    python -m envs.arithmetic DIR [--train 1800] [--test 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OPERATORS = ("+", "-")


def make_problems(count: int, seed: int, max_first: int = 99, max_second: int = 9) -> list[dict[str, str]]:
    """``count`` distinct problems, drawn without replacement from all operand/operator triples."""
    space = [(a, op, b) for a in range(max_first + 1) for op in OPERATORS for b in range(max_second + 1)]
    if count > len(space):
        raise ValueError(f"only {len(space)} distinct problems with operands up to {max_first} and {max_second}")
    chosen = random.Random(seed).sample(space, count)
    return [{"prompt": f"{a}{op}{b}=", "answer": str(a + b if op == "+" else a - b)} for a, op, b in chosen]


def write_split(folder: str | Path, train: int = 1800, test: int = 200, seed: int = 0) -> dict[str, Path]:
    """``train.jsonl`` and ``test.jsonl`` in ``folder`` (disjoint problems); returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    problems = make_problems(train + test, seed)
    paths = {"train": folder / "train.jsonl", "test": folder / "test.jsonl"}
    for name, rows in (("train", problems[:train]), ("test", problems[train:])):
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--train", type=int, default=1800)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, path in write_split(args.folder, args.train, args.test, args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
