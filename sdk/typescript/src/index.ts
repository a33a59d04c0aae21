// @rlfleet/game-link: connect a game that owns its loop to an rlfleet training run.
export { GameLink } from "./link.js";
export { PROTOCOL_VERSION } from "./types.js";
export type { Farewell, GameLinkOptions, Reply, Step, Welcome } from "./types.js";
export {
  Code,
  GameLinkError,
  InBandError,
  InvalidInputError,
  LinkClosedError,
  ReplyLostError,
  codeName,
} from "./errors.js";
export { batchOf, leafOf, spaces } from "./space.js";
export type { Space } from "./space.js";
export { Tensor, decodeTensor, decodeTree, encodeTensor, encodeTree, itemSize } from "./tensor.js";
export type { DTypeName, Tree, TypedArray } from "./tensor.js";
