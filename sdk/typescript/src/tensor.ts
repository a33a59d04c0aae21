// Tensors on the wire (rlfleet.common.v1.Tensor: dtype, shape, little-endian row-major bytes) as
// typed arrays, and TensorTrees (dicts, tuples, text batches) as plain JavaScript values.
import { endianness } from "node:os";

import { InvalidInputError } from "./errors.js";
import type { TensorMessage, TensorMessageOut, TensorTreeMessage, TensorTreeMessageOut } from "./proto.js";

// Typed arrays use the platform's byte order and the wire is little-endian; every platform Node
// ships for is little-endian, so views are shared without swapping bytes.
if (endianness() !== "LE") throw new Error("@rlfleet/game-link needs a little-endian platform");

export type DTypeName =
  | "float32"
  | "float64"
  | "float16"
  | "bfloat16"
  | "int8"
  | "int16"
  | "int32"
  | "int64"
  | "uint8"
  | "uint16"
  | "uint32"
  | "uint64"
  | "bool";

export type TypedArray =
  | Float32Array
  | Float64Array
  | Int8Array
  | Int16Array
  | Int32Array
  | BigInt64Array
  | Uint8Array
  | Uint16Array
  | Uint32Array
  | BigUint64Array;

type ArrayConstructor = {
  new (length: number): TypedArray;
  new (buffer: ArrayBufferLike, byteOffset: number, length: number): TypedArray;
  readonly BYTES_PER_ELEMENT: number;
};

// float16 and bfloat16 travel as their raw 16-bit words (JavaScript has no such numbers).
const ARRAYS: Record<DTypeName, ArrayConstructor> = {
  float32: Float32Array,
  float64: Float64Array,
  float16: Uint16Array,
  bfloat16: Uint16Array,
  int8: Int8Array,
  int16: Int16Array,
  int32: Int32Array,
  int64: BigInt64Array,
  uint8: Uint8Array,
  uint16: Uint16Array,
  uint32: Uint32Array,
  uint64: BigUint64Array,
  bool: Uint8Array,
};

/** Wire enum name of a dtype ("float32" -> "D_TYPE_FLOAT32"). */
export function wireDType(dtype: DTypeName): string {
  return `D_TYPE_${dtype.toUpperCase()}`;
}

/** dtype of a wire enum name, or undefined for D_TYPE_UNSPECIFIED and unknown names. */
export function dtypeOf(wire: string): DTypeName | undefined {
  const name = wire.replace(/^D_TYPE_/, "").toLowerCase();
  return name in ARRAYS ? (name as DTypeName) : undefined;
}

export function itemSize(dtype: DTypeName): number {
  return ARRAYS[dtype].BYTES_PER_ELEMENT;
}

function product(shape: readonly number[]): number {
  return shape.reduce((a, b) => a * b, 1);
}

/** A dense n-dimensional array: a typed array of the dtype's storage type and a shape. */
export class Tensor {
  readonly dtype: DTypeName;
  readonly shape: readonly number[];
  readonly data: TypedArray;

  constructor(dtype: DTypeName, shape: readonly number[], data: TypedArray) {
    if (!(dtype in ARRAYS)) throw new InvalidInputError(`unknown dtype ${String(dtype)}`);
    if (!(data instanceof ARRAYS[dtype])) {
      throw new InvalidInputError(
        `${dtype} data must be a ${ARRAYS[dtype].name}, got ${data.constructor.name}`,
      );
    }
    if (shape.some((d) => !Number.isInteger(d) || d < 0)) {
      throw new InvalidInputError(`bad shape [${shape.join(", ")}]`);
    }
    if (data.length !== product(shape)) {
      throw new InvalidInputError(`${data.length} elements do not fill shape [${shape.join(", ")}]`);
    }
    this.dtype = dtype;
    this.shape = [...shape];
    this.data = data;
  }

  /**
   * A tensor of `dtype` and `shape` from numbers, bigints or booleans in row-major order (flat or
   * nested arrays: [[1, 2], [3, 4]]). Floats given for integer dtypes are truncated.
   */
  static from(
    dtype: DTypeName,
    shape: readonly number[],
    values: Iterable<unknown> | ArrayLike<unknown>,
  ): Tensor {
    const flat = flatten(values);
    const data = new ARRAYS[dtype](flat.length);
    const big = data instanceof BigInt64Array || data instanceof BigUint64Array;
    for (let i = 0; i < flat.length; i++) {
      const v = flat[i];
      const num = typeof v === "boolean" ? Number(v) : (v as number | bigint);
      if (big) (data as BigInt64Array)[i] = typeof num === "bigint" ? num : BigInt(Math.trunc(num));
      else (data as Float64Array)[i] = Number(num);
    }
    return new Tensor(dtype, shape, data);
  }

