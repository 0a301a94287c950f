"""The agent learning bar in one command: a tiny causal LM learns to use a calculator.

Problems are ``a*b=`` with a three-digit ``a`` and a two-digit ``b``: a 2-layer model cannot
multiply, so without the tool it is almost never right. The model is pre-trained here on a mix
of traces: most answer directly (the true product: it learns the form, not the arithmetic), a
few (``--tool-share``) call ``<calculator>a*b</calculator>``, read the result and copy it. Greedy
decoding therefore starts out answering directly. Then two runs from that same checkpoint, with
the same prompts, steps and batch:

- agent: ``agent_arithmetic_tools_tiny`` (``env_type: agent``, up to 2 turns, the calculator);
- single-turn: ``math_grpo_tiny`` (the text env: one response, scored at once).

    python benchmarks/agent_learning.py [--out results/agent_learning] [--steps 60] [--val-every 20]

The last line is JSON: ``accuracy_start`` (held-out greedy accuracy of the checkpoint),
``accuracy_agent`` and ``accuracy_single_turn`` (after training), ``train_wall_s`` (the agent
run's training command) and both curves.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CALL = "<calculator>{}</calculator>"
CONTEXT, RESPONSE = 64, 32  # data.max_prompt_length (the whole context), response tokens per turn


def write_problems(folder: Path, train: int = 2000, test: int = 200, seed: int = 0) -> None:
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(100, 1000) for b in range(10, 100)], train + test)
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", pairs[:train]), ("test", pairs[train:])):
        with open(folder / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"prompt": f"{a}*{b}=", "answer": str(a * b)}) + "\n" for a, b in part)


def pretrain(out: Path, data: Path, tool_share: float, steps: int, seed: int = 0, batch: int = 64,
             lr: float = 3e-3) -> dict[str, float]:
    """The tiny model on traces: direct answers, and with probability ``tool_share`` a tool
    call, its result (not trained on) and the copied answer. Loss only on what the model says."""
    import string

    import torch

    from policies.tiny_lm import build_model, train_tokenizer

    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    tok = train_tokenizer([string.printable])
    eos = tok.eos_token_id
    model = build_model(len(tok), tok.pad_token_id, eos, seed=seed, positions=CONTEXT + RESPONSE)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    def trace(row: dict[str, str]) -> tuple[list[int], list[int]]:
        """ids and labels (-100 where the model does not speak)"""
        prompt = encode(row["prompt"])
        if rng.random() < tool_share:
            call = encode(CALL.format(row["prompt"][:-1])) + [eos]
            result = encode(row["answer"])
            answer = encode(row["answer"]) + [eos]
            return prompt + call + result + answer, [-100] * len(prompt) + call + [-100] * len(result) + answer
        answer = encode(row["answer"]) + [eos]
        return prompt + answer, [-100] * len(prompt) + answer

    tic = time.monotonic()
    for _ in range(steps):
        pairs = [trace(rows[rng.randrange(len(rows))]) for _ in range(batch)]
        width = max(len(ids) for ids, _ in pairs)
        ids = torch.full((batch, width), tok.pad_token_id)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, (seq, lab) in enumerate(pairs):
            ids[i, width - len(seq):] = torch.tensor(seq)
            labels[i, width - len(seq):] = torch.tensor(lab)
            mask[i, width - len(seq):] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return {"loss": round(loss.item(), 4), "seconds": round(time.monotonic() - tic, 1)}


def train_args(model: Path, data: Path, out: Path, name: str, steps: int, val_every: int,
               extra: list[str], val_rows: int = 200) -> list[str]:
    """The overrides of a training run of the bar (the test makes the same run in its process)."""
    return [f"actor.model.model_path={model}", f"data.train_data_paths=[{data / 'train.jsonl'}]",
            f"data.val_data_paths=[{data / 'test.jsonl'}]", f"runner.output_dir={out}",
            f"runner.experiment_name={name}", f"runner.max_epochs={steps}", f"runner.val_check_interval={val_every}",
            f"data.max_prompt_length={CONTEXT}", f"runner.seq_length={CONTEXT + RESPONSE}",
            "data.rollout_batch_size=16", f"data.val_rollout_batch_size={val_rows}", "algorithm.group_size=8",
            "actor.optim.lr=3e-4", *extra]


def train(config: str, model: Path, data: Path, out: Path, name: str, steps: int, val_every: int,
          extra: list[str], val_rows: int = 200) -> tuple[dict, float]:
    args = train_args(model, data, out, name, steps, val_every, extra, val_rows)
    tic = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "embodied", "train", "--config-name", config, *args],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{config} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), time.monotonic() - tic


def curve(log_dir: Path) -> list[dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    tools = {e.step: e.value for e in events.Scalars("eval/tool_calls")} if "eval/tool_calls" in tags else {}
    start = events.Scalars("eval/success_once")[0].wall_time
    return [{"time_s": round(e.wall_time - start, 1), "step": e.step, "accuracy": round(e.value, 3),
             **({"tool_calls": round(tools[e.step], 3)} if e.step in tools else {})}
            for e in events.Scalars("eval/success_once")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "results" / "agent_learning"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--tool-share", type=float, default=0.1)
    parser.add_argument("--pretrain-steps", type=int, default=1000)
    args = parser.parse_args()
    out = Path(args.out)

    import torch

    torch.set_num_threads(1)
    write_problems(out / "data")
    warm = pretrain(out / "model", out / "data", args.tool_share, args.pretrain_steps)
    print(f"pre-trained in {warm['seconds']} s (loss {warm['loss']})", flush=True)
    agent, wall = train("agent_arithmetic_tools_tiny", out / "model", out / "data", out, "agent", args.steps,
                        args.val_every, ["env.train.max_episode_steps=2", "env.eval.max_episode_steps=2",
                                         "actor.micro_batch_size=64", "actor.global_batch_size=256"])
    print(f"agent: {agent['eval_success_before']} -> {agent['eval_success']} in {wall:.0f} s", flush=True)
    single, _ = train("math_grpo_tiny", out / "model", out / "data", out, "single_turn", args.steps,
                      args.val_every, ["actor.micro_batch_size=64", "actor.global_batch_size=128"])
    print(f"single turn: {single['eval_success_before']} -> {single['eval_success']}", flush=True)
    print(json.dumps({"accuracy_start": agent["eval_success_before"], "accuracy_agent": agent["eval_success"],
                      "accuracy_single_turn": single["eval_success"], "train_wall_s": round(wall, 1),
                      "curve_agent": curve(out / "agent"), "curve_single_turn": curve(out / "single_turn")}))


if __name__ == "__main__":
    main()
