"""``Snake-v0``: the classic game on a square grid, as a gymnasium env.

Rules: the snake (length ``initial_length``, default 3) starts in the middle, heading a random
way. Each step it moves one cell straight on or after turning right or left (the 3 actions:
0 straight, 1 right, 2 left, relative to its heading). Eating the food (+1) grows it by one cell
and puts new food on a free cell chosen uniformly, never under the body. Running into a wall or
into its own body ends the episode, terminated (-1); the cell the tail is leaving is free (food
is never there, so the tail always moves on). ``max_hunger`` steps without food (default:
cells on the board) end it, truncated, so an agent cannot circle forever. Filling the board
ends it, terminated, after the last +1. ``info`` has ``score`` (food eaten) and ``length``.

Observations (``observation=``):
- ``"features"`` (default), 11 float32 in {0, 1}, which a small MLP learns from quickly:
  [0:3] danger straight on / to the right / to the left (a wall or the body one cell away),
  [3:7] heading one-hot (up, right, down, left), [7:11] food is up / right / down / left of the
  head (board directions; two can be set).
- ``"grid"``: float32 planes (size, size, 3) in {0, 1}: body (head included), head, food. The
  learner's MLP flattens it; a uint8 image would go to the Nature CNN, which needs 36+ pixels.

``render_mode="rgb_array"`` draws ``cell_px`` pixels per cell (``rlfleet play --video``).
The TypeScript Snake (sdk/typescript) uses the same rules and features, so scores compare.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Literal

import gymnasium
import numpy as np
from gymnasium import spaces

__all__ = ["SnakeEnv"]

# Headings as (row, col) steps, clockwise from up: turning right is +1, left is -1.
_STEPS = ((-1, 0), (0, 1), (1, 0), (0, -1))
_TURN = (0, 1, -1)  # action -> heading change: straight, right, left
_COLORS = {
    "empty": (20, 20, 20),
    "body": (40, 170, 60),
    "head": (150, 230, 120),
    "food": (220, 50, 40),
}

Cell = tuple[int, int]


class SnakeEnv(gymnasium.Env[np.ndarray, np.int64]):
    """Snake on a ``size`` x ``size`` grid; see the module docstring for rules and spaces."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(
        self,
        size: int = 10,
        *,
        observation: Literal["features", "grid"] = "features",
        initial_length: int = 3,
        max_hunger: int | None = None,
        cell_px: int = 16,
        render_mode: str | None = None,
    ) -> None:
        if not 5 <= size <= 64:
            raise ValueError(f"size must be in 5..64, got {size}")
        if not 1 <= initial_length <= (size + 1) // 2:  # it starts in the middle
            longest = (size + 1) // 2
            raise ValueError(f"initial_length must be in 1..{longest}, got {initial_length}")
        if observation not in ("features", "grid"):
            raise ValueError(f"observation must be 'features' or 'grid', got {observation!r}")
        if max_hunger is not None and max_hunger < 1:
            raise ValueError(f"max_hunger must be >= 1, got {max_hunger}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be 'rgb_array' or None, got {render_mode!r}")
        self.size = size
        self.observation = observation
        self.initial_length = initial_length
        self.max_hunger = max_hunger if max_hunger is not None else size * size
        self.cell_px = cell_px
        self.render_mode = render_mode
        self.action_space = spaces.Discrete(3)
        shape = (11,) if observation == "features" else (size, size, 3)
        self.observation_space = spaces.Box(0.0, 1.0, shape, np.float32)
        self.body: deque[Cell] = deque()  # head first
        self.heading = 0
        self.food: Cell | None = None
        self.score = 0
        self.hunger = 0

    # --- gymnasium API -------------------------------------------------------------------------

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.heading = int(self.np_random.integers(4))
        middle = self.size // 2
        back_r, back_c = _STEPS[(self.heading + 2) % 4]
        self.body = deque(
            (middle + i * back_r, middle + i * back_c) for i in range(self.initial_length)
        )
        self.score = 0
        self.hunger = 0
        self.food = self._place_food()
        return self._observe(), self._info()

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if not self.action_space.contains(action):
            raise ValueError(f"action must be 0 (straight), 1 (right) or 2 (left), got {action!r}")
        self.heading = (self.heading + _TURN[int(action)]) % 4
        head = self._ahead(self.heading)
        if self._deadly(head):
            return self._observe(), -1.0, True, False, self._info()
        self.body.appendleft(head)
        if head == self.food:
            self.score += 1
            self.hunger = 0
            self.food = self._place_food()
            done = self.food is None  # the board is full: nothing left to eat
            return self._observe(), 1.0, done, False, self._info()
        self.body.pop()
        self.hunger += 1
        return self._observe(), 0.0, False, self.hunger >= self.max_hunger, self._info()

    def render(self) -> np.ndarray | None:  # type: ignore[override]
        if self.render_mode != "rgb_array":
            return None
        board = np.empty((self.size, self.size, 3), np.uint8)
        board[:] = _COLORS["empty"]
        for cell in self.body:
            board[cell] = _COLORS["body"]
        if self.body:
            board[self.body[0]] = _COLORS["head"]
        if self.food is not None:
            board[self.food] = _COLORS["food"]
        return np.repeat(np.repeat(board, self.cell_px, axis=0), self.cell_px, axis=1)

    # --- rules ---------------------------------------------------------------------------------

    def _ahead(self, heading: int) -> Cell:
        (r, c), (dr, dc) = self.body[0], _STEPS[heading]
        return r + dr, c + dc

    def _deadly(self, cell: Cell) -> bool:
        """A wall, or the body except the tail tip (it moves away: food is never under it)."""
        r, c = cell
        if not (0 <= r < self.size and 0 <= c < self.size):
            return True
        return cell in list(self.body)[:-1]

    def _place_food(self) -> Cell | None:
        """A free cell chosen uniformly, or None when the body fills the board."""
        occupied = np.zeros((self.size, self.size), bool)
        for cell in self.body:
            occupied[cell] = True
        free = np.flatnonzero(~occupied)
        if free.size == 0:
            return None
        r, c = divmod(int(self.np_random.choice(free)), self.size)
        return r, c

    def _observe(self) -> np.ndarray:
        if self.observation == "grid":
            grid = np.zeros((self.size, self.size, 3), np.float32)
            for cell in self.body:
                grid[(*cell, 0)] = 1.0
            grid[(*self.body[0], 1)] = 1.0
            if self.food is not None:
                grid[(*self.food, 2)] = 1.0
            return grid
        features = np.zeros(11, np.float32)
        for i, turn in enumerate(_TURN):
            features[i] = self._deadly(self._ahead((self.heading + turn) % 4))
        features[3 + self.heading] = 1.0
        if self.food is not None:
            (hr, hc), (fr, fc) = self.body[0], self.food
            features[7:11] = (fr < hr, fc > hc, fr > hr, fc < hc)
        return features

    def _info(self) -> dict[str, Any]:
        return {"score": self.score, "length": len(self.body)}
