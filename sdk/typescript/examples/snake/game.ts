// Snake on a square grid: the rules and the 11 observation features of the built-in Snake-v0
// (env_server/envs/snake.py), so scores and policies compare.
//
// The snake (3 cells) starts in the middle heading a random way. Each step it moves one cell
// straight on, or after turning right or left (actions 0, 1, 2, relative to its heading). Food
// (+1) grows it by one cell and reappears on a free cell chosen uniformly. Running into a wall or
// into its own body ends the episode, terminated (-1); the cell the tail is leaving is free.
// `maxHunger` steps without food (default: the number of cells) or `maxSteps` steps in all end
// it, truncated, so no agent circles forever. Filling the board ends it, terminated.
//
// Observation, 11 numbers in {0, 1}: [0:3] danger straight on / right / left (a wall or the
// body one cell away), [3:7] heading one-hot (up, right, down, left), [7:11] the food is up /
// right / down / left of the head (board directions; two can be set).

export const OBSERVATION_SIZE = 11;
export const NUM_ACTIONS = 3;

// Headings as [row, col] steps, clockwise from up: turning right is +1, left is -1.
const STEPS: readonly (readonly [number, number])[] = [
  [-1, 0],
  [0, 1],
  [1, 0],
  [0, -1],
];
const TURN = [0, 1, -1]; // action -> heading change: straight, right, left

/** Small seedable PRNG (mulberry32): boards replay exactly for a given seed. */
export function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

export interface SnakeOptions {
  size?: number;
  initialLength?: number;
  maxHunger?: number;
  maxSteps?: number;
}

export interface StepResult {
  reward: number;
  terminated: boolean;
  truncated: boolean;
}

export class Snake {
  readonly size: number;
  private readonly initialLength: number;
  private readonly maxHunger: number;
  private readonly maxSteps: number;
  private readonly random: () => number;
  /** Cells as row * size + col, head first. */
  private body: number[] = [];
  private occupied: Uint8Array;
  private heading = 0;
  private food = -1;
  score = 0;
  steps = 0;
  private hunger = 0;

  constructor(
    random: () => number,
    { size = 10, initialLength = 3, maxHunger, maxSteps = 1000 }: SnakeOptions = {},
  ) {
    if (!(size >= 5 && size <= 64)) throw new Error(`size must be in 5..64, got ${size}`);
    this.size = size;
    this.initialLength = initialLength;
    this.maxHunger = maxHunger ?? size * size;
    this.maxSteps = maxSteps;
    this.random = random;
    this.occupied = new Uint8Array(size * size);
    this.reset();
  }

  reset(): void {
    this.heading = Math.floor(this.random() * 4);
    const middle = Math.floor(this.size / 2);
    const [backR, backC] = STEPS[(this.heading + 2) % 4];
    this.occupied.fill(0);
    this.body = [];
    for (let i = 0; i < this.initialLength; i++) {
      const cell = (middle + i * backR) * this.size + (middle + i * backC);
      this.body.push(cell);
      this.occupied[cell] = 1;
    }
    this.score = 0;
    this.steps = 0;
    this.hunger = 0;
    this.placeFood();
  }

  step(action: number): StepResult {
    if (!(action === 0 || action === 1 || action === 2)) {
      throw new Error(`action must be 0 (straight), 1 (right) or 2 (left), got ${action}`);
    }
    this.steps++;
    this.heading = (this.heading + TURN[action] + 4) % 4;
    const head = this.ahead(this.heading);
    if (head < 0 || this.deadly(head)) return { reward: -1, terminated: true, truncated: false };
    if (head === this.food) {
      this.body.unshift(head);
      this.occupied[head] = 1;
      this.score++;
      this.hunger = 0;
      this.placeFood();
      const full = this.food < 0; // nothing left to eat
      return { reward: 1, terminated: full, truncated: !full && this.steps >= this.maxSteps };
    }
    this.occupied[this.body.pop()!] = 0; // first: the head may move into the tail's old cell
    this.body.unshift(head);
    this.occupied[head] = 1;
    this.hunger++;
    return {
      reward: 0,
      terminated: false,
      truncated: this.hunger >= this.maxHunger || this.steps >= this.maxSteps,
    };
  }

  /** The 11 features (see the top of this file) into `out` at `offset`. */
  observe(out: Float32Array, offset = 0): void {
    out.fill(0, offset, offset + OBSERVATION_SIZE);
    for (let i = 0; i < 3; i++) {
      const cell = this.ahead((this.heading + TURN[i] + 4) % 4);
      out[offset + i] = cell < 0 || this.deadly(cell) ? 1 : 0;
    }
    out[offset + 3 + this.heading] = 1;
    if (this.food >= 0) {
      const [hr, hc] = this.rowCol(this.body[0]);
      const [fr, fc] = this.rowCol(this.food);
      out[offset + 7] = fr < hr ? 1 : 0;
      out[offset + 8] = fc > hc ? 1 : 0;
      out[offset + 9] = fr > hr ? 1 : 0;
      out[offset + 10] = fc < hc ? 1 : 0;
    }
  }

  /** The board as text (# body, @ head, * food), for a look at a game. */
  render(): string {
    const rows: string[] = [];
    for (let r = 0; r < this.size; r++) {
      let row = "";
      for (let c = 0; c < this.size; c++) {
        const cell = r * this.size + c;
        row += cell === this.body[0] ? "@" : this.occupied[cell] ? "#" : cell === this.food ? "*" : ".";
      }
      rows.push(row);
    }
    return rows.join("\n");
  }

  private rowCol(cell: number): [number, number] {
    return [Math.floor(cell / this.size), cell % this.size];
  }

  /** The cell one step along `heading` from the head, or -1 past a wall. */
  private ahead(heading: number): number {
    const [r, c] = this.rowCol(this.body[0]);
    const [dr, dc] = STEPS[heading];
    const nr = r + dr;
    const nc = c + dc;
    return nr >= 0 && nr < this.size && nc >= 0 && nc < this.size ? nr * this.size + nc : -1;
  }

  /** The body except the tail tip (it moves away: food is never under it). */
  private deadly(cell: number): boolean {
    return this.occupied[cell] === 1 && cell !== this.body[this.body.length - 1];
  }

  private placeFood(): void {
    const free = this.size * this.size - this.body.length;
    if (free === 0) {
      this.food = -1;
      return;
    }
    let k = Math.floor(this.random() * free);
    for (let cell = 0; cell < this.occupied.length; cell++) {
      if (this.occupied[cell]) continue;
      if (k-- === 0) {
        this.food = cell;
        return;
      }
    }
  }
}
