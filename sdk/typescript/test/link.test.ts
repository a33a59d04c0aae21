// GameLink against a real env server (GameLinkService, random policy) over real sockets.
import assert from "node:assert/strict";
import { type Socket, createServer } from "node:net";
import { after, before, test } from "node:test";

import {
  Code,
  GameLink,
  type GameLinkOptions,
  InBandError,
  LinkClosedError,
  type Step,
  Tensor,
  spaces,
} from "../src/index.js";
import { type EnvServer, startEnvServer } from "./server.js";

const AGENTS = 4;
const OBS = 3;
let server: EnvServer;

before(async () => {
  server = await startEnvServer({ max_in_flight: 4 });
});
after(async () => {
  await server?.stop();
});

function link(options: Partial<GameLinkOptions> = {}): GameLink {
  return new GameLink({
    address: server.address,
    game: "sdk-test",
    envId: "SdkTest-v0",
    observationSpace: spaces.box(0, 1, [OBS]),
    actionSpace: spaces.discrete(3),
    numAgents: AGENTS,
    connectTimeoutMs: 90_000,
    ...options,
  });
}

/** A tick's values: agent 0 ends an episode every 5th tick (terminated), the others never. */
function step(tick: number): Step {
  const ends = tick % 5 === 0;
  return {
    tick,
    observations: Array.from({ length: AGENTS * OBS }, (_, i) => ((i + tick) % 2 === 0 ? 1 : 0)),
    rewards: Array.from({ length: AGENTS }, () => 1),
    terminated: [ends, false, false, false],
    truncated: [false, false, false, false],
    episodeIds: [Math.floor((tick - 1) / 5), 0, 0, 0],
  };
}

function assertActions(actions: unknown): void {
  assert.ok(actions instanceof Tensor);
  assert.equal(actions.dtype, "int64");
  assert.deepEqual(actions.shape, [AGENTS]);
  for (const a of actions.toArray()) assert.ok(a >= 0 && a < 3, `action ${a}`);
}

test("lock step: one reply per tick, Farewell counts ticks and ended episodes", async () => {
  const game = link();
  const welcome = await game.connect();
  assert.equal(welcome.protocolVersion, 1);
  assert.equal(welcome.maxInFlight, 1);
  assert.equal(welcome.resumed, false);
  assert.ok(welcome.linkId.length > 0);
  for (let tick = 1; tick <= 20; tick++) assertActions(await game.act(step(tick)));
  assert.equal(game.policyVersion, 0);
  assert.deepEqual(await game.close("test done"), { ticks: 20, episodes: 4 });
  await assert.rejects(game.act(step(21)), LinkClosedError);
});

test("pipelining: up to maxInFlight ticks unanswered, replies in order", async () => {
  const game = link({ maxInFlight: 8 });
  const welcome = await game.connect();
  assert.equal(welcome.maxInFlight, 4, "the server caps the window at its max_in_flight");
  const sent: number[] = [];
  const got: number[] = [];
  for (let tick = 1; tick <= 40; tick++) {
    sent.push(await game.submit(step(tick)));
    assert.ok(game.inFlight <= 4, `in flight ${game.inFlight}`);
    if (sent.length - got.length === 4) {
      const reply = await game.receive();
      assertActions(reply.actions);
      got.push(reply.tick);
    }
  }
  while (got.length < sent.length) got.push((await game.receive()).tick);
  assert.deepEqual(got, sent);
  assert.equal((await game.close()).ticks, 40);
});

test("an in-band error (bad shape, stale tick) names the field and the link stays usable", async () => {
  const game = link();
  await game.connect();
  assertActions(await game.act(step(1)));
  const wrongShape = Tensor.from("float32", [AGENTS, OBS + 1], new Array(AGENTS * (OBS + 1)).fill(0));
  await assert.rejects(game.act({ ...step(2), observations: wrongShape }), (error: unknown) => {
    assert.ok(error instanceof InBandError, String(error));
    assert.equal(error.code, Code.INVALID_ARGUMENT);
    assert.equal(error.codeName, "INVALID_ARGUMENT");
    assert.match(error.field ?? "", /^observations\.observations/);
    return true;
  });
  await assert.rejects(
    game.act(step(1)),
    (error: unknown) => error instanceof InBandError && error.code === Code.INVALID_ARGUMENT,
  );
  assertActions(await game.act(step(2)));
  assert.equal((await game.close()).ticks, 2);
});

/** A TCP forwarder in front of the server whose connections the test can cut. */
async function cuttableProxy(
  target: string,
): Promise<{ address: string; cut: () => void; close: () => void }> {
  const [host, port] = target.split(":");
  const sockets = new Set<Socket>();
  const proxy = createServer((client) => {
    const upstream = new (client.constructor as typeof Socket)();
    upstream.connect(Number(port), host);
    for (const s of [client, upstream]) {
      sockets.add(s);
      s.on("error", () => {});
      s.on("close", () => sockets.delete(s));
    }
    client.pipe(upstream).pipe(client);
  });
  await new Promise<void>((resolve) => proxy.listen(0, "127.0.0.1", resolve));
  const { port: proxyPort } = proxy.address() as { port: number };
  return {
    address: `127.0.0.1:${proxyPort}`,
    cut: () => sockets.forEach((s) => s.destroy()),
    close: () => {
      sockets.forEach((s) => s.destroy());
      proxy.close();
    },
  };
}

test("a cut connection resumes the link by session key: same link, episodes go on", async () => {
  const proxy = await cuttableProxy(server.address);
  const resumed: boolean[] = [];
  const game = link({ address: proxy.address, onReconnect: (w) => resumed.push(w.resumed) });
  try {
    const first = await game.connect();
    for (let tick = 1; tick <= 7; tick++) await game.act(step(tick));
    proxy.cut();
    for (let tick = 8; tick <= 12; tick++) assertActions(await game.act(step(tick)));
    assert.equal(game.reconnects, 1);
    assert.deepEqual(resumed, [true]);
    assert.equal(game.welcome!.linkId, first.linkId);
    assert.equal(game.welcome!.lastTick, 7);
    assert.deepEqual(await game.close(), { ticks: 12, episodes: 2 });
  } finally {
    proxy.close();
  }
});

test("a second link with the same session key takes over: the first ends with ABORTED", async () => {
  const first = link({ sessionKey: "takeover-test" });
  await first.connect();
  await first.act(step(1));
  const second = link({ sessionKey: "takeover-test" });
  assert.equal((await second.connect()).resumed, true);
  await assert.rejects(
    first.act(step(2)),
    (error: unknown) => error instanceof LinkClosedError && error.code === Code.ABORTED,
  );
  assertActions(await second.act(step(2)));
  await second.close();
});
