// The Snake example's rules and observation (those of the built-in Snake-v0), no server needed.
import assert from "node:assert/strict";
import { test } from "node:test";

import { OBSERVATION_SIZE, Snake } from "../examples/snake/game.js";

const STRAIGHT = 0;
const RIGHT = 1;
const LEFT = 2;

// random() = 0: the snake heads up from the middle, (5,5) (6,5) (7,5); food on the first free cell.
function snake(options = {}): Snake {
  return new Snake(() => 0, options);
}

function features(game: Snake): number[] {
  const out = new Float32Array(OBSERVATION_SIZE);
  game.observe(out);
  return Array.from(out);
}

test("the observation: danger straight/right/left, heading, food direction", () => {
  const game = snake();
  // No danger; heading up; food at (0,0): up and to the left of the head.
  assert.deepEqual(features(game), [0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1]);
  for (let i = 0; i < 5; i++) game.step(STRAIGHT); // head at (0,5), the wall straight ahead
  assert.deepEqual(features(game).slice(0, 3), [1, 0, 0]);
});

test("a wall ends the episode, terminated, with -1", () => {
  const game = snake();
  for (let i = 0; i < 5; i++)
    assert.deepEqual(game.step(STRAIGHT), { reward: 0, terminated: false, truncated: false });
  assert.deepEqual(game.step(STRAIGHT), { reward: -1, terminated: true, truncated: false });
});

function eatFirstFood(game: Snake): void {
  for (let i = 0; i < 5; i++) game.step(STRAIGHT);
  game.step(LEFT); // heading left, (0,4)
  for (let i = 0; i < 3; i++) game.step(STRAIGHT); // (0,1)
  assert.deepEqual(game.step(STRAIGHT), { reward: 1, terminated: false, truncated: false }); // eats at (0,0)
  assert.equal(game.score, 1); // length 4: (0,0) (0,1) (0,2) (0,3); the next food at (0,4)
}

test("food gives +1 and grows the snake; the head may follow its tail round a loop", () => {
  const game = snake();
  eatFirstFood(game);
  // Turning left again and again runs a 2x2 loop: each move enters the cell the tail leaves.
  for (let i = 0; i < 8; i++)
    assert.deepEqual(game.step(LEFT), { reward: 0, terminated: false, truncated: false });
});

test("running into the body ends the episode, terminated, with -1", () => {
  const game = snake();
  eatFirstFood(game);
  game.step(LEFT); // down, (1,0)
  game.step(LEFT); // right, (1,1)
  for (let i = 0; i < 3; i++) game.step(STRAIGHT); // (1,4)
  assert.equal(game.step(LEFT).reward, 1); // up: eats at (0,4), length 5
  assert.equal(game.step(LEFT).reward, 0); // left, (0,3)
  assert.deepEqual(game.step(LEFT), { reward: -1, terminated: true, truncated: false }); // down: (1,3) is body
});

test("step limits truncate: steps in all, and steps without food", () => {
  const capped = snake({ maxSteps: 2 });
  assert.equal(capped.step(STRAIGHT).truncated, false);
  assert.deepEqual(capped.step(RIGHT), { reward: 0, terminated: false, truncated: true });
  const hungry = snake({ maxHunger: 3 });
  hungry.step(STRAIGHT);
  hungry.step(STRAIGHT);
  assert.equal(hungry.step(STRAIGHT).truncated, true);
  hungry.reset();
  assert.equal(hungry.score, 0);
  assert.equal(hungry.step(STRAIGHT).truncated, false);
});

test("actions other than 0, 1, 2 are refused", () => {
  assert.throws(() => snake().step(3), /action must be 0 \(straight\), 1 \(right\) or 2 \(left\), got 3/);
});
