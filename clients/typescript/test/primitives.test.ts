/**
 * primitives.ts: the Node (OpenSSL) SHA-256 and ChaCha20 are @noble's bytes, on lengths around
 * block edges, counters 0, 1 and large, and a multi-block buffer; a fixed-seed generator makes the
 * inputs (deterministic). And rowIds' one-block SHA-256 against SHA-256.
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { chacha20, chacha20Noble, nativePrimitives, sha256, sha256Noble } from "../src/primitives.js";
import { ROW_DOMAIN, rowIds } from "../src/validity/batch_validity.js";

function bytes(n: number, seed: number): Uint8Array {
  const out = new Uint8Array(n);
  let s = seed >>> 0 || 1;
  for (let i = 0; i < n; i++) {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    out[i] = s & 255;
  }
  return out;
}

test("Node's primitives are in use under Node", () => {
  assert.equal(nativePrimitives, true);
});

test("sha256 is noble's sha256", () => {
  for (const n of [0, 1, 55, 56, 63, 64, 65, 119, 120, 1000, 1 << 20]) {
    const d = bytes(n, n + 1);
    assert.deepEqual(sha256(d), sha256Noble(d), `${n} bytes`);
    // a view into a larger buffer
    const big = bytes(n + 9, 7);
    assert.deepEqual(sha256(big.subarray(5, 5 + n)), sha256Noble(big.subarray(5, 5 + n)));
  }
});

test("chacha20 is noble's chacha20 (zeros and data, counters 0, 1, 2^31; near 2^32 refused)", () => {
  const key = bytes(32, 3), nonce = bytes(12, 4);
  for (const n of [0, 1, 63, 64, 65, 640, 4096 * 129, 100_000]) {
    for (const counter of [0, 1, 2 ** 31]) {
      for (const data of [new Uint8Array(n), bytes(n, n)]) {
        assert.deepEqual(chacha20(key, nonce, data, counter), chacha20Noble(key, nonce, data, counter), `${n} bytes at ${counter}`);
      }
    }
  }
  // a counter running into 2^32: refused as noble refuses it
  assert.throws(() => chacha20Noble(key, nonce, new Uint8Array(192), 2 ** 32 - 2));
  assert.throws(() => chacha20(key, nonce, new Uint8Array(192), 2 ** 32 - 2));
});

test("rowIds' one-block SHA-256 is SHA-256 of the row's message", () => {
  const bid = bytes(16, 11);
  const ids = rowIds(bid, 70_000);
  const dv = new DataView(new ArrayBuffer(4));
  for (const i of [0, 1, 255, 256, 2999, 65_535, 65_536, 69_999]) {
    dv.setUint32(0, i, true);
    const msg = new Uint8Array([...ROW_DOMAIN, ...bid, ...new Uint8Array(dv.buffer)]);
    assert.deepEqual(ids[i], sha256Noble(msg).subarray(0, 16), `row ${i}`);
  }
});
