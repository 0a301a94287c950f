"""A prompt set as a single-step text environment (``env_type: text``).

A reset hands each env the next prompt (text and left-padded token ids); one step takes the
responses as token ids, decodes them, scores each against its prompt's reference answer with
math-verify (``envs/verifier.py``) and ends the episode: ``T = 1``, ``terminations = True``.
The reward is ``+reward_scale`` for a verified answer and ``-reward_scale`` otherwise (the
reference's ``reward.reward_scale``), times ``reward_coef``; unparsable responses and verifier
timeouts score as wrong and are counted (``<split>/unparsable``, ``<split>/verifier_timeout``).
With ``pass_at_group`` (the pass@k split, ``config/env/math_val_pass_k.yaml``) an episode's
``success_once`` is whether any response of its group is verified: averaged over the episodes it
is pass@k with k = ``group_size`` samples per prompt (plainly k samples, no n > k estimator);
``success`` stays the response's own verdict (the sampled accuracy).

Prompt order: the prompts of all files form one list; with ``shuffle`` every epoch walks a new
permutation of it (seeded by ``seed`` and the epoch). Group ``g`` of ``G`` groups across all env
workers and stages takes position ``k * G + g`` of that walk at its ``k``-th episode, so every
prompt comes once per epoch; the ``group_size`` envs of a group share it (with
``use_fixed_reset_state_ids``; without, every env is its own group). Unshuffled eval envs thus
see the first ``total_num_envs / group_size`` prompts, each exactly once.

Prompts longer than ``max_prompt_length`` tokens (after the tokenizer's chat template, when it
has one and ``apply_chat_template`` is on) are dropped when loading, and counted
(``<split>/prompts_filtered``). Each episode's ``task_descriptions`` is the stem of its prompt's
data file, so success (= accuracy) is also reported per data file. ``init_params`` (see
config/env/math_*.yaml) carry the ``data.*`` keys, the tokenizer and ``reward.reward_scale``
down to the env.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.description import EnvDescription
from core.errors import DataError, EnvSetupError
from envs.protocol import NO_TOKEN, ResetStates
from envs.vector_env import read_options
from envs.verifier import TIMEOUT, UNPARSABLE, Verifier

SAMPLES_KEPT = 8  # responses kept from each step for the logs


@dataclass
class Prompt:
    text: str  # after the chat template
    ids: list[int]
    answer: str
    source: str  # data file stem


def load_tokenizer(params: Mapping[str, Any]):
    """The tokenizer of ``tokenizer_model`` (or ``model_path``), as ``actor.tokenizer`` says."""
    from transformers import AutoTokenizer

    path = params.get("tokenizer_model") or params.get("model_path")
    if not path or not Path(path).is_dir():
        raise DataError(f"actor.tokenizer.tokenizer_model / actor.model.model_path = {path!r}: expected a "
                        "tokenizer folder")
    try:
        return AutoTokenizer.from_pretrained(path, use_fast=params.get("use_fast", True),
                                             trust_remote_code=params.get("trust_remote_code", False))
    except (OSError, ValueError) as err:
        raise DataError(f"cannot load a tokenizer from {path}: {' '.join(str(err).split())[:300]}") from None


def read_records(path: str | Path, prompt_key: str, answer_key: str) -> list[tuple[str, str]]:
    """``(prompt, answer)`` of every record of a JSONL or parquet file, or one ``DataError``
    naming the file, line (parquet: row or row group) and key."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    keys = ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key"))
    rows: list[tuple[str, Any, Any]] = []  # (where, prompt, answer)
    if path.suffix == ".parquet":
        for number, record in enumerate(read_parquet(path, keys), 1):
            rows.append((f"{path}: row {number}", record[prompt_key], record[answer_key]))
    else:
        for number, record in read_jsonl(path):
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number}: not a JSON object")
            for key, name in keys:
                if key not in record:
                    raise DataError(f"{path}:{number}: no key {key!r} ({name}); keys are {sorted(record)}")
            rows.append((f"{path}:{number}", record[prompt_key], record[answer_key]))
    if not rows:
        raise DataError(f"data file {path} holds no records")
    for where, prompt, _ in rows:
        if not isinstance(prompt, str):
            raise DataError(f"{where}: {prompt_key!r} is not a string")
    return [(prompt, str(answer)) for _, prompt, answer in rows]


