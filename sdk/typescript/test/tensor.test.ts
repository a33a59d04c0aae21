// Tensors, trees and spaces without a server: what goes on the wire and what errors say.
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  InvalidInputError,
  Tensor,
  batchOf,
  decodeTensor,
  decodeTree,
  encodeTensor,
  encodeTree,
  leafOf,
  spaces,
} from "../src/index.js";
import type { TensorMessageOut, TensorTreeMessageOut } from "../src/proto.js";

// The wire form as the loader hands it over on receipt (a Buffer, numeric shape, enum names).
function received(tensor: Tensor): TensorMessageOut {
  const msg = encodeTensor(tensor);
  return {
    dtype: msg.dtype as TensorMessageOut["dtype"],
    shape: msg.shape!.map(Number),
    data: Buffer.from(msg.data as Buffer),
  };
}

test("float32 encodes as little-endian row-major bytes", () => {
  const msg = encodeTensor(
    Tensor.from(
      "float32",
      [2, 2],
      [
        [1, 2],
        [3, 4.5],
      ],
    ),
  );
  assert.equal(msg.dtype, "D_TYPE_FLOAT32");
  assert.deepEqual(msg.shape, [2, 2]);
  const bytes = msg.data as Buffer;
  assert.equal(bytes.length, 16);
  assert.equal(bytes.readFloatLE(12), 4.5);
  assert.equal(bytes.readFloatLE(4), 2);
});

test("every dtype round-trips", () => {
  const cases: [Parameters<typeof Tensor.from>[0], unknown[]][] = [
    ["float32", [1.5, -2]],
    ["float64", [1e300, -0.25]],
    ["int8", [-128, 127]],
    ["int16", [-300, 300]],
    ["int32", [-70000, 70000]],
    ["int64", [-(2 ** 40), 3n]],
    ["uint8", [0, 255]],
    ["uint16", [0, 65535]],
    ["uint32", [0, 4_000_000_000]],
    ["uint64", [0, 2n ** 63n]],
    ["bool", [true, false]],
    ["float16", [0x3c00, 0]], // raw words: 1.0, 0.0
  ];
  for (const [dtype, values] of cases) {
    const back = decodeTensor(received(Tensor.from(dtype, [2], values)));
    assert.equal(back.dtype, dtype);
    assert.deepEqual(back.shape, [2]);
    assert.deepEqual(
      back.toArray(),
      values.map((v) => Number(v)),
      dtype,
    );
  }
});

test("decoding reads unaligned buffers and checks the byte count", () => {
  const aligned = encodeTensor(Tensor.from("float64", [3], [1, 2, 3])).data as Buffer;
  const unaligned = Buffer.alloc(aligned.length + 1).subarray(1);
  aligned.copy(unaligned);
  assert.deepEqual(
    decodeTensor({ dtype: "D_TYPE_FLOAT64", shape: [3], data: unaligned }).toArray(),
    [1, 2, 3],
  );
  assert.throws(
    () => decodeTensor({ dtype: "D_TYPE_FLOAT64", shape: [4], data: unaligned }, "actions"),
    (err: InvalidInputError) =>
      err.field === "actions" && /24 data bytes do not match shape \[4\]/.test(err.message),
  );
  assert.throws(
    () => decodeTensor({ dtype: "D_TYPE_UNSPECIFIED", shape: [], data: Buffer.alloc(0) }),
    /unsupported dtype/,
  );
});

test("a tensor must fill its shape with the dtype's array type", () => {
  assert.throws(() => new Tensor("float32", [3], new Float32Array(2)), /2 elements do not fill shape \[3\]/);
  assert.throws(
    () => new Tensor("int64", [2], new Float32Array(2) as never),
    /int64 data must be a BigInt64Array/,
  );
});

test("trees: dicts, tuples and text batches round-trip", () => {
  const tree = {
    pos: Tensor.from("float32", [2, 2], [1, 2, 3, 4]),
    pair: [Tensor.from("int64", [2], [0, 1]), ["ab", "c"]],
  };
  const back = decodeTree(
    JSON.parse(JSON.stringify(encodeTree(tree)), revive) as TensorTreeMessageOut,
  ) as typeof tree;
  assert.deepEqual(back.pos.toArray(), [1, 2, 3, 4]);
  assert.deepEqual((back.pair[0] as Tensor).toArray(), [0, 1]);
  assert.deepEqual(back.pair[1], ["ab", "c"]);
  assert.throws(() => decodeTree({} as TensorTreeMessageOut, "actions"), /actions: empty TensorTree/);
});

// JSON turns Buffers into {type: "Buffer", data: [...]}; the loader delivers Buffers and oneof names.
function revive(_key: string, value: unknown): unknown {
  const v = value as Record<string, unknown> | null;
  if (v && v.type === "Buffer" && Array.isArray(v.data)) return Buffer.from(v.data as number[]);
  if (v && typeof v === "object" && !Array.isArray(v)) {
    for (const node of ["tensor", "dict", "tuple", "texts"]) if (node in v) v.node = node;
    if ("shape" in v) v.shape = (v.shape as unknown[]).map(Number);
  }
  return v;
}

test("space builders describe one agent", () => {
  const box = spaces.box(0, 1, [11]);
  assert.equal(box.box!.dtype, "D_TYPE_FLOAT32");
  assert.equal((box.box!.low!.data as Buffer).length, 44);
  assert.deepEqual(leafOf(box), { dtype: "float32", shape: [11] });
  assert.deepEqual(leafOf(spaces.discrete(3)), { dtype: "int64", shape: [] });
  assert.deepEqual(leafOf(spaces.multiDiscrete([3, 4])), { dtype: "int64", shape: [2] });
  assert.deepEqual(leafOf(spaces.multiBinary(5)), { dtype: "int8", shape: [5] });
  assert.throws(() => spaces.box([0, 0], 1, [3]), /2 values, shape \[3\] needs 3/);
});

test("batchOf shapes a tick's values for N agents and names what does not fit", () => {
  const obs = spaces.dict({ features: spaces.box(0, 1, [3]), tag: spaces.text(4) });
  const batch = batchOf(
    obs,
    {
      features: [
        [1, 0, 1],
        [0, 1, 0],
      ],
      tag: ["a", "b"],
    },
    2,
    "observations",
  ) as Record<string, Tensor>;
  assert.deepEqual(batch.features.shape, [2, 3]);
  assert.ok(batch.features.data instanceof Float32Array);
  assert.deepEqual(
    batchOf(spaces.discrete(3), new Float32Array([2, 1]), 2, "a").valueOf() instanceof Tensor,
    true,
  );
  assert.throws(
    () => batchOf(obs, { features: [1, 0, 1], tag: ["a", "b"] }, 2, "observations"),
    (err: InvalidInputError) =>
      err.field === "observations.features" &&
      /3 values, expected 6 \(2 agents x shape \[3\]\)/.test(err.message),
  );
  assert.throws(
    () => batchOf(obs, { features: [] }, 2, "observations"),
    /expected an object with keys \[features, tag\], got \[features\]/,
  );
  assert.throws(
    () => batchOf(spaces.tuple([spaces.discrete(2)]), [], 2, "o"),
    /expected an array of 1 items/,
  );
  // A Tensor passes as it is: the server is the judge of its shape.
  const odd = Tensor.from("float32", [7], new Array(7).fill(0));
  assert.equal(batchOf(spaces.box(0, 1, [3]), odd, 2, "o"), odd);
});
