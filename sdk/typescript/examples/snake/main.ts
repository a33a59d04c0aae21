// Snake as a game that owns its loop and trains through GameLink: B boards in one process are B
// agents of one link. Each tick it sends every board's observation, reward and end flags, and
// applies the actions the run's policy chose.
//
//   node dist/examples/snake/main.js --boards 8              # inside `rlfleet up` (address from
//                                                            # RLFLEET_GAME_LINK_ADDRESS)
//   node dist/examples/snake/main.js --policy random --episodes 2000   # a random baseline, no server
//
// Prints a score summary line (score = food eaten in an episode) every --report-s seconds and
// when it stops (after --episodes episodes, or on SIGTERM/SIGINT, after saying Goodbye).
import { parseArgs } from "node:util";

import { GameLink, LinkClosedError, ReplyLostError, type Tensor, spaces } from "../../src/index.js";
import { NUM_ACTIONS, OBSERVATION_SIZE, Snake, rng } from "./game.js";

const { values: args } = parseArgs({
  options: {
    boards: { type: "string", default: "8" },
    size: { type: "string", default: "10" },
    "max-steps": { type: "string", default: "1000" },
    seed: { type: "string" },
    episodes: { type: "string", default: "0" }, // stop after this many (0: run until stopped)
    policy: { type: "string", default: "link" }, // link | random (local, no server)
    address: { type: "string" },
    "report-s": { type: "string", default: "10" },
    window: { type: "string", default: "100" }, // episodes in the mean score
  },
});

function integer(name: keyof typeof args, min: number): number {
  const value = Number(args[name]);
  if (!Number.isInteger(value) || value < min) {
    console.error(`snake-ts: --${name} must be an integer >= ${min}, got ${args[name]}`);
    process.exit(2);
  }
  return value;
}

const numBoards = integer("boards", 1);
const maxEpisodes = integer("episodes", 0);
const window = integer("window", 1);
const reportMs = Number(args["report-s"]) * 1000;
const random = rng(args.seed === undefined ? Date.now() : integer("seed", 0));
const boards = Array.from(
  { length: numBoards },
  () => new Snake(random, { size: integer("size", 5), maxSteps: integer("max-steps", 1) }),
);
if (args.policy !== "link" && args.policy !== "random") {
  console.error(`snake-ts: --policy must be link or random, got ${args.policy}`);
  process.exit(2);
}

// --- scores -------------------------------------------------------------------------------------

const recent: number[] = [];
let episodes = 0;
let best = 0;
let ticks = 0;
const started = Date.now();
let policyVersion = 0;

function finished(score: number): void {
  episodes++;
  best = Math.max(best, score);
  recent.push(score);
  if (recent.length > window) recent.shift();
}

function summary(): string {
  const mean = recent.length ? recent.reduce((a, b) => a + b, 0) / recent.length : 0;
  const seconds = (Date.now() - started) / 1000;
  return (
    `snake-ts: episodes ${episodes} mean score ${mean.toFixed(2)} (last ${recent.length}) best ${best} ` +
    `ticks ${ticks} ticks/s ${(ticks / seconds).toFixed(0)} policy v${policyVersion} time ${seconds.toFixed(0)}s`
  );
}

// --- the loop -----------------------------------------------------------------------------------

let stopping = false;
for (const signal of ["SIGTERM", "SIGINT"] as const) process.on(signal, () => (stopping = true));

const observations = new Float32Array(numBoards * OBSERVATION_SIZE);
const rewards = new Float32Array(numBoards);
const terminated = new Uint8Array(numBoards);
const truncated = new Uint8Array(numBoards);
const episodeIds = new BigInt64Array(numBoards); // a counter per board
const actions = new Array<number>(numBoards).fill(0);

const link =
  args.policy === "link"
    ? new GameLink({
        address: args.address,
        game: "snake-ts",
        envId: "SnakeTS-v0",
        observationSpace: spaces.box(0, 1, [OBSERVATION_SIZE]),
        actionSpace: spaces.discrete(NUM_ACTIONS),
        numAgents: numBoards,
        labels: { boards: String(numBoards), size: args.size! },
      })
    : undefined;

async function chooseActions(): Promise<void> {
  if (link === undefined) {
    for (let i = 0; i < numBoards; i++) actions[i] = Math.floor(random() * NUM_ACTIONS);
    return;
  }
  try {
    const chosen = (await link.act({ observations, rewards, terminated, truncated, episodeIds })) as Tensor;
    for (let i = 0; i < numBoards; i++) actions[i] = chosen.get(i);
    policyVersion = link.policyVersion;
  } catch (error) {
    // The answer went down with a broken connection (the link has reconnected): go straight on.
    if (!(error instanceof ReplyLostError)) throw error;
    actions.fill(0);
  }
}

async function main(): Promise<void> {
  if (link !== undefined) {
    const welcome = await link.connect();
    console.log(
      `snake-ts: link ${welcome.linkId} to run ${welcome.run || "?"}, ${numBoards} boards, policy v${welcome.policyVersion}`,
    );
  }
  let lastReport = Date.now();
  while (!stopping && (maxEpisodes === 0 || episodes < maxEpisodes)) {
    boards.forEach((board, i) => board.observe(observations, i * OBSERVATION_SIZE));
    await chooseActions();
    ticks++;
    for (let i = 0; i < numBoards; i++) {
      const board = boards[i];
      if (terminated[i] || truncated[i]) {
        // That row was the episode's last; its action is ignored. The next row starts afresh.
        finished(board.score);
        board.reset();
        episodeIds[i]++;
        rewards[i] = 0;
        terminated[i] = truncated[i] = 0;
        continue;
      }
      const result = board.step(actions[i]);
      rewards[i] = result.reward;
      terminated[i] = result.terminated ? 1 : 0;
      truncated[i] = result.truncated && !result.terminated ? 1 : 0;
    }
    if (Date.now() - lastReport >= reportMs) {
      console.log(summary());
      lastReport = Date.now();
    }
    if (link === undefined && ticks % 1000 === 0) await new Promise(setImmediate); // let signals in
  }
  console.log(summary());
  if (link !== undefined) {
    const farewell = await Promise.race([
      link.close(stopping ? "stopped" : "episodes done"),
      new Promise<undefined>((resolve) => setTimeout(() => resolve(undefined), 5000).unref()),
    ]);
    if (farewell)
      console.log(
        `snake-ts: farewell: the link answered ${farewell.ticks} ticks, ended ${farewell.episodes} episodes`,
      );
  }
}

main().then(
  () => process.exit(0),
  (error) => {
    console.error(
      `snake-ts: ${error instanceof LinkClosedError ? "link lost" : "failed"}: ${error instanceof Error ? error.message : error}`,
    );
    process.exit(1);
  },
);