def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of every non-blank line of a JSONL file, or one ``DataError``
    naming the file and line: text that is not UTF-8 (a byte-order mark is fine), or not JSON."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{number}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                f"{err.start + 1}); save the file as UTF-8 JSONL") from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line.rstrip("\r\n"))  # columns count within this line
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not JSON ({err.msg} at column {err.colno})") from None


def read_parquet(path: Path, columns: Sequence[tuple[str, str]]) -> Iterator[dict[str, Any]]:
    """The ``columns`` (name, the config key that names it) of every row of a parquet file, one
    row group at a time, or one ``DataError`` naming the file (and the row group) that cannot be
    read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable parquet file ({_first_line(err)})") from None
    names = file.schema_arrow.names
    for column, key in columns:
        if column not in names:
            raise DataError(f"{path}: no column {column!r} ({key}); columns are {names}")
    for group in range(file.num_row_groups):
        try:
            table = file.read_row_group(group, columns=[c for c, _ in columns])
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{path}: row group {group + 1} of {file.num_row_groups} cannot be read "
                            f"({_first_line(err)})") from None
        yield from table.to_pylist()


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def load_prompts(params: Mapping[str, Any], tokenizer) -> tuple[list[Prompt], int]:
    """Every prompt of ``params.data_paths`` that fits ``max_prompt_length`` tokens, and how many
    did not."""
    paths = list(params["data_paths"])
    if not paths:
        raise DataError("no data files: set data.train_data_paths / data.val_data_paths")
    limit = int(params["max_prompt_length"])
    prompts, dropped = [], 0
    templated = bool(tokenizer.chat_template) and params["apply_chat_template"]
    for path in paths:
        records = read_records(path, params["prompt_key"], params["answer_key"])
        texts = [_template(tokenizer, p) if templated else p for p, _ in records]
        encoded = tokenizer(texts, add_special_tokens=not templated)["input_ids"]
        for text, ids, (_, answer) in zip(texts, encoded, records):
            if len(ids) > limit:
                dropped += 1
            else:
                prompts.append(Prompt(text, list(ids), answer, Path(path).stem))
    if not prompts:
        raise DataError(f"all {dropped} prompts of {paths} are longer than data.max_prompt_length={limit} tokens")
    return prompts, dropped


def _template(tokenizer, prompt: str) -> str:
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt


_VERIFIER: Verifier | None = None


def shared_verifier() -> Verifier:
    """One scoring pool per process, shared by its envs (stages score one after another)."""
    global _VERIFIER
    if _VERIFIER is None:
        _VERIFIER = Verifier()
    return _VERIFIER


def left_padded(rows: Sequence[Sequence[int]], width: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """``input_ids`` / ``attention_mask`` ``[len(rows), width]``: each row's last ``width`` ids,
    right-aligned after padding (the layout every text policy reads)."""
    ids = np.full((len(rows), width), pad, np.int64)
    mask = np.zeros_like(ids)
    for row, seq in enumerate(rows):
        kept = list(seq)[-width:]
        if kept:
            ids[row, -len(kept):] = kept
            mask[row, -len(kept):] = 1
    return ids, mask


def read_response(seq: np.ndarray, eos: int, tokenizer: Any) -> tuple[list[int], bool, str]:
    """One response as generated: its ids up to and including the first EOS, or up to the first
    ``NO_TOKEN`` (it ended at a stop string, or at the length limit); whether it ended with EOS;
    and its text without that EOS."""
    seq = np.asarray(seq, np.int64)
    end = np.flatnonzero((seq == eos) | (seq == NO_TOKEN))
    ended = bool(end.size) and bool(seq[end[0]] == eos)
    ids = seq[:end[0] + ended].tolist() if end.size else seq.tolist()
    return ids, ended, tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=True)


def token_actions(actions: np.ndarray, num_envs: int) -> np.ndarray:
    """A text env's actions: one response of token ids per env, ``[num_envs, 1, L]``."""
    actions = np.asarray(actions)
    if actions.ndim != 3 or actions.shape[:2] != (num_envs, 1):
        raise ValueError(f"actions: expected token ids of shape [{num_envs}, 1, L], got {list(actions.shape)}")
    return actions


