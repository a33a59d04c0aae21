// GameLink bench client (bench/transport/game_link.py starts it): L links of N agents, opened
// at once as promises on one event loop, each running W warm-up ticks and then T measured ticks
// with up to K observations in flight (1: lock step). Prints one JSON line: the measured seconds
// (all links, from the moment every link is warmed up), the ticks, the granted in-flight window
// and every tick's submit -> reply latency in microseconds.
//
//   node dist/bench/link_bench.js ADDRESS AGENTS LINKS TICKS WARMUP IN_FLIGHT
import { GameLink, spaces } from "../src/index.js";

const usage = "usage: link_bench ADDRESS AGENTS LINKS TICKS WARMUP IN_FLIGHT";
const [address, ...rest] = process.argv.slice(2);
const numbers = rest.map(Number);
if (address === undefined || numbers.length !== 5 || !numbers.every((n) => Number.isInteger(n) && n >= 0)) {
  console.error(`link_bench: ${usage} (integers >= 0), got ${process.argv.slice(2).join(" ")}`);
  process.exit(2);
}
const [agents, links, ticks, warmup, inFlight] = numbers;

// The bench game: CartPole's spaces, constant values (stepping it costs nothing).
const step = {
  observations: new Float32Array(agents * 4).fill(0.5),
  rewards: new Float32Array(agents),
  terminated: new Array<boolean>(agents).fill(false),
  truncated: new Array<boolean>(agents).fill(false),
  episodeIds: Array.from({ length: agents }, (_, i) => i),
};

/** Run `count` ticks, keeping up to the granted window in flight; push latencies (us) to `out`. */
async function drive(link: GameLink, count: number, out: number[]): Promise<void> {
  const sent: number[] = [];
  const received = async () => {
    await link.receive();
    out.push((performance.now() - sent[out.length]) * 1000);
  };
  const base = out.length;
  for (let t = 0; t < count; t++) {
    if (sent.length - (out.length - base) >= link.maxInFlight) await received();
    sent.push(performance.now());
    await link.submit(step);
  }
  while (out.length - base < sent.length) await received();
}

async function main(): Promise<void> {
  const opened = await Promise.all(
    Array.from({ length: links }, async () => {
      const link = new GameLink({
        address,
        game: "bench-ts",
        envId: "BenchTick-v0",
        observationSpace: spaces.box(-1, 1, [4]),
        actionSpace: spaces.discrete(2),
        numAgents: agents,
        maxInFlight: inFlight,
      });
      await link.connect();
      await drive(link, warmup, []);
      return link;
    }),
  );
  const latencies = opened.map(() => [] as number[]);
  const started = performance.now();
  await Promise.all(opened.map((link, i) => drive(link, ticks, latencies[i])));
  const seconds = (performance.now() - started) / 1000;
  await Promise.all(opened.map((link) => link.close("bench done")));
  const rounded = latencies.flat().map((us) => Math.round(us * 10) / 10);
  const granted = Math.min(...opened.map((link) => link.maxInFlight));
  console.log(JSON.stringify({ seconds, ticks: ticks * links, in_flight: granted, latencies_us: rounded }));
}

main().catch((error: unknown) => {
  console.error(`link_bench: ${error instanceof Error ? error.stack : String(error)}`);
  process.exit(1);
});
