"""A tiny Llama-shaped causal LM with a character tokenizer trained on the spot, given a short
supervised warm start on an arithmetic prompt set: an ordinary Hugging Face checkpoint folder
(``config.json``, ``model.safetensors``, ``tokenizer.json``...) for trying math GRPO on a CPU.

    python -m policies.tiny_lm OUT --data DIR [--steps 300] [--seed 0]

``DIR`` holds ``train.jsonl`` (``python -m envs.arithmetic DIR``). The warm start trains on
prompt -> answer + EOS for ``--steps`` steps; it is short on purpose, so that RL has room to
improve on it (``python -m envs.arithmetic DIR --score OUT`` prints its held-out accuracy).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

PAD, EOS = "<pad>", "<eos>"


def train_tokenizer(texts: list[str]):
    """A character-level tokenizer (one token per character), trained on ``texts``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=[PAD, EOS]))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=PAD,
                                   padding_side="left")


def build_model(vocab_size: int, pad_id: int, eos_id: int, hidden: int = 128, layers: int = 2, seed: int = 0,
                positions: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=positions, pad_token_id=pad_id, eos_token_id=eos_id,
                         bos_token_id=None, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def _batch(tokenizer, rows: list[dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt + answer + EOS; labels only on answer and EOS."""
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    answers = [tokenizer(r["answer"])["input_ids"] + [tokenizer.eos_token_id] for r in rows]
    width = max(len(p) + len(a) for p, a in zip(prompts, answers))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        seq = p + a
        ids[i, width - len(seq):] = torch.tensor(seq)
        mask[i, width - len(seq):] = 1
        labels[i, width - len(a):] = torch.tensor(a)
    return ids, mask, labels


def warm_start(out: str | Path, data: str | Path, steps: int = 300, batch: int = 64, lr: float = 3e-3,
               seed: int = 0) -> dict[str, float]:
    """Build tokenizer and model, train ``steps`` supervised steps on ``data/train.jsonl``, save
    to ``out``; returns ``{"loss": the last step's, "seconds": training time}``."""
    with open(Path(data) / "train.jsonl") as f:
        train = [json.loads(line) for line in f if line.strip()]
    tokenizer = train_tokenizer([r["prompt"] + r["answer"] for r in train])
    model = build_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    tic = time.monotonic()
    model.train()
    for _ in range(steps):
        index = torch.randint(len(train), (batch,), generator=generator).tolist()
        ids, mask, labels = _batch(tokenizer, [train[i] for i in index])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    seconds = time.monotonic() - tic
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"loss": round(loss.item(), 4), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = warm_start(args.out, args.data, steps=args.steps, seed=args.seed)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
