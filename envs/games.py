"""Our own multi-turn games for the agent env (``envs/agent.py``), written to skyrl-gym's
``BaseTextEnv`` contract so that they and skyrl-gym's envs are interchangeable.

- ``arithmetic_tools``: a math prompt (``prompt`` / ``answer``, or SkyRL's
  ``reward_spec.ground_truth``) that the model may work out with a tool (``envs/tools.py``: the
  calculator, the sandboxed Python) before answering. A response calling a tool gets the tool's
  output as the next observation; a response without a call is the answer, verified by
  math-verify: reward 1 and done when right, 0 and done when wrong.
- ``frozen_lake``: gymnasium's FrozenLake (4x4, not slippery, a map per row's ``seed``) drawn as
  text; each response names a move (left, down, right, up); reward 1 on reaching the goal, done
  on the goal or a hole. A response naming no move wastes its turn.
"""

from __future__ import annotations

import re
from typing import Any

from core.registry import Registry
from envs.tools import ToolRunner, tools_named

GAMES = Registry("game", "env.*.init_params.game")


class Game:
    """The skyrl-gym ``BaseTextEnv`` surface, for games that need not install skyrl-gym."""

    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None):
        self.config, self.extras = dict(env_config or {}), dict(extras or {})
        self.turns = 0

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        return prompt, {}

    def close(self) -> None:
        pass

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns}

    @staticmethod
    def aggregate_metrics(metrics: list[dict[str, Any]]) -> dict[str, Any]:
        numeric = {k for m in metrics for k, v in m.items() if isinstance(v, (int, float))}
        return {k: sum(float(m.get(k, 0)) for m in metrics) / len(metrics) for k in numeric} if metrics else {}


@GAMES.register("arithmetic_tools")
class ArithmeticTools(Game):
    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None):
        super().__init__(env_config, extras)
        spec = self.extras.get("reward_spec") or {}
        answer = self.extras.get("answer", spec.get("ground_truth"))
        if answer is None:
            raise KeyError("the row has neither 'answer' nor 'reward_spec.ground_truth'")
        self.answer = str(answer)
        config = self.config
        self.tools = ToolRunner(tools_named(list(config["tools"]), "env.*.init_params.tools"),
                                float(config["tool_timeout_s"]), int(config["max_tool_response_length"]),
                                config["tool_response_truncate_side"])
        self.used_tool = False

    def step(self, action: str) -> dict[str, Any]:
        self.turns += 1
        output = self.tools(action)
        if output is not None:
            self.used_tool = True
            shown = self.config["tool_output_format"].format(output.text)
            return {"observations": [{"role": "tool", "content": shown}],
                    "reward": 0.0, "done": False, "metadata": {"tool_status": output.status}}
        from envs.text import shared_verifier

        correct = bool(shared_verifier().score([action], [self.answer]).correct[0])
        return {"observations": [], "reward": float(correct), "done": True, "metadata": {}}

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns, "used_tool": float(self.used_tool)}


MOVES = {"left": 0, "down": 1, "right": 2, "up": 3}
_MOVE = re.compile(r"\b(left|down|right|up)\b", re.I)


@GAMES.register("frozen_lake")
class FrozenLake(Game):
    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None):
        super().__init__(env_config, extras)
        import gymnasium
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        seed = int(self.extras.get("seed", 0))
        self.env = gymnasium.make("FrozenLake-v1", desc=generate_random_map(size=4, seed=seed), is_slippery=False)
        self.state, _ = self.env.reset(seed=seed)

    def board(self) -> str:
        rows = [list(r) for r in self.env.unwrapped.desc.astype(str)]
        rows[self.state // 4][self.state % 4] = "P"
        return "\n".join("".join(r) for r in rows)

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        last = dict(prompt[-1])
        last["content"] = f"{last['content']}\n{self.board()}\n"
        return [*prompt[:-1], last], {}

    def step(self, action: str) -> dict[str, Any]:
        self.turns += 1
        move = _MOVE.search(action)
        reward, done = 0.0, False
        if move:
            self.state, reward, done, _, _ = self.env.step(MOVES[move.group(1).lower()])
        note = "" if move else "no move named (left, down, right, up)\n"
        return {"observations": [] if done else [{"role": "user", "content": f"{note}{self.board()}\n"}],
                "reward": float(reward), "done": bool(done), "metadata": {}}

    def close(self) -> None:
        self.env.close()
