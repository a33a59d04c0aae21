// GameLink: one game instance's link to a training run (GameLinkService.Connect, see
// protos/rlfleet/env/v1/game_link.proto for the rules this follows).
//
// Every request the link writes waits in `awaiting` until its answer comes (answers come in
// order). When the stream breaks, what was written and not answered moves to `backlog`; the link
// reconnects with the same session key and, once welcomed back, writes the backlog again, so a
// pending act() simply takes a little longer. Replies the server sent before the break but that
// never arrived cannot be recovered (the resumed Welcome's last_tick says which): those reject
// with ReplyLostError.
//
// The plain data types live in types.ts.
import { randomUUID } from "node:crypto";
import { setTimeout as sleep } from "node:timers/promises";

import * as grpc from "@grpc/grpc-js";

import {
  Code,
  GameLinkError,
  InBandError,
  InvalidInputError,
  LinkClosedError,
  ReplyLostError,
} from "./errors.js";
import { type ConnectRequest, type ConnectResponse, type GameLinkServiceClient, protos } from "./proto.js";
import { batchOf } from "./space.js";
import { Tensor, type Tree, decodeTree, encodeTensor, encodeTree } from "./tensor.js";
import {
  type Farewell,
  type GameLinkOptions,
  PROTOCOL_VERSION,
  type Reply,
  type Step,
  type Welcome,
} from "./types.js";

type Kind = "hello" | "observations" | "goodbye";

interface Pending {
  kind: Kind;
  request: ConnectRequest;
  tick: number;
  resolve: (response: ConnectResponse) => void;
  reject: (error: Error) => void;
}

type Stream = grpc.ClientDuplexStream<ConnectRequest, ConnectResponse>;
type State = "new" | "connecting" | "open" | "reconnecting" | "closing" | "closed";

/** Status codes after which the link reconnects (a broken connection, a restarting server). */
const RETRYABLE = new Set([
  Code.UNAVAILABLE,
  Code.CANCELLED,
  Code.UNKNOWN,
  Code.INTERNAL,
  Code.DEADLINE_EXCEEDED,
  Code.OK,
]);

/** The stream ended while a request waited for its answer (internal: triggers a retry). */
class StreamBroken extends GameLinkError {}

export class GameLink {
  readonly address: string;
  readonly sessionKey: string;
  readonly numAgents: number;
  private readonly options: GameLinkOptions;
  private readonly client: GameLinkServiceClient;
  private stream: Stream | undefined;
  private state: State = "new";
  private failure: GameLinkError | undefined;
  private awaiting: Pending[] = [];
  private backlog: Pending[] = [];
  private replies: Promise<Reply>[] = [];
  private windowWaiters: (() => void)[] = [];
  private requestId = 0;
  private lastSubmittedTick = 0;
  private current: Welcome | undefined;
  private version = 0;
  private reconnectCount = 0;

  constructor(options: GameLinkOptions) {
    const address = options.address ?? process.env.RLFLEET_GAME_LINK_ADDRESS;
    if (!address) {
      throw new InvalidInputError("no address: pass `address` or set RLFLEET_GAME_LINK_ADDRESS", "address");
    }
    if (!Number.isInteger(options.numAgents) || options.numAgents < 1) {
      throw new InvalidInputError(`numAgents must be an integer >= 1, got ${options.numAgents}`, "numAgents");
    }
    this.options = options;
    this.address = address;
    this.numAgents = options.numAgents;
    this.sessionKey = options.sessionKey ?? randomUUID();
    const Service = protos().rlfleet.env.v1.GameLinkService;
    this.client = new Service(address, grpc.credentials.createInsecure(), {
      // Reconnect quickly: a game waits on every tick, and env servers restart in seconds.
      "grpc.initial_reconnect_backoff_ms": 100,
      "grpc.max_reconnect_backoff_ms": 1000,
      ...options.channelOptions,
    });
  }