  /** Element i (row-major) as a number (64-bit integers beyond 2^53 lose precision). */
  get(i: number): number {
    return Number(this.data[i]);
  }

  /** All elements, row-major, as numbers. */
  toArray(): number[] {
    return Array.from(this.data as ArrayLike<number | bigint>, (v) => Number(v));
  }
}

/** Flattens nested arrays and typed arrays (row-major). */
function flatten(values: Iterable<unknown> | ArrayLike<unknown>): unknown[] {
  const out: unknown[] = [];
  const visit = (v: unknown): void => {
    if (ArrayBuffer.isView(v) && !(v instanceof DataView)) {
      const a = v as unknown as ArrayLike<unknown>;
      for (let i = 0; i < a.length; i++) out.push(a[i]);
    } else if (Array.isArray(v)) {
      for (const x of v) visit(x);
    } else {
      out.push(v);
    }
  };
  visit(
    Array.isArray(values) || ArrayBuffer.isView(values) ? values : Array.from(values as Iterable<unknown>),
  );
  return out;
}

/** The wire form of a tensor. The bytes are a view of the tensor's data, not a copy. */
export function encodeTensor(tensor: Tensor): TensorMessage {
  const { data } = tensor;
  return {
    dtype: wireDType(tensor.dtype) as TensorMessage["dtype"],
    shape: [...tensor.shape],
    data: Buffer.from(data.buffer, data.byteOffset, data.byteLength),
  };
}

/** A tensor from its wire form; `name` is what errors call it. Copies only unaligned bytes. */
export function decodeTensor(msg: TensorMessageOut, name = "tensor"): Tensor {
  const dtype = dtypeOf(String(msg.dtype));
  if (dtype === undefined) throw new InvalidInputError(`${name}: unsupported dtype ${msg.dtype}`, name);
  const shape = msg.shape.map(Number);
  const size = itemSize(dtype);
  const expected = product(shape) * size;
  if (msg.data.length !== expected) {
    throw new InvalidInputError(
      `${name}: ${msg.data.length} data bytes do not match shape [${shape.join(", ")}] of ${dtype} (${expected} bytes)`,
      name,
    );
  }
  let bytes: Uint8Array = msg.data;
  if (bytes.byteOffset % size !== 0) bytes = new Uint8Array(bytes); // typed views must be aligned
  return new Tensor(dtype, shape, new ARRAYS[dtype](bytes.buffer, bytes.byteOffset, expected / size));
}

/**
 * A TensorTree as a JavaScript value: a Tensor (Box, Discrete, MultiDiscrete, MultiBinary
 * spaces), an object of trees (Dict), an array of trees (Tuple) or an array of strings (Text).
 */
export type Tree = Tensor | string[] | { [key: string]: Tree } | Tree[];

export function encodeTree(value: Tree, name = "tree"): TensorTreeMessage {
  if (value instanceof Tensor) return { tensor: encodeTensor(value) };
  if (Array.isArray(value)) {
    if (value.length > 0 && value.every((v) => typeof v === "string")) {
      return { texts: { values: value as string[] } };
    }
    return { tuple: { items: (value as Tree[]).map((v, i) => encodeTree(v, `${name}[${i}]`)) } };
  }
  if (value !== null && typeof value === "object") {
    const items: Record<string, TensorTreeMessage> = {};
    for (const [key, child] of Object.entries(value)) items[key] = encodeTree(child, `${name}.${key}`);
    return { dict: { items } };
  }
  throw new InvalidInputError(
    `${name}: expected a Tensor, an object, an array or strings, got ${typeof value}`,
    name,
  );
}

export function decodeTree(msg: TensorTreeMessageOut, name = "tree"): Tree {
  switch (msg.node) {
    case "tensor":
      return decodeTensor(msg.tensor!, name);
    case "dict": {
      const out: { [key: string]: Tree } = {};
      for (const [key, child] of Object.entries(msg.dict!.items))
        out[key] = decodeTree(child, `${name}.${key}`);
      return out;
    }
    case "tuple":
      return msg.tuple!.items.map((child, i) => decodeTree(child, `${name}[${i}]`));
    case "texts":
      return [...msg.texts!.values];
    default:
      throw new InvalidInputError(`${name}: empty TensorTree (no tensor, dict, tuple or texts)`, name);
  }
}
