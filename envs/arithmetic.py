"""An arithmetic prompt set for math GRPO on a CPU: ``a+b=`` / ``a-b=`` with ``a`` up to 99 and
``b`` up to 9 (2,000 problems: small enough for a tiny model to learn in minutes, carries and
negative answers included), written as JSONL files (``prompt``, ``answer``) with a disjoint
train/test split.

The answer is the plain integer; math-verify checks it (``envs/verifier.py``), and a response
that merely repeats the question's expression does not count as that answer there.

    python -m envs.arithmetic DIR [--train 1800] [--test 200] [--seed 0]
    python -m envs.arithmetic DIR --score MODEL     # held-out greedy accuracy of a model folder
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from core.errors import DataError

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


def read_jsonl(path: str | Path) -> list[dict[str, str]]:
    """The ``prompt`` / ``answer`` rows of a prompt file, or one ``DataError`` naming the file and
    line (the text env's reader)."""
    from envs.text import read_records

    return [{"prompt": p, "answer": a} for p, a in read_records(path, "prompt", "answer")]


def greedy_accuracy(model: Any, tokenizer: Any, rows: list[dict[str, str]], max_new_tokens: int = 6) -> float:
    """Greedy accuracy of a Hugging Face causal LM on ``rows``, scored as the text env scores
    (math-verify, ``envs.verifier``'s rules)."""
    import torch

    from envs.verifier import CORRECT, score_one

    model.eval()
    enc = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(score_one(t, r["answer"]) == CORRECT for t, r in zip(texts, rows)) / len(rows)


def held_out_accuracy(model_dir: str | Path, folder: str | Path) -> float:
    """``greedy_accuracy`` of the model folder ``model_dir`` on ``folder/test.jsonl``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = read_jsonl(Path(folder) / "test.jsonl")  # a malformed file fails before the model loads
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return greedy_accuracy(model, AutoTokenizer.from_pretrained(model_dir), rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--train", type=int, default=1800)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--score", metavar="MODEL", help="print MODEL's held-out greedy accuracy instead")
    args = parser.parse_args()
    if args.score:
        try:
            accuracy = held_out_accuracy(args.score, args.folder)
        except DataError as err:  # a malformed test.jsonl: one line, exit code 2 as in the CLI
            print(f"python -m envs.arithmetic: {err}", file=sys.stderr)
            sys.exit(2)
        print(json.dumps({"accuracy": accuracy}))
        return
    for name, path in write_split(args.folder, args.train, args.test, args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