  /** The Welcome of the current connection (undefined before connect()). */
  get welcome(): Welcome | undefined {
    return this.current;
  }

  /** Version of the policy that chose the latest actions received (or the Welcome's). */
  get policyVersion(): number {
    return this.version;
  }

  /** Observations allowed in flight (Welcome.max_in_flight), 1 before connect(). */
  get maxInFlight(): number {
    return this.current?.maxInFlight ?? 1;
  }

  /** Observations sent (or waiting to be resent) and not answered yet. */
  get inFlight(): number {
    return [...this.awaiting, ...this.backlog].filter((p) => p.kind === "observations").length;
  }

  /** How many times the link reconnected. */
  get reconnects(): number {
    return this.reconnectCount;
  }

  /** Open the link: Hello, then Welcome. Waits up to connectTimeoutMs for the server. */
  async connect(): Promise<Welcome> {
    if (this.state !== "new")
      throw new LinkClosedError(Code.FAILED_PRECONDITION, `connect() on a link that is ${this.state}`);
    this.state = "connecting";
    try {
      return await this.establish(this.options.connectTimeoutMs ?? 60_000);
    } catch (error) {
      this.fail(error instanceof GameLinkError ? error : new LinkClosedError(Code.UNKNOWN, String(error)));
      throw error;
    }
  }

  /** Lock step: send this tick's observations and wait for the actions. */
  async act(step: Step): Promise<Tree> {
    if (this.replies.length > 0) {
      throw new InvalidInputError(
        `act() with ${this.replies.length} submitted replies not received yet: use receive()`,
      );
    }
    await this.submit(step);
    return (await this.receive()).actions;
  }

  /**
   * Pipelining: send one tick's observations without waiting for the answer (take it later with
   * receive(), in order). Waits while maxInFlight observations are already unanswered. Returns
   * the tick sent.
   */
  async submit(step: Step): Promise<number> {
    this.checkUsable();
    while (this.inFlight >= this.maxInFlight) {
      await new Promise<void>((resolve) => this.windowWaiters.push(resolve));
      this.checkUsable();
    }
    const tick = step.tick ?? this.lastSubmittedTick + 1;
    const request: ConnectRequest = { observations: this.batch(step, tick) };
    this.lastSubmittedTick = Math.max(this.lastSubmittedTick, tick);
    const reply = this.request("observations", request, tick).then((response) => {
      const actions = response.actions!;
      this.version = actions.policyVersion;
      return {
        tick: actions.tick,
        actions: decodeTree(actions.actions!, "actions"),
        policyVersion: actions.policyVersion,
      };
    });
    reply.catch(() => {}); // the error is the receiver's, when it calls receive()
    this.replies.push(reply);
    return tick;
  }

  /** The answer to the oldest submitted observations not received yet. */
  async receive(): Promise<Reply> {
    const next = this.replies.shift();
    if (next === undefined) throw new InvalidInputError("receive() with nothing submitted");
    return next;
  }

  /**
   * End the link: wait for the answers in flight, say Goodbye, and return the Farewell counts.
   * Replies not received yet stay receivable.
   */
  async close(reason = ""): Promise<Farewell> {
    this.checkUsable();
    this.state = "closing";
    try {
      const response = await this.request("goodbye", { goodbye: { reason } }, 0);
      const farewell = response.farewell!;
      return { ticks: farewell.ticks, episodes: farewell.episodes };
    } finally {
      this.state = "closed";
      this.failure ??= new LinkClosedError(Code.FAILED_PRECONDITION, "the link is closed");
      this.stream?.end();
      this.client.close();
    }
  }

  // --- requests and answers ---------------------------------------------------------------------

