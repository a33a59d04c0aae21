// Spaces (rlfleet.common.v1.Space, mirroring gymnasium.spaces) and turning a game's per-tick
// values into batches shaped like them: N agents, a leading dimension N on every leaf.
import { InvalidInputError } from "./errors.js";
import type { Space, TensorMessage } from "./proto.js";
import { type DTypeName, Tensor, type Tree, dtypeOf, encodeTensor, wireDType } from "./tensor.js";

export type { Space };

type Numbers = number | ArrayLike<number>;

function bounds(value: Numbers, shape: readonly number[], dtype: DTypeName): TensorMessage {
  const size = shape.reduce((a, b) => a * b, 1);
  const values = typeof value === "number" ? new Array<number>(size).fill(value) : Array.from(value);
  if (values.length !== size) {
    throw new InvalidInputError(
      `box bound has ${values.length} values, shape [${shape.join(", ")}] needs ${size}`,
    );
  }
  return encodeTensor(Tensor.from(dtype, shape, values));
}

/** Builders for the Space messages a Hello declares (the spaces of ONE agent). */
export const spaces = {
  /** gymnasium.spaces.Box; a number for `low`/`high` applies to every element. */
  box(low: Numbers, high: Numbers, shape: readonly number[], dtype: DTypeName = "float32"): Space {
    return {
      box: {
        dtype: wireDType(dtype) as never,
        shape: [...shape],
        low: bounds(low, shape, dtype),
        high: bounds(high, shape, dtype),
      },
    };
  },
  /** gymnasium.spaces.Discrete: one integer in [start, start + n). */
  discrete(n: number, { start = 0, dtype = "int64" as DTypeName } = {}): Space {
    return { discrete: { n, start, dtype: wireDType(dtype) as never } };
  },
  /** gymnasium.spaces.MultiDiscrete (1-d nvec). */
  multiDiscrete(
    nvec: readonly number[],
    { start, dtype = "int64" as DTypeName }: { start?: readonly number[]; dtype?: DTypeName } = {},
  ): Space {
    const shape = [nvec.length];
    return {
      multiDiscrete: {
        nvec: encodeTensor(Tensor.from("int64", shape, nvec)),
        start: encodeTensor(Tensor.from("int64", shape, start ?? new Array<number>(nvec.length).fill(0))),
        dtype: wireDType(dtype) as never,
      },
    };
  },
  /** gymnasium.spaces.MultiBinary (int8 0/1 elements). */
  multiBinary(shape: number | readonly number[]): Space {
    return { multiBinary: { shape: typeof shape === "number" ? [shape] : [...shape] } };
  },
  /** gymnasium.spaces.Dict, keys in the given order. */
  dict(entries: Record<string, Space>): Space {
    return { dict: { spaces: Object.entries(entries).map(([name, space]) => ({ name, space })) } };
  },
  /** gymnasium.spaces.Tuple. */
  tuple(items: readonly Space[]): Space {
    return { tuple: { spaces: [...items] } };
  },
  /** gymnasium.spaces.Text (an empty charset means gymnasium's alphanumeric default). */
  text(maxLength: number, { minLength = 1, charset = "" } = {}): Space {
    return { text: { maxLength, minLength, charset } };
  },
};

/** dtype and per-agent shape of a leaf space (Box, Discrete, MultiDiscrete, MultiBinary). */
export function leafOf(space: Space): { dtype: DTypeName; shape: number[] } | undefined {
  const dtype = (wire: unknown, fallback: DTypeName): DTypeName => dtypeOf(String(wire ?? "")) ?? fallback;
  if (space.box)
    return { dtype: dtype(space.box.dtype, "float32"), shape: (space.box.shape ?? []).map(Number) };
  if (space.discrete) return { dtype: dtype(space.discrete.dtype, "int64"), shape: [] };
  if (space.multiDiscrete) {
    const nvec = space.multiDiscrete.nvec;
    return { dtype: dtype(space.multiDiscrete.dtype, "int64"), shape: (nvec?.shape ?? []).map(Number) };
  }
  if (space.multiBinary) return { dtype: "int8", shape: (space.multiBinary.shape ?? []).map(Number) };
  return undefined;
}

/**
 * What a game hands over for one tick (`values`: N agents' worth, nested like `space`) as a
 * Tree ready to encode. A leaf takes a Tensor (sent as it is: the server checks it) or numbers
 * in agent-major order, flat or nested (N x sample shape), converted to the space's dtype. Dict
 * spaces take an object with the same keys, Tuple spaces an array, Text spaces N strings.
 * Throws InvalidInputError naming `name` (the field) when the values cannot fill the batch.
 */
export function batchOf(space: Space, values: unknown, n: number, name: string): Tree {
  if (values instanceof Tensor) return values;
  const leaf = leafOf(space);
  if (leaf !== undefined) {
    if (!Array.isArray(values) && !ArrayBuffer.isView(values)) {
      throw new InvalidInputError(
        `${name}: expected a Tensor or an array of numbers, got ${typeof values}`,
        name,
      );
    }
    const shape = [n, ...leaf.shape];
    const flat = Array.isArray(values)
      ? values.flat(Infinity)
      : Array.from(values as unknown as ArrayLike<number>);
    const size = shape.reduce((a, b) => a * b, 1);
    if (flat.length !== size) {
      throw new InvalidInputError(
        `${name}: ${flat.length} values, expected ${size} (${n} agents x shape [${leaf.shape.join(", ")}])`,
        name,
      );
    }
    return Tensor.from(leaf.dtype, shape, flat);
  }
  if (space.dict) {
    const object = values as Record<string, unknown>;
    const keys = (space.dict.spaces ?? []).map((s) => s.name ?? "");
    const got =
      values !== null && typeof values === "object" && !Array.isArray(values) ? Object.keys(object) : [];
    if (got.length !== keys.length || !keys.every((k) => k in object)) {
      throw new InvalidInputError(
        `${name}: expected an object with keys [${keys.join(", ")}], got [${got.join(", ")}]`,
        name,
      );
    }
    const out: { [key: string]: Tree } = {};
    for (const entry of space.dict.spaces ?? []) {
      const key = entry.name ?? "";
      out[key] = batchOf(entry.space ?? {}, object[key], n, `${name}.${key}`);
    }
    return out;
  }
  if (space.tuple) {
    const items = space.tuple.spaces ?? [];
    if (!Array.isArray(values) || values.length !== items.length) {
      throw new InvalidInputError(`${name}: expected an array of ${items.length} items`, name);
    }
    return items.map((s, i) => batchOf(s, values[i], n, `${name}[${i}]`));
  }
  if (space.text) {
    if (!Array.isArray(values) || values.length !== n || !values.every((v) => typeof v === "string")) {
      throw new InvalidInputError(`${name}: expected ${n} strings`, name);
    }
    return values as string[];
  }
  throw new InvalidInputError(`${name}: empty Space (no kind set)`, name);
}