def describe(cfg: Mapping[str, Any]) -> EnvDescription:
    """``check_config``, then the tokenizer and the prompt set read once, so that a missing
    folder, a malformed line or a missing key fails before any worker starts."""
    check_config(cfg)
    load_prompts(cfg["init_params"], load_tokenizer(cfg["init_params"]))
    return EnvDescription()  # prompts have no enumerated reset-state names


def check_config(cfg: Mapping[str, Any]) -> None:
    """The env keys a text env cannot honour, refused in the driver before any worker starts."""
    if cfg.get("each_reset_state_once"):
        raise EnvSetupError("each_reset_state_once: not supported by the text env, because an eval "
                            "already answers each of its total_num_envs prompts once")
    if cfg.get("num_processes") is not None:
        raise EnvSetupError("num_processes: not supported by the text env, because it runs no "
                            "simulator processes")
    if cfg.get("reset_state_order", "shuffled") != "shuffled":
        raise EnvSetupError("reset_state_order: not supported by the text env, because its prompts' order is "
                            "init_params.shuffle")
    if cfg.get("task_suite_name") is not None:
        raise EnvSetupError("task_suite_name: not supported by the text env, because its prompts come "
                            "from init_params.data_paths")
    for key, wanted in (("max_episode_steps", 1), ("auto_reset", False), ("ignore_terminations", False),
                        ("use_rel_reward", False)):
        if cfg[key] != wanted:
            raise EnvSetupError(f"{key}={cfg[key]!r}: the text env needs {wanted} (one response per episode)")
    if cfg["video_cfg"]["save_video"]:
        raise EnvSetupError("video_cfg.save_video: the text env has no frames to record")


