// The plain data a GameLink takes and gives: its options, one tick's step, the replies, the
// Welcome and the Farewell.
import type * as grpc from "@grpc/grpc-js";

import type { Space } from "./space.js";
import type { Tree } from "./tensor.js";

/** The protocol version this SDK speaks. */
export const PROTOCOL_VERSION = 1;

export interface GameLinkOptions {
  /** host:port of the env server; default: the RLFLEET_GAME_LINK_ADDRESS environment variable. */
  address?: string;
  /** Name of the game for logs and dashboards. */
  game: string;
  /** Environment id the game offers, e.g. "SnakeTS-v0". */
  envId: string;
  /** Observation space of ONE agent (see `spaces`). */
  observationSpace: Space;
  /** Action space of ONE agent. */
  actionSpace: Space;
  /** Agents acting at every tick. */
  numAgents: number;
  /** Identifies this game instance across reconnects; default: a random UUID. "" disables resume. */
  sessionKey?: string;
  /** Observations that may be sent and not yet answered (the server may grant fewer); default 1. */
  maxInFlight?: number;
  /** Free-form labels for the link's logs and metrics. */
  labels?: Record<string, string>;
  /** How long connect() waits for the server to be up and welcome the link; default 60 s. */
  connectTimeoutMs?: number;
  /** How long a broken link keeps trying to reconnect before it fails; default 60 s. */
  reconnectTimeoutMs?: number;
  /** Called after every successful reconnect with the new Welcome. */
  onReconnect?: (welcome: Welcome) => void;
  /** Extra gRPC channel options. */
  channelOptions?: grpc.ChannelOptions;
}

/** What the agents report at one tick; every array has one entry per agent. */
export interface Step {
  /** The game's tick counter, strictly increasing; default: the previous tick + 1 (from 1). */
  tick?: number;
  /** Shaped like the observation space with a leading dimension N (see `batchOf`). */
  observations: unknown;
  /** Reward each agent got for its previous action. */
  rewards: ArrayLike<number>;
  /** The agent's episode ended at this tick in a terminal state. */
  terminated: ArrayLike<boolean | number>;
  /** The agent's episode was cut short at this tick (time limit). */
  truncated: ArrayLike<boolean | number>;
  /** Id of the episode each agent is in (a new id starts a new episode). */
  episodeIds: ArrayLike<number | bigint>;
  /** Optional numeric extras: key -> one value per agent (recorded, never read by the policy). */
  infos?: Record<string, ArrayLike<number>>;
}

/** The answer to one observation batch. */
export interface Reply {
  tick: number;
  /** One action per agent, shaped like the action space with a leading dimension N. */
  actions: Tree;
  /** Version of the policy that chose these actions. */
  policyVersion: number;
}

export interface Welcome {
  linkId: string;
  protocolVersion: number;
  maxInFlight: number;
  resumed: boolean;
  lastTick: number;
  resumeWindowS: number;
  run: string;
  policyVersion: number;
}

/** What the link did over its life (resumes included). */
export interface Farewell {
  ticks: number;
  episodes: number;
}
