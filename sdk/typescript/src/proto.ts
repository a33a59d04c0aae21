// The GameLink protos, loaded at run time by @grpc/proto-loader from the package's proto/ folder
// (gathered there by scripts/gen.mjs); the types in ./generated were generated from the same files
// with the same options, so what the loader returns is what the types say.
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import type { ProtoGrpcType } from "./generated/game_link.js";

export type { ConnectRequest } from "./generated/rlfleet/env/v1/ConnectRequest.js";
export type { ConnectResponse__Output as ConnectResponse } from "./generated/rlfleet/env/v1/ConnectResponse.js";
export type { GameLinkServiceClient } from "./generated/rlfleet/env/v1/GameLinkService.js";
export type { Hello } from "./generated/rlfleet/env/v1/Hello.js";
export type { ObservationBatch } from "./generated/rlfleet/env/v1/ObservationBatch.js";
export type { Welcome__Output as WelcomeMessage } from "./generated/rlfleet/env/v1/Welcome.js";
export type { Space } from "./generated/rlfleet/common/v1/Space.js";
export type {
  Tensor as TensorMessage,
  Tensor__Output as TensorMessageOut,
} from "./generated/rlfleet/common/v1/Tensor.js";
export type {
  TensorTree as TensorTreeMessage,
  TensorTree__Output as TensorTreeMessageOut,
} from "./generated/rlfleet/common/v1/TensorTree.js";
export type { Status__Output as StatusMessage } from "./generated/google/rpc/Status.js";

/** Where the .proto files live: <package>/proto, next to dist/. */
export const PROTO_DIR = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "proto");

// Keep in step with the generator flags in scripts/gen.mjs. json: decodes google.protobuf.Any
// (the BadRequest in an in-band error's details) into a plain object with an "@type" key.
const LOADER_OPTIONS: protoLoader.Options = {
  longs: Number,
  enums: String,
  bytes: Buffer,
  defaults: true,
  oneofs: true,
  json: true,
  includeDirs: [PROTO_DIR],
};

let loaded: ProtoGrpcType | undefined;

/** The loaded proto package (loaded once, on first use). */
export function protos(): ProtoGrpcType {
  if (loaded === undefined) {
    const files = ["rlfleet/env/v1/game_link.proto", "google/rpc/error_details.proto"];
    const definition = protoLoader.loadSync(files, LOADER_OPTIONS);
    loaded = grpc.loadPackageDefinition(definition) as unknown as ProtoGrpcType;
  }
  return loaded;
}
