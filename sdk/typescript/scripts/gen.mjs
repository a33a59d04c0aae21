// Build step 1: gather the .proto files the SDK loads at run time into proto/ and generate
// TypeScript types for their messages into src/generated/ (both are build output, not committed).
//
// The rlfleet protos come from the repository (../../protos); google/rpc/{status,error_details}
// come from the google-proto-files package (in-band errors carry google.rpc.Status with a
// google.rpc.BadRequest naming the offending field). Types come from @grpc/proto-loader's own
// generator, so they match what the loader returns for the options in src/proto.ts.
import { execFileSync } from "node:child_process";
import { cpSync, existsSync, mkdirSync, rmSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = dirname(dirname(fileURLToPath(import.meta.url)));
const repoProtos = join(root, "..", "..", "protos");
const protoDir = join(root, "proto");
const outDir = join(root, "src", "generated");

const RLFLEET = [
  "rlfleet/common/v1/tensor.proto",
  "rlfleet/common/v1/space.proto",
  "rlfleet/env/v1/game_link.proto",
];
const GOOGLE = ["google/rpc/status.proto", "google/rpc/error_details.proto"];

if (existsSync(repoProtos)) {
  rmSync(protoDir, { recursive: true, force: true });
  const require = createRequire(import.meta.url);
  const googleRoot = dirname(require.resolve("google-proto-files/package.json"));
  for (const [from, files] of [
    [repoProtos, RLFLEET],
    [googleRoot, GOOGLE],
  ]) {
    for (const file of files) {
      mkdirSync(dirname(join(protoDir, file)), { recursive: true });
      cpSync(join(from, file), join(protoDir, file));
    }
  }
} else if (!existsSync(join(protoDir, RLFLEET[2]))) {
  throw new Error(`no ${repoProtos} and no proto/ folder: cannot find the GameLink protos`);
}

rmSync(outDir, { recursive: true, force: true });
const generator = join(root, "node_modules", ".bin", "proto-loader-gen-types");
// Keep these options in step with LOADER_OPTIONS in src/proto.ts.
execFileSync(
  generator,
  [
    "--longs=Number",
    "--enums=String",
    "--defaults",
    "--oneofs",
    "--json",
    "--grpcLib=@grpc/grpc-js",
    "--importFileExtension=.js",
    `--includeDirs=${protoDir}`,
    `--outDir=${outDir}`,
    ...RLFLEET,
    ...GOOGLE,
  ],
  { stdio: "inherit" },
);
