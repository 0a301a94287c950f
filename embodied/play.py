"""Play an agent env with no model: scripted responses, each turn printed with its token ids,
which of them the policy generated (the loss mask), the reward and whether the episode ended.
For trying a new game, its tools and its dataset on a CPU before training on it.

    python -m embodied.play --config-name agent_arithmetic_tools_tiny --responses turns.json \\
        data.train_data_paths=[rows.jsonl] actor.model.model_path=MODEL [--split train] [--envs 2]

``turns.json`` holds one entry per turn: a string (every env sends it) or a list of strings (one
per env, cycled). The last line printed is JSON: each env's return, turns and end, and the env's
counters (tool calls, timeouts, errors, drift, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from core.errors import ConfigError


def play(env, turns: list[str | list[str]], out=sys.stdout) -> dict:
    """Feed ``turns`` to ``env`` (an ``AgentEnv`` after ``reset``), printing each turn."""
    tok = env.tokenizer
    width = 1
    for turn, texts in enumerate(turns, 1):
        texts = [texts] * env.num_envs if isinstance(texts, str) else [texts[i % len(texts)] for i in range(env.num_envs)]
        ids = [tok(t, add_special_tokens=False)["input_ids"] + [env.eos] for t in texts]
        width = max(width, *map(len, ids))
        actions = np.full((env.num_envs, 1, width), env.pad, np.int64)
        for i, row in enumerate(ids):
            actions[i, 0, :len(row)] = row
        before = [len(e.ids) for e in env.episodes]
        was_done = [e.done for e in env.episodes]
        _, rewards, terminated, truncated, _ = env.chunk_step(actions)
        for i, episode in enumerate(env.episodes):
            if was_done[i]:
                continue
            new, mask = episode.ids[before[i]:], episode.generated[before[i]:]
            print(f"turn {turn} env {i}: reward {rewards[i, 0]:g} terminated {bool(terminated[i, 0])} "
                  f"truncated {bool(truncated[i, 0])}", file=out)
            print(f"  ids  {new}", file=out)
            print(f"  mask {mask}", file=out)
            print(f"  text {tok.decode(new)!r}", file=out)
        if all(e.done for e in env.episodes):
            break
    return {"returns": [e.returns for e in env.episodes], "turns": [e.turns for e in env.episodes],
            "done": [e.done for e in env.episodes], "metrics": env.pop_metrics()}


def main(argv: list[str] | None = None) -> int:
    from embodied.config import compose
    from envs.agent import AgentEnv

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-name", required=True)
    parser.add_argument("--config-path", default=None)
    parser.add_argument("--responses", required=True, type=Path, help="JSON list of turns")
    parser.add_argument("--split", default="train")
    parser.add_argument("--envs", type=int, default=1, help="envs to play, one row each")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        cfg = compose(args.config_name, args.overrides, args.config_path)
        env_cfg = OmegaConf.to_container(cfg.env[args.split], resolve=True)
        if env_cfg.get("env_type") != "agent":
            raise ConfigError(f"env.{args.split}.env_type = {env_cfg.get('env_type')!r}: expected agent")
        try:
            turns = json.loads(args.responses.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{args.responses}: not JSON ({err})") from None
        if not isinstance(turns, list):
            raise ConfigError(f"{args.responses}: expected a JSON list of turns")
        env_cfg |= {"total_num_envs": args.envs, "group_size": 1, "use_fixed_reset_state_ids": False}
        env = AgentEnv(env_cfg, args.envs)
    except (ConfigError, OSError) as err:
        print(f"play: {err}", file=sys.stderr)
        return 2
    try:
        env.reset()
        print(json.dumps(play(env, turns)))
    finally:
        env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
