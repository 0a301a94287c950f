"""Multi-turn text episodes (``env_type: agent``): a game answers each response with the next
observation, a reward and done, and the episode keeps one token sequence.

The games are skyrl-gym's ``BaseTextEnv`` contract, so skyrl-gym's envs run unchanged:
``cls(env_config=..., extras=row)``, ``init(prompt messages) -> (messages, metadata)``,
``step(text) -> {"observations": messages, "reward", "done", "metadata"}``, ``get_metrics()``,
``aggregate_metrics(list)`` and ``close()``. ``init_params.game`` (or a row's ``env_class``) names
one: an id of ours (``envs/games.py``), a skyrl-gym id, or ``module:Class``.

One step of this env is one turn. Its observation is the whole conversation so far, left-padded
to ``max_prompt_length`` tokens (the total context); its action is the turn's response ids.
Token-in, token-out: the response ids are appended verbatim (never decoded and re-encoded), the
observation ids come from the chat template applied to the new messages alone, sliced off a
fixed base conversation (with ``use_conversation_multi_turn: false``, SkyRL's single-message layout,
from the observation text as is). So observation tokens only ever sit in the context of later
turns, never in a turn's action, and never train. A response ends at EOS, at a stop string
(``algorithm.sampling_params.stop``, e.g. a tool call's closing tag: the rollout sends ``NO_TOKEN``
after it) or at the length limit; without EOS, the env closes the assistant message as the
template does (EOS and what follows it, added as observation ids, never trained). A turn's reward
is that step's reward (on its last generated token, at the token level); an outcome-only game
rewards the last turn.

An episode ends when the game says done (terminated), after ``max_turns`` turns, or when the
next observation would overflow the context (both truncated; the latter counted as
``context_truncated``). A game that raises, in its constructor (e.g. a dataset row without the
extras it reads) or in ``step``, ends its episode as failed (reward 0, ``env_errors``); the run
goes on. ``drift_check`` compares, per turn, the ids kept with the template applied to the
decoded conversation: ``strict`` stops at the first differing position, ``warn`` counts
(``drift``), ``off``.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from core.description import EnvDescription
from core.errors import DataError, EnvSetupError
from core.registry import load
from envs.protocol import ResetStates
from envs.text import left_padded, load_tokenizer, read_jsonl, read_response, token_actions
from envs.vector_env import read_options

DRIFT_CHECKS = ("off", "warn", "strict")
SAMPLES_KEPT = 8  # ended episodes kept per rollout for the logs (samples.jsonl)
TOOL_KEYS = ("tools", "tool_timeout_s", "max_tool_response_length", "tool_response_truncate_side", "tool_output_format")
_BASE = [{"role": "user", "content": "x"}]  # the fixed conversation observation ids are sliced off


def read_rows(path: str | Path, prompt_key: str) -> list[dict[str, Any]]:
    """Every row of a JSONL or parquet file, whole (the prompt and the game's extras)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = [(f"{path}: row {n}", r) for n, r in enumerate(pq.read_table(path).to_pylist(), 1)]
    else:
        rows = [(f"{path}:{n}", r) for n, r in read_jsonl(path)]
    for where, row in rows:
        if not isinstance(row, dict) or prompt_key not in row:
            raise DataError(f"{where}: no key {prompt_key!r} (data.prompt_key)")
        prompt = row[prompt_key]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(
                isinstance(m, dict) and "content" in m for m in prompt))):
            raise DataError(f"{where}: {prompt_key!r} is neither a string nor a list of chat messages")
    if not rows:
        raise DataError(f"data file {path} holds no records")
    return [row for _, row in rows]


