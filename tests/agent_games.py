"""Games for the agent pipeline's tests, loaded by the env workers as ``tests.agent_games:<Class>``."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from envs.games import Game


class Pause(Game):
    """Answers every response with "go on", the first one after ``pause_s`` seconds (the row's
    extra: a slow tool for some rows, none for others), and logs each answer (row, turn, when) to
    ``game_config.log``."""

    def step(self, action: str) -> dict[str, Any]:
        self.turns += 1
        if self.turns == 1:
            time.sleep(float(self.extras["pause_s"]))
        line = json.dumps({"row": self.extras["row"], "turn": self.turns, "at": time.time()}) + "\n"
        fd = os.open(self.config["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line.encode())  # one write per line: the games of several threads append at once
        finally:
            os.close(fd)
        return {"observations": [{"role": "user", "content": "go on"}], "reward": 0.0, "done": False, "metadata": {}}
