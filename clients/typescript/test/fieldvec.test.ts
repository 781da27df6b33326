/**
 * fieldvec.ts's typed-array kernels against field.ts's BigInt reference: edge values (0, 1,
 * p - 1, 2^32, 2^32 - 1, ...) pairwise and seeded random vectors (a fixed xorshift seed: the
 * test is deterministic), NTT round trips and the BigInt NTT, and the seeded expansions.
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { add, expand, inv, mul, P, sub, type Fp } from "../src/validity/field.js";
import { intt, ntt, rootOfUnity } from "../src/validity/ntt.js";
import {
  addVec, expandVec, extendVec, fromVec, getBig, mulAddAt, mulScalar, mulVec, scaleVec, setBig, subVec, toVec, transformVec, vec, vecBytes,
} from "../src/validity/fieldvec.js";
import { u64sToBytes } from "../src/bytes.js";

const EDGES: Fp[] = [0n, 1n, 2n, 7n, P - 1n, P - 2n, (P - 1n) / 2n, (P + 1n) / 2n, 1n << 32n, (1n << 32n) - 1n, (1n << 32n) + 1n,
  (1n << 63n), (1n << 63n) - 1n, P - (1n << 32n), 0xffffffffn << 32n, (0xffffffffn << 32n) - 1n, 0xfffffffen << 32n, 1n << 16n,
  0xffffn, 0x1234567890abcdefn % P];

/** A fixed-seed xorshift64* stream of elements < p. */
function rng(seed: bigint): () => Fp {
  let s = seed;
  const m = (1n << 64n) - 1n;
  return () => {
    for (;;) {
      s ^= s >> 12n;
      s ^= (s << 25n) & m;
      s ^= s >> 27n;
      const x = (s * 0x2545f4914f6cdd1dn) & m;
      if (x < P) return x;
    }
  };
}

const pairs = (() => {
  const a: Fp[] = [], b: Fp[] = [];
  for (const x of EDGES) for (const y of EDGES) {
    a.push(x);
    b.push(y);
  }
  const r = rng(0x9e3779b97f4a7c15n);
  for (let i = 0; i < 4000; i++) {
    a.push(r());
    b.push(r());
  }
  return { a, b };
})();

test("toVec, fromVec, getBig, setBig and vecBytes round trip", () => {
  const v = toVec(pairs.a);
  assert.deepEqual(fromVec(v), pairs.a);
  for (let i = 0; i < 50; i++) assert.equal(getBig(v, i), pairs.a[i]);
  const w = vec(EDGES.length);
  EDGES.forEach((x, i) => setBig(w, i, x));
  assert.deepEqual(fromVec(w), EDGES);
  assert.deepEqual(vecBytes(v), u64sToBytes(pairs.a));
});

test("add, sub, mul, scale and mulAdd match BigInt on edge values and random elements", () => {
  const { a, b } = pairs;
  const va = toVec(a), vb = toVec(b);
  assert.deepEqual(fromVec(addVec(vec(a.length), va, vb)), a.map((x, i) => add(x, b[i])));
  assert.deepEqual(fromVec(subVec(vec(a.length), va, vb)), a.map((x, i) => sub(x, b[i])));
  assert.deepEqual(fromVec(mulVec(vec(a.length), va, vb)), a.map((x, i) => mul(x, b[i])));
  for (const s of EDGES) assert.deepEqual(fromVec(scaleVec(vec(a.length), va, s)), a.map((x) => mul(x, s)));
  for (let i = 0; i < a.length; i++) assert.equal(mulScalar(a[i], b[i]), mul(a[i], b[i]));
  // in place: out aliasing an input
  const c = toVec(a);
  mulVec(c, c, vb);
  assert.deepEqual(fromVec(c), a.map((x, i) => mul(x, b[i])));
  const acc = toVec([P - 1n]);
  let ref = P - 1n;
  for (let i = 0; i < 300; i++) {
    mulAddAt(acc, 0, va, i, vb, i);
    ref = add(ref, mul(a[i], b[i]));
  }
  assert.equal(getBig(acc, 0), ref);
});

test("transformVec is the BigInt NTT and its inverse, sizes 1 to 256", () => {
  const r = rng(42n);
  for (let n = 1; n <= 256; n *= 2) {
    const a = Array.from({ length: n }, r);
    const w = rootOfUnity(n);
    assert.deepEqual(fromVec(transformVec(toVec(a), w)), ntt(a, n));
    assert.deepEqual(intt(fromVec(transformVec(toVec(a), w))), a);
  }
});

test("expandVec is expand", () => {
  const key = new Uint8Array(32).map((_, i) => i * 7);
  const nonce = new Uint8Array(12).fill(3);
  for (const n of [0, 1, 7, 8, 9, 100, 1000]) assert.deepEqual(fromVec(expandVec(key, n, nonce)), expand(key, n, nonce));
});

test("extendVec is intt then a zero-padded ntt on the larger domain", () => {
  const r = rng(7n);
  for (const [n, N] of [[1, 1], [1, 4], [2, 4], [4, 4], [8, 16], [16, 64], [64, 128]]) {
    const a = Array.from({ length: n }, r);
    const want = ntt(intt(a), N);
    assert.deepEqual(fromVec(extendVec(toVec(a), N, rootOfUnity(n), inv(rootOfUnity(n)), rootOfUnity(N), inv(BigInt(n)))), want, `${n} -> ${N}`);
  }
});

test("mul matches BigInt on elements built from edge halves (0, 1, 2^31, 2^32 - 2, 2^32 - 1, random)", () => {
  const r = rng(2026n);
  const halves = (): bigint => {
    const pick = Number(r() % 6n);
    return [0n, 1n, 1n << 31n, 0xfffffffen, 0xffffffffn, r() & 0xffffffffn][pick];
  };
  const a: Fp[] = [], b: Fp[] = [];
  while (a.length < 20000) {
    const x = (halves() << 32n) | halves(), y = (halves() << 32n) | halves();
    if (x < P && y < P) {
      a.push(x);
      b.push(y);
    }
  }
  assert.deepEqual(fromVec(mulVec(vec(a.length), toVec(a), toVec(b))), a.map((x, i) => mul(x, b[i])));
  assert.deepEqual(fromVec(addVec(vec(a.length), toVec(a), toVec(b))), a.map((x, i) => add(x, b[i])));
  assert.deepEqual(fromVec(subVec(vec(a.length), toVec(a), toVec(b))), a.map((x, i) => sub(x, b[i])));
  // the butterfly's inlined product: a transform of these values is the BigInt NTT
  const n = 1024, w = rootOfUnity(n);
  assert.deepEqual(fromVec(transformVec(toVec(a.slice(0, n)), w)), ntt(a.slice(0, n), n));
});