  private batch(step: Step, tick: number): ConnectRequest["observations"] {
    const n = this.numAgents;
    const perAgent = (name: string, values: ArrayLike<unknown>) => {
      if (values?.length !== n) {
        throw new InvalidInputError(
          `observations.${name}: ${values?.length} values for ${n} agents`,
          `observations.${name}`,
        );
      }
      return Array.from(values);
    };
    const infos: Record<string, Tree> = {};
    for (const [key, values] of Object.entries(step.infos ?? {})) {
      infos[key] = Tensor.from("float64", [n], perAgent(`infos.${key}`, values));
    }
    return {
      tick,
      observations: encodeTree(
        batchOf(this.options.observationSpace, step.observations, n, "observations.observations"),
        "observations.observations",
      ),
      rewards: encodeTensor(Tensor.from("float32", [n], perAgent("rewards", step.rewards))),
      terminated: encodeTensor(Tensor.from("bool", [n], perAgent("terminated", step.terminated))),
      truncated: encodeTensor(Tensor.from("bool", [n], perAgent("truncated", step.truncated))),
      episodeIds: encodeTensor(Tensor.from("int64", [n], perAgent("episode_ids", step.episodeIds))),
      infos: step.infos === undefined ? null : encodeTree(infos, "observations.infos"),
    };
  }

  private request(kind: Kind, request: ConnectRequest, tick: number): Promise<ConnectResponse> {
    return new Promise((resolve, reject) => {
      const pending: Pending = {
        kind,
        request: { ...request, requestId: ++this.requestId },
        tick,
        resolve,
        reject,
      };
      if (
        this.stream !== undefined &&
        (this.state === "open" || this.state === "closing" || kind === "hello")
      ) {
        this.write(pending);
      } else {
        this.backlog.push(pending);
      }
    });
  }

  private write(pending: Pending): void {
    this.awaiting.push(pending);
    this.stream!.write(pending.request);
  }

  private onResponse(stream: Stream, response: ConnectResponse): void {
    if (stream !== this.stream) return;
    const pending = this.awaiting.shift();
    if (pending === undefined || Number(pending.request.requestId) !== response.requestId) {
      const error = new LinkClosedError(Code.INTERNAL, `unexpected answer to request ${response.requestId}`);
      pending?.reject(error);
      this.fail(error);
      return;
    }
    if (response.error && response.error.code !== Code.OK) {
      pending.reject(new InBandError(response.error, response.requestId));
    } else if (response.result === this.resultOf(pending.kind)) {
      pending.resolve(response);
    } else {
      pending.reject(
        new GameLinkError(
          Code.INTERNAL,
          `a ${pending.kind} was answered with ${response.result ?? "nothing"}`,
        ),
      );
    }
    this.wakeWindow();
  }

  private resultOf(kind: Kind): ConnectResponse["result"] {
    return kind === "hello" ? "welcome" : kind === "observations" ? "actions" : "farewell";
  }

  private wakeWindow(): void {
    for (const wake of this.windowWaiters.splice(0)) wake();
  }

  // --- connections ------------------------------------------------------------------------------

  private openStream(): Stream {
    const stream = this.client.Connect();
    stream.on("data", (response: ConnectResponse) => this.onResponse(stream, response));
    stream.on("error", () => {}); // the status event below says what happened
    // Messages pushed just before the status may still be on their way to "data": let them land.
    stream.on("status", (status: grpc.StatusObject) => setImmediate(() => this.onStreamEnd(stream, status)));
    return stream;
  }

  /** Hello until welcomed (retrying broken connections until `timeoutMs` has passed). */
  private async establish(timeoutMs: number): Promise<Welcome> {
    const deadline = Date.now() + timeoutMs;
    let delayMs = 100;
    for (;;) {
      try {
        await this.waitForReady(deadline);
        this.stream = this.openStream();
        const welcome = await this.hello();
        this.adopt(welcome);
        return welcome;
      } catch (error) {
        if (!(error instanceof StreamBroken) && !(error instanceof ChannelNotReady)) throw error;
        if (Date.now() + delayMs >= deadline) {
          throw new LinkClosedError(
            Code.UNAVAILABLE,
            `no GameLink server at ${this.address} within ${timeoutMs} ms (${error.message})`,
          );
        }
        await sleep(delayMs);
        delayMs = Math.min(delayMs * 2, 2000);
      }
    }
  }

