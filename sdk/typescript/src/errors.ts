// Typed errors. Every error carries a gRPC status code (as a number and its name) and, where one
// thing is to blame, the field that names it ("observations.observations.image").
import { status as Code } from "@grpc/grpc-js";

import type { StatusMessage } from "./proto.js";

export { Code };

/** Name of a gRPC status code ("INVALID_ARGUMENT"). */
export function codeName(code: number): string {
  return Code[code] ?? `CODE_${code}`;
}

/** Base class: anything the SDK throws on purpose. */
export class GameLinkError extends Error {
  /** gRPC status code (grpc.status). */
  readonly code: number;
  /** The offending field where the server or the SDK named one, else undefined. */
  readonly field: string | undefined;

  constructor(code: number, message: string, field?: string) {
    super(`${codeName(code)}: ${message}`);
    this.name = new.target.name;
    this.code = code;
    this.field = field;
  }

  /** The code's name, e.g. "INVALID_ARGUMENT". */
  get codeName(): string {
    return codeName(this.code);
  }
}

/**
 * The server answered one request with an error (ConnectResponse.error). The link stays open and
 * usable: fix the request and go on.
 */
export class InBandError extends GameLinkError {
  /** request_id of the request that failed. */
  readonly requestId: number;

  constructor(status: StatusMessage, requestId: number) {
    super(status.code, status.message, badRequestField(status));
    this.requestId = requestId;
  }
}

/** The SDK refused an input before sending it (wrong length, wrong structure, bad option). */
export class InvalidInputError extends GameLinkError {
  constructor(message: string, field?: string) {
    super(Code.INVALID_ARGUMENT, message, field);
  }
}

/**
 * The link is gone for good: the server ended the stream with a status the SDK does not retry
 * (ABORTED: another stream took the session key over), reconnecting failed for longer than the
 * reconnect timeout, or the link was closed.
 */
export class LinkClosedError extends GameLinkError {}

/**
 * The server answered this observation batch but the answer was lost with the connection (the
 * resumed link's last_tick is at or past this tick). The server recorded its actions as taken;
 * the game goes on with its next tick.
 */
export class ReplyLostError extends GameLinkError {
  readonly tick: number;

  constructor(tick: number, lastTick: number) {
    super(
      Code.DATA_LOSS,
      `the reply to tick ${tick} was lost in a reconnect (the server answered up to tick ${lastTick})`,
    );
    this.tick = tick;
  }
}

/** The first google.rpc.BadRequest field violation in a Status's details, if any. */
function badRequestField(status: StatusMessage): string | undefined {
  for (const detail of status.details ?? []) {
    // With the loader's json option an Any of a known type decodes to {"@type": ..., ...fields}.
    const any = detail as unknown as { "@type"?: string; fieldViolations?: { field?: string }[] };
    if (any["@type"]?.endsWith("google.rpc.BadRequest")) {
      const field = any.fieldViolations?.[0]?.field;
      if (field) return field;
    }
  }
  return undefined;
}