class TextEnv:
    """``num_envs`` single-step envs over a prompt set; the env protocol (``envs/protocol.py``)."""

    rounds = 1  # an eval validates its total_num_envs prompts in one episode (no each_reset_state_once)

    def __init__(self, cfg: Mapping[str, Any], num_envs: int, seed_offset: int = 0):
        options = read_options(cfg, num_envs, seed_offset)
        try:
            check_config(cfg)
        except EnvSetupError as err:
            raise EnvSetupError(f"env.*.{err}") from None
        params = cfg["init_params"]
        self.tokenizer = load_tokenizer(params)
        self.prompts, self.filtered = load_prompts(params, self.tokenizer)
        self.num_envs = num_envs
        self.max_prompt_length = int(params["max_prompt_length"])
        self.reward = float(params["reward_scale"]) * float(options["reward_coef"])
        unit = options["group_size"] if options["use_fixed_reset_state_ids"] else 1
        self.streams = (seed_offset + np.arange(num_envs)) // unit
        self.pass_at_group = bool(params["pass_at_group"])
        if self.pass_at_group and unit == 1:  # (read_options keeps groups whole within a stage)
            raise EnvSetupError("env.*.init_params.pass_at_group needs groups: group_size > 1 with "
                                "use_fixed_reset_state_ids")
        self.states = ResetStates(len(self.prompts), int(cfg["total_num_envs"]) // unit, int(options["seed"]),
                                  order="shuffled" if params["shuffle"] else "ordered")
        eos = params.get("eos_token_id")  # rollout.eos: where the policy stops, where responses end
        self.eos = self.tokenizer.eos_token_id if eos is None else int(eos)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
        self._episode = np.full(num_envs, -1, np.int64)
        self._current: list[Prompt] = []
        self._stepped = False
        self._counts = {UNPARSABLE: 0, TIMEOUT: 0}
        self._samples: list[dict[str, Any]] = []

    @property
    def task_descriptions(self) -> list[str]:
        return [p.source for p in self._current]

    def reset(self, reset_state_ids: np.ndarray | list[int] | None = None) -> dict[str, Any]:
        """The next prompt of every env (``reset_state_ids``: prompt indices, if given)."""
        self._episode += 1
        if reset_state_ids is None:
            reset_state_ids, _ = self.states.ids(self.streams, self._episode)
        self._current = [self.prompts[int(i)] for i in reset_state_ids]
        self._stepped = False
        return self._observation()

    def _observation(self) -> dict[str, Any]:
        ids, mask = left_padded([p.ids for p in self._current], self.max_prompt_length, self.pad)
        return {"input_ids": ids, "attention_mask": mask, "prompts": [p.text for p in self._current],
                "task_descriptions": self.task_descriptions}

    def responses(self, actions: np.ndarray) -> tuple[list[str], np.ndarray]:
        """Decoded responses and their lengths in tokens (EOS included)."""
        texts, lengths = [], np.zeros(self.num_envs, np.int32)
        for row, seq in enumerate(np.asarray(actions).reshape(self.num_envs, -1)):
            response, _, text = read_response(seq, self.eos, self.tokenizer)
            lengths[row] = len(response)
            texts.append(text)
        return texts, lengths

    def chunk_step(self, actions: np.ndarray):
        """Score the responses ``actions[B, 1, L]`` (token ids, then EOS or ``NO_TOKEN``); ends every episode."""
        if not self._current:
            raise RuntimeError("chunk_step before reset(): call reset() first")
        actions = token_actions(actions, self.num_envs)
        done = np.full(self.num_envs, not self._stepped)
        texts, lengths = self.responses(actions)
        verdicts = shared_verifier().score(texts, [p.answer for p in self._current])
        correct = np.asarray(verdicts.correct) & done
        rewards = np.where(correct, self.reward, -self.reward).astype(np.float32) * done
        solved = correct
        if self.pass_at_group:  # pass@k: some response of the group (its stream) is verified
            _, group = np.unique(self.streams, return_inverse=True)
            solved = np.bincount(group, weights=correct)[group] > 0
        if not self._stepped:
            for status in self._counts:
                self._counts[status] += verdicts.count(status)
            self._samples = [{"prompt": p.text, "response": t, "answer": p.answer, "reward": float(r)}
                             for p, t, r in list(zip(self._current, texts, rewards))[:SAMPLES_KEPT]]
        self._stepped = True
        infos = {"success": correct, "success_once": solved, "episode_return": rewards,
                 "episode_length": lengths, "done": done, "task_descriptions": self.task_descriptions}
        terminations = done[:, None].copy()
        return self._observation(), rewards[:, None], terminations, np.zeros_like(terminations), infos

    def pop_metrics(self) -> dict[str, float]:
        """Counts since the last call: unparsable responses, verifier timeouts; and the prompts
        dropped for length (a constant of the data)."""
        counts = {"unparsable": float(self._counts[UNPARSABLE]), "verifier_timeout": float(self._counts[TIMEOUT]),
                  "prompts_filtered": float(self.filtered)}
        self._counts = {UNPARSABLE: 0, TIMEOUT: 0}
        return counts

    def pop_samples(self) -> list[dict[str, Any]]:
        samples, self._samples = self._samples, []
        return samples

    def next_episodes(self) -> np.ndarray:
        return self._episode + 1 - (not self._stepped and bool(self._current))

    def set_next_episodes(self, numbers: np.ndarray | list[int]) -> None:
        numbers = np.asarray(numbers, np.int64)
        if numbers.shape != (self.num_envs,) or numbers.min() < 0:
            raise ValueError(f"next episodes: expected {self.num_envs} integers >= 0, got {numbers!r}")
        self._episode[:] = numbers - 1
        self._current = []

    def flush(self) -> None:
        """Nothing is being written (no videos)."""

    def close(self) -> None:
        """The scoring pool is shared by the process's envs and ends with it."""