  private waitForReady(deadline: number): Promise<void> {
    return new Promise((resolve, reject) => {
      this.client.waitForReady(deadline, (error) =>
        error ? reject(new ChannelNotReady(Code.UNAVAILABLE, error.message)) : resolve(),
      );
    });
  }

  private async hello(): Promise<Welcome> {
    const o = this.options;
    const response = await this.request(
      "hello",
      {
        hello: {
          game: o.game,
          envId: o.envId,
          observationSpace: o.observationSpace,
          actionSpace: o.actionSpace,
          numAgents: o.numAgents,
          protocolVersion: PROTOCOL_VERSION,
          sessionKey: this.sessionKey,
          maxInFlight: o.maxInFlight ?? 1,
          labels: o.labels ?? {},
        },
      },
      0,
    );
    const w = response.welcome!;
    return {
      linkId: w.linkId,
      protocolVersion: w.protocolVersion,
      maxInFlight: w.maxInFlight,
      resumed: w.resumed,
      lastTick: w.lastTick,
      resumeWindowS: Number(w.resumeWindowS), // the json loader option spells Infinity as a string
      run: w.run,
      policyVersion: w.policyVersion,
    };
  }

  /** A (re)connection was welcomed: write what waited for it, drop what the break lost. */
  private adopt(welcome: Welcome): void {
    this.current = welcome;
    this.version = welcome.policyVersion;
    const waiting = this.backlog.splice(0);
    this.state = this.state === "reconnecting" || this.state === "connecting" ? "open" : this.state;
    for (const pending of waiting) {
      if (welcome.resumed && pending.kind === "observations" && pending.tick <= welcome.lastTick) {
        pending.reject(new ReplyLostError(pending.tick, welcome.lastTick));
      } else {
        this.write(pending);
      }
    }
    this.wakeWindow();
  }

  private onStreamEnd(stream: Stream, status: grpc.StatusObject): void {
    if (stream !== this.stream) return;
    this.stream = undefined;
    const unanswered = this.awaiting.splice(0);
    const broken = new StreamBroken(status.code, status.details || "the stream ended");
    for (const pending of unanswered) {
      if (pending.kind === "hello")
        pending.reject(broken); // establish() retries it
      else this.backlog.push(pending);
    }
    if (this.state === "closed" || this.state === "new" || this.failure !== undefined) return;
    if (this.state === "connecting" || this.state === "reconnecting") return; // establish() handles it
    if (!RETRYABLE.has(status.code)) {
      this.fail(new LinkClosedError(status.code, `the server ended the link: ${status.details}`));
      return;
    }
    void this.reconnect();
  }

  private async reconnect(): Promise<void> {
    const closing = this.state === "closing";
    this.state = "reconnecting";
    try {
      const welcome = await this.establish(this.options.reconnectTimeoutMs ?? 60_000);
      this.reconnectCount++;
      if (closing) this.state = "closing";
      this.options.onReconnect?.(welcome);
    } catch (error) {
      this.fail(error instanceof GameLinkError ? error : new LinkClosedError(Code.UNKNOWN, String(error)));
    }
  }

  /** The link is unusable from now on: every waiting request fails with `error`. */
  private fail(error: GameLinkError): void {
    this.failure ??= error;
    for (const pending of [...this.awaiting.splice(0), ...this.backlog.splice(0)])
      pending.reject(this.failure);
    this.wakeWindow();
    this.stream?.cancel();
    this.stream = undefined;
    this.client.close();
    this.state = "closed";
  }

  private checkUsable(): void {
    if (this.failure !== undefined) throw this.failure;
    if (this.state === "new" || this.state === "connecting") {
      throw new LinkClosedError(Code.FAILED_PRECONDITION, "connect() first");
    }
  }
}

/** The channel did not become ready before the deadline (internal: retried until the timeout). */
class ChannelNotReady extends GameLinkError {}
