// Starts a real env server for the tests: `rlfleet serve env_server` with GameLinkService
// enabled and a random policy, on a free port, in its own process group; stop() ends it. The
// server also stops by itself if this process dies (RLFLEET_LAUNCHER_PID: it watches its parent).
import { type ChildProcess, spawn } from "node:child_process";
import { existsSync } from "node:fs";
import { createServer } from "node:net";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const REPO = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "..");

/** The repository's Python (RLFLEET_PYTHON overrides; default .venv/bin/python). */
function python(): string {
  const chosen = process.env.RLFLEET_PYTHON ?? join(REPO, ".venv", "bin", "python");
  if (!existsSync(chosen)) throw new Error(`no Python at ${chosen}: run \`make venv\` or set RLFLEET_PYTHON`);
  return chosen;
}

export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const probe = createServer();
    probe.once("error", reject);
    probe.listen(0, "127.0.0.1", () => {
      const { port } = probe.address() as { port: number };
      probe.close(() => resolve(port));
    });
  });
}

export interface EnvServer {
  address: string;
  output: () => string;
  stop: () => Promise<void>;
}

/** `settings` become RLFLEET_ENV_SERVER__GAME_LINK__<KEY> variables (e.g. {max_in_flight: 4}). */
export async function startEnvServer(
  settings: Record<string, string | number | boolean> = {},
): Promise<EnvServer> {
  const port = await freePort();
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    OMP_NUM_THREADS: "1",
    RLFLEET_LOG_LEVEL: "WARNING",
    RLFLEET_LAUNCHER_PID: String(process.pid),
    RLFLEET_ENV_SERVER__GAME_LINK__ENABLED: "true",
    RLFLEET_ENV_SERVER__GAME_LINK__POLICY: "random",
  };
  for (const [key, value] of Object.entries(settings))
    env[`RLFLEET_ENV_SERVER__GAME_LINK__${key.toUpperCase()}`] = String(value);
  const child: ChildProcess = spawn(
    python(),
    ["-m", "launch.cli", "serve", "env_server", "--host", "127.0.0.1", "--port", String(port)],
    { cwd: REPO, env, detached: true, stdio: ["ignore", "pipe", "pipe"] },
  );
  let output = "";
  child.stdout!.on("data", (chunk) => (output += chunk));
  child.stderr!.on("data", (chunk) => (output += chunk));
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()));
  const killGroup = (signal: NodeJS.Signals) => {
    try {
      process.kill(-child.pid!, signal);
    } catch {
      // already gone
    }
  };
  process.once("exit", () => killGroup("SIGKILL"));
  return {
    address: `127.0.0.1:${port}`,
    output: () => output,
    stop: async () => {
      if (child.exitCode !== null || child.signalCode !== null) return;
      killGroup("SIGTERM");
      const timer = setTimeout(() => killGroup("SIGKILL"), 10_000);
      await exited;
      clearTimeout(timer);
    },
  };
}