def game_class(name: str) -> type:
    """The game ``name`` names: ours, skyrl-gym's registered id, or ``module:Class``."""
    from envs.games import GAMES

    if name in GAMES.names():
        return GAMES.get(name)
    if ":" in name:
        try:
            return load(name)
        except (ImportError, AttributeError, ValueError) as err:
            raise EnvSetupError(f"env.*.init_params.game = {name!r}: cannot import it ({err})") from None
    try:
        import skyrl_gym
    except ImportError:
        raise EnvSetupError(f"env.*.init_params.game = {name!r}: not one of ours {GAMES.names()}, and "
                            "skyrl-gym is not installed (pip install skyrl-gym) to look it up") from None
    if name not in skyrl_gym.envs.registration.registry:
        raise EnvSetupError(f"env.*.init_params.game = {name!r}: unknown; ours are {GAMES.names()}, "
                            f"skyrl-gym's {sorted(skyrl_gym.envs.registration.registry)}, or module:Class")
    return load(skyrl_gym.envs.registration.registry[name].entry_point)


class Conversation:
    """Token ids of chat messages, for one tokenizer: the first prompt, and each later
    observation alone (sliced off ``_BASE`` so that the template's separators are right)."""

    def __init__(self, tokenizer, multi_turn: bool, eos: int, template: bool = True):
        self.tokenizer, self.multi_turn, self.eos = tokenizer, multi_turn, eos
        self.templated = bool(tokenizer.chat_template) and template
        if self.templated:
            self.base = self._template(_BASE, False)
            # what the template puts after an assistant's end token, before the next message
            # (e.g. "\n" after <|im_end|>): added after a response that ended with EOS
            answered = self._template(_BASE + [{"role": "assistant", "content": "y"}], False)
            end = max((i for i, t in enumerate(answered) if t == eos), default=len(answered) - 1)
            self.after_eos = answered[end + 1:]
        else:
            self.after_eos = []

    def closing(self, ended: bool) -> list[int]:
        """The ids between a response and the next observation, as the chat template puts them:
        what follows an EOS (e.g. a newline), and the EOS too for a response that ended without
        one (at a stop string or the length limit). The env adds them, so the policy never trains
        on them; without a template, or in SkyRL's single-message layout, there are none."""
        if not (self.multi_turn and self.templated):
            return []
        return self.after_eos if ended else [self.eos, *self.after_eos]

    def _template(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if self.templated:
            return self._template(messages, True)
        return self._plain("".join(m["content"] for m in messages))

    def observation(self, messages: list[dict[str, str]]) -> list[int]:
        if not messages:
            return []
        if not (self.templated and self.multi_turn):
            return self._plain("".join(m["content"] for m in messages))
        full = self._template(_BASE + messages, True)
        if full[:len(self.base)] != self.base:
            raise EnvSetupError("the tokenizer's chat template does not extend a conversation by appending "
                                "tokens; set env.*.init_params.use_conversation_multi_turn: false")
        return full[len(self.base):]

    def _plain(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def retokenized(self, messages: list[dict[str, str]], ended: list[bool]) -> list[int]:
        """The ids the template gives the decoded conversation (the drift check's reference);
        ``ended``: whether each assistant message ended with EOS (without a template, that EOS
        is the turn's only separator)."""
        if self.templated and self.multi_turn:
            return self._template(messages, messages[-1]["role"] != "assistant")
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        ids, answers = self.prompt(messages[:first]), iter(ended)
        for message in messages[first:]:
            ids += self._plain(message["content"])
            if message["role"] == "assistant" and next(answers):
                ids += [self.eos] + (self.after_eos if self.multi_turn else [])
        return ids


class Episode:
    """One env's conversation: its ids, which of them the policy generated, its messages."""

    def __init__(self, game: Any | None, ids: list[int], messages: list[dict[str, str]]):
        self.game, self.ids, self.messages = game, list(ids), list(messages)
        self.generated = [0] * len(ids)
        self.ended: list[bool] = []  # whether each response ended with EOS
        self.turns, self.done, self.returns = 0, False, 0.0

    def add(self, ids: list[int], generated: bool) -> None:
        self.ids += ids
        self.generated += [int(generated)] * len(ids)


class AgentEnv:
    """``num_envs`` multi-turn text envs; the env protocol (``envs/protocol.py``)."""

    rounds = 1

    def __init__(self, cfg: Mapping[str, Any], num_envs: int, seed_offset: int = 0):
        options = read_options(cfg, num_envs, seed_offset)
        check_config(cfg)
        params = cfg["init_params"]
        self.tokenizer = load_tokenizer(params)
        self.width = int(params["max_prompt_length"])
        self.max_turns = int(cfg["max_episode_steps"])
        self.drift_check = params["drift_check"]
        self.game_name = params["game"]
        # what a game is built with: the tool settings, then the game's own options
        self.game_config = OmegaConf.create({**{k: params[k] for k in TOOL_KEYS},
                                             **OmegaConf.to_container(OmegaConf.create(params["game_config"]))})
        self.prompt_key = params["prompt_key"]
        self.rows = [row for path in params["data_paths"] for row in read_rows(path, self.prompt_key)]
        self.num_envs = num_envs
        self.reward_coef = float(options["reward_coef"])
        unit = options["group_size"] if options["use_fixed_reset_state_ids"] else 1
        self.streams = (seed_offset + np.arange(num_envs)) // unit
        self.states = ResetStates(len(self.rows), int(cfg["total_num_envs"]) // unit, int(options["seed"]),
                                  order="shuffled" if params["shuffle"] else "ordered")
        eos = params.get("eos_token_id")
        self.eos = self.tokenizer.eos_token_id if eos is None else int(eos)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
        self.conversation = Conversation(self.tokenizer, bool(params["use_conversation_multi_turn"]), self.eos,
                                         bool(params["apply_chat_template"]))
        self._episode = np.full(num_envs, -1, np.int64)
        self.episodes: list[Episode] = []
        self._counts: dict[str, float] = defaultdict(float)
        self._game_metrics: dict[type, list[dict[str, Any]]] = defaultdict(list)
        self._samples: list[dict[str, Any]] = []
        parallel = params["parallel_turns"]
        if not isinstance(parallel, int) or parallel < 1:
            raise EnvSetupError(f"env.*.init_params.parallel_turns = {parallel!r}: expected an integer >= 1")
        self._pool = ThreadPoolExecutor(min(parallel, num_envs), "agent-turn") if parallel > 1 else None

    @property
    def task_descriptions(self) -> list[str]:
        return [str(row.get("data_source", self.game_name)) for row in self._rows]

    def reset(self, reset_state_ids: np.ndarray | list[int] | None = None) -> dict[str, Any]:
        self._episode += 1
        if reset_state_ids is None:
            reset_state_ids, _ = self.states.ids(self.streams, self._episode)
        self._close_games()
        self._rows = [self.rows[int(i)] for i in reset_state_ids]
        self.episodes = [self._start(row) for row in self._rows]
        return self._observation()

    def _start(self, row: dict[str, Any]) -> Episode:
        prompt = row[self.prompt_key]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        try:
            game = game_class(row.get("env_class") or self.game_name)(
                env_config=self.game_config, extras={k: v for k, v in row.items() if k != self.prompt_key})
            messages, _ = game.init(messages)
        except EnvSetupError:
            raise
        except Exception as err:  # e.g. a row without the extras its game reads
            self._counts["env_errors"] += 1
            self._note_error(row, err)
            return Episode(None, [], messages)
        ids = self.conversation.prompt(messages)
        if len(ids) > self.width:
            self._counts["context_truncated"] += 1
            game.close()
            return Episode(None, ids, messages)
        return Episode(game, ids, messages)

    def _note_error(self, where: dict[str, Any], err: BaseException) -> None:
        if len(self._samples) < SAMPLES_KEPT:
            self._samples.append({"conversation": f"{type(err).__name__}: {err} ({str(where)[:200]})"[:400],
                                  "return": 0.0, "turns": 0, "ids": [], "generated": []})

    def _observation(self) -> dict[str, Any]:
        # (only an ended episode's ids can be longer than the context: their tail is shown)
        ids, mask = left_padded([e.ids for e in self.episodes], self.width, self.pad)
        return {"input_ids": ids, "attention_mask": mask, "task_descriptions": self.task_descriptions}

    def chunk_step(self, actions: np.ndarray):
        """One turn: ``actions[B, 1, L]`` are the responses (token ids, then EOS or ``NO_TOKEN``)."""
        if not self.episodes:
            raise RuntimeError("chunk_step before reset(): call reset() first")
        actions = token_actions(actions, self.num_envs)
        rewards = np.zeros(self.num_envs, np.float32)
        terminated = np.zeros(self.num_envs, bool)
        truncated = np.zeros(self.num_envs, bool)
        turns = []
        for i, (episode, seq) in enumerate(zip(self.episodes, actions[:, 0].astype(np.int64))):
            if not episode.done:
                turns.append((i, episode, *read_response(seq, self.eos, self.tokenizer)))
        for i, episode, response, ended, text in turns:
            episode.add(response, generated=True)
            episode.messages.append({"role": "assistant", "content": text})
            episode.ended.append(ended)
            episode.turns += 1
        self._counts["turns"] += len(turns)
        # the games answer at once (their tool calls overlap), their answers are taken in order
        playing = [(episode.game, text) for _, episode, _, _, text in turns if episode.game is not None]
        answers = iter(self._pool.map(_answer, playing) if self._pool and len(playing) > 1 else map(_answer, playing))
        for i, episode, _, ended, text in turns:
            answer = next(answers) if episode.game is not None else None
            rewards[i], terminated[i], truncated[i] = self._turn(episode, ended, text, answer)
        done = terminated | truncated
        success = done & (rewards > 0)
        infos = {"success": success, "success_once": success,
                 "episode_return": np.array([e.returns for e in self.episodes], np.float32) * done,
                 "episode_length": np.array([e.turns for e in self.episodes], np.int32) * done,
                 "done": done, "task_descriptions": self.task_descriptions}
        return (self._observation(), rewards[:, None], terminated[:, None], truncated[:, None], infos)

    def _turn(self, episode: Episode, ended: bool, text: str,
              answer: tuple[float, bool, list] | BaseException | None) -> tuple[float, bool, bool]:
        """Take the game's ``answer`` to a response (None: no game): ``(reward, terminated, truncated)``."""
        if answer is None:  # its game failed to start, or its prompt overflowed the context
            return self._end(episode, 0.0, terminated=False)
        if isinstance(answer, BaseException):  # the game's bug fails this episode, never the run
            self._counts["env_errors"] += 1
            self._note_error({"turn": episode.turns, "response": text}, answer)
            return self._end(episode, 0.0, terminated=True)
        reward, over, observations = answer
        reward *= self.reward_coef
        episode.returns += reward
        if over:
            return self._end(episode, reward, terminated=True)
        if episode.turns >= self.max_turns:
            return self._end(episode, reward, terminated=False)
        ids = self.conversation.closing(ended) + self.conversation.observation(observations)
        if len(episode.ids) + len(ids) > self.width:
            self._counts["context_truncated"] += 1
            return self._end(episode, reward, terminated=False)
        episode.add(ids, generated=False)
        episode.messages += observations
        self._check_drift(episode)
        return reward, False, False

    def _end(self, episode: Episode, reward: float, terminated: bool) -> tuple[float, bool, bool]:
        episode.done = True
        if len(self._samples) < SAMPLES_KEPT:  # the ids and their mask, for checking them by token
            self._samples.append({"conversation": self.tokenizer.decode(episode.ids), "return": episode.returns,
                                  "turns": episode.turns, "ids": list(episode.ids),
                                  "generated": list(episode.generated)})
        if episode.game is not None:
            try:
                self._game_metrics[type(episode.game)].append(episode.game.get_metrics())
            except Exception:  # metrics are a courtesy of the game
                self._counts["env_errors"] += 1
        return reward, terminated, not terminated

    def _check_drift(self, episode: Episode) -> None:
        if self.drift_check == "off":
            return
        reference = self.conversation.retokenized(episode.messages, episode.ended)
        if reference == episode.ids:
            return
        self._counts["drift"] += 1
        if self.drift_check == "strict":
            at = next((i for i, (a, b) in enumerate(zip(reference, episode.ids)) if a != b),
                      min(len(reference), len(episode.ids)))
            raise EnvSetupError(f"env.*.init_params.drift_check=strict: turn {episode.turns}: the ids kept differ "
                                f"from the chat template of the decoded conversation at position {at} "
                                f"(kept {episode.ids[at:at + 5]}, template {reference[at:at + 5]})")

    def generated_mask(self, env: int) -> list[int]:
        """1 for each id of env ``env``'s conversation the policy generated, 0 for the rest."""
        return list(self.episodes[env].generated)

    def pop_metrics(self) -> dict[str, float]:
        metrics = {k: float(v) for k, v in self._counts.items()}
        self._counts = defaultdict(float)
        for game in self.episodes:
            runner = getattr(game.game, "tools", None)
            if runner is not None and hasattr(runner, "pop_metrics"):
                for key, value in runner.pop_metrics().items():
                    metrics[key] = metrics.get(key, 0.0) + value
        for cls, rows in self._game_metrics.items():  # a game's means, as totals (the worker divides)
            for key, value in cls.aggregate_metrics(rows).items():
                if isinstance(value, (int, float)):
                    metrics[f"game_{key}"] = metrics.get(f"game_{key}", 0.0) + float(value) * len(rows)
        self._game_metrics = defaultdict(list)
        return metrics

    def pop_samples(self) -> list[dict[str, Any]]:
        samples, self._samples = self._samples, []
        return samples

    def next_episodes(self) -> np.ndarray:
        return self._episode + 1 - (bool(self.episodes) and not any(e.turns for e in self.episodes))

    def set_next_episodes(self, numbers: np.ndarray | list[int]) -> None:
        numbers = np.asarray(numbers, np.int64)
        if numbers.shape != (self.num_envs,) or numbers.min() < 0:
            raise ValueError(f"next episodes: expected {self.num_envs} integers >= 0, got {numbers!r}")
        self._episode[:] = numbers - 1
        self._close_games()
        self.episodes = []

    def _close_games(self) -> None:
        for episode in self.episodes:
            if episode.game is not None:
                try:
                    episode.game.close()
                except Exception:
                    self._counts["env_errors"] += 1

    def flush(self) -> None:
        """Nothing is being written (no videos)."""

    def close(self) -> None:
        self._close_games()
        if self._pool is not None:
            self._pool.shutdown()


def _answer(game_and_text: tuple[Any, str]) -> tuple[float, bool, list] | Exception:
    """A game's step on one response: ``(reward, done, observations)``, or what it raised."""
    game, text = game_and_text
    try:
        out = game.step(text)
        return float(out["reward"]), bool(out["done"]), out["observations"] or []
    except Exception as err:
        return err


def check_config(cfg: Mapping[str, Any]) -> None:
    """The env keys an agent env cannot honour, refused before any worker starts."""
    params = cfg["init_params"]
    for key, wanted in (("auto_reset", False), ("use_rel_reward", False), ("each_reset_state_once", False)):
        if bool(cfg.get(key)) != wanted:
            raise EnvSetupError(f"env.*.{key}={cfg.get(key)!r}: the agent env needs {wanted} (one episode per "
                                "env and rollout, max_episode_steps turns at most)")
    if cfg.get("reset_state_order", "shuffled") != "shuffled":
        raise EnvSetupError("env.*.reset_state_order: not supported by the agent env, because its rows' order is "
                            "init_params.shuffle")
    if cfg["video_cfg"]["save_video"]:
        raise EnvSetupError("env.*.video_cfg.save_video: the agent env has no frames to record")
    if params["drift_check"] not in DRIFT_CHECKS:
        raise EnvSetupError(f"env.*.init_params.drift_check={params['drift_check']!r}: expected one of {DRIFT_CHECKS}")
    if not params["data_paths"]:
        raise DataError("no data files: set data.train_data_paths / data.val_data_paths")


def describe(cfg: Mapping[str, Any]) -> EnvDescription:
    """``check_config``, the tokenizer, the data and the game named, so that a missing file or an
    unknown game fails before any worker starts."""
    check_config(cfg)
    params = cfg["init_params"]
    load_tokenizer(params)
    names = {row.get("env_class") or params["game"] for path in params["data_paths"]
             for row in read_rows(path, params["prompt_key"])}
    for name in sorted(names):
        game_class(name)
    return EnvDescription()
