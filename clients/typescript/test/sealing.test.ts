/**
 * Sealing: the two version 4 batches of docs/protocol.md section 9 (`sealed_v4`) byte for byte,
 * conformance/sealing.json's key ids, decapsulations and key schedules, and a round trip through
 * the HPKE libraries of each suite (the X-Wing module's combiner against the vectors' bytes).
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { webcrypto } from "node:crypto";
import { CipherSuite } from "@hpke/core";
import { Chacha20Poly1305 } from "@hpke/chacha20poly1305";
import { HkdfSha256 } from "@hpke/dhkem-x25519";
import { XWing } from "@hpke/hybridkem-x-wing";
import { MlKem768 } from "mlkem";
import { sha3_256, shake256 } from "@noble/hashes/sha3.js";
import { concat, hex, unhex } from "../src/bytes.js";
import { CONTENT_BLOCK, CONTENT_BLOCK_SEED, fixedHeader, info, prefix, seal, type SealInput } from "../src/sealing/v4.js";
import { pseudonym } from "../src/parties.js";
import { currentKey, keyId, suite, type SuiteName } from "../src/sealing/suites.js";
import { section9, vectors } from "./helpers.js";

const LABEL = Uint8Array.from([0x5c, 0x2e, 0x2f, 0x2f, 0x5e, 0x5c]);

async function x25519(sk: Uint8Array, pk: Uint8Array): Promise<Uint8Array> {
  const pkcs8 = concat(unhex("302e020100300506032b656e04220420"), sk);
  const priv = await webcrypto.subtle.importKey("pkcs8", pkcs8, { name: "X25519" }, false, ["deriveBits"]);
  const pub = await webcrypto.subtle.importKey("raw", pk, { name: "X25519" }, false, []);
  return new Uint8Array(await webcrypto.subtle.deriveBits({ name: "X25519", public: pub } as any, priv, 256));
}

const BASE = (() => {
  const b = new Uint8Array(32);
  b[0] = 9;
  return b;
})();

/** docs/sealing.md section 2's Decap with the 96-byte stored key d || z || sk_X. */
async function xwingDecap96(sk: Uint8Array, enc: Uint8Array) {
  const m = new MlKem768();
  const [, dk] = await m.deriveKeyPair(sk.subarray(0, 64));
  const ctM = enc.subarray(0, 1088), ctX = enc.subarray(1088);
  const ssM = await m.decap(ctM, dk);
  const skX = sk.subarray(64, 96);
  const ssX = await x25519(skX, ctX);
  const pkX = await x25519(skX, BASE);
  return { ssM, ssX, pkX, ctX, ss: sha3_256(concat(ssM, ssX, ctX, pkX, LABEL)) };
}

for (const v of section9().sealed_v4) {
  test(`sealed_v4 ${v.suite}: every deterministic byte of the batch`, async () => {
    const name = v.suite as SuiteName;
    const pk = unhex(v.public_key);
    assert.equal(keyId(pk), v.key_id);
    const key = { suite: name, keyId: v.key_id, publicKey: pk };
    const inp: SealInput = {
      studyId: v.study_id,
      serverId: v.server_id,
      key,
      content: v.content,
      reportIds: v.records.map((r: any) => unhex(r.report_id)),
      plaintexts: v.records.map((r: any) => unhex(r.plaintext)),
    };
    const fixed = fixedHeader(inp, unhex(v.batch_id));
    assert.equal(hex(fixed), v.fixed);
    assert.equal(hex(info(inp, fixed)), v.info);
    const body = await seal(inp, { batchId: unhex(v.batch_id), secret: unhex(v.secret), sealedSecret: unhex(v.sealed_secret) });
    assert.equal(hex(body), v.body);
    // a fresh seal has the documented length: 85 + Nenc + count (16 + 16 + len(plaintext))
    const fresh = await seal(inp);
    assert.equal(fresh.length, 101 + suite(name).encBytes + inp.plaintexts.reduce((a, p) => a + 16 + p.length, 0));
  });
}

test("sealed_v4 classical: the vector's sealed secret opens with the library to its secret", async () => {
  const v = section9().sealed_v4.find((x: any) => x.suite === "classical");
  const s = suite("classical");
  const recipientKey = await s.hpke.kem.importKey("raw", unhex(v.private_key).buffer as ArrayBuffer, false);
  const ss = unhex(v.sealed_secret);
  const pt = await s.hpke.open({ recipientKey, enc: ss.slice(0, 32).buffer, info: unhex(v.info).buffer }, ss.slice(32).buffer);
  assert.equal(hex(new Uint8Array(pt)), v.secret);
});

test("sealing.json: key generation and key ids", async () => {
  for (const v of vectors("sealing.json").filter((x) => x.type === "kem_keygen")) {
    const sk = unhex(v.private_key);
    if (v.suite === "classical") {
      assert.equal(hex(await x25519(sk, BASE)), v.public_key, v.id);
    } else {
      const [pkM] = await new MlKem768().deriveKeyPair(sk.subarray(0, 64));
      assert.equal(hex(concat(pkM, await x25519(sk.subarray(64), BASE))), v.public_key, v.id);
      if (v.xwing_seed) {
        assert.equal(hex(shake256(unhex(v.xwing_seed), { dkLen: 96 })), v.private_key, v.id);
        // the X-Wing module's key from the same seed is the same public key
        const kp = await new XWing().generateKeyPairDerand(unhex(v.xwing_seed));
        assert.equal(hex(new Uint8Array(await new XWing().serializePublicKey(kp.publicKey))), v.public_key, v.id);
      }
    }
    assert.equal(keyId(unhex(v.public_key)), v.key_id, v.id);
  }
});

test("sealing.json: decapsulations (X25519 and X-Wing with implicit rejection)", async () => {
  for (const v of vectors("sealing.json").filter((x) => x.type === "kem_decapsulation")) {
    const sk = unhex(v.private_key), enc = unhex(v.enc);
    if (v.suite === "classical") {
      assert.equal(hex(await x25519(sk, enc)), v.dh, v.id);
      const s = suite("classical");
      const recipientKey = await s.hpke.kem.importKey("raw", sk.buffer as ArrayBuffer, false);
      const ss = await s.hpke.kem.decap({ enc: enc.buffer, recipientKey });
      assert.equal(hex(new Uint8Array(ss)), v.shared_secret, v.id);
    } else {
      const r = await xwingDecap96(sk, enc);
      assert.equal(hex(r.ssM), v.ss_m, v.id);
      assert.equal(hex(r.ssX), v.ss_x, v.id);
      assert.equal(hex(r.pkX), v.pk_x, v.id);
      assert.equal(hex(r.ctX), v.ct_x, v.id);
      assert.equal(hex(r.ss), v.shared_secret, v.id);
    }
  }
});

/** A KEM that hands @hpke/core a given shared secret: the key schedule alone, on the vectors. */
function fixedKem(kemId: number, encSize: number, ss: Uint8Array): any {
  const base = suite(kemId === 0x20 ? "classical" : "post-quantum").hpke.kem;
  return {
    id: kemId, secretSize: 32, encSize, publicKeySize: base.publicKeySize, privateKeySize: base.privateKeySize,
    decap: async () => ss.slice().buffer,
    importKey: base.importKey.bind(base),
  };
}

test("sealing.json: the HPKE key schedule of both suites opens the vectors", async () => {
  for (const v of vectors("sealing.json").filter((x) => x.type === "hpke_open")) {
    const hp = new CipherSuite({ kem: fixedKem(v.kem_id, v.kem_id === 0x20 ? 32 : 1120, unhex(v.shared_secret)), kdf: new HkdfSha256(), aead: new Chacha20Poly1305() });
    const pt = await hp.open({ recipientKey: {} as any, enc: new Uint8Array(v.kem_id === 0x20 ? 32 : 1120).buffer, info: unhex(v.info).buffer }, unhex(v.ciphertext).buffer, unhex(v.aad).buffer);
    assert.equal(hex(new Uint8Array(pt)), v.plaintext, v.id);
  }
});

test("X-Wing module and the document agree: the module's encapsulation decapsulates with the 96-byte key", async () => {
  const v = vectors("sealing.json").find((x) => x.id === "keygen-post-quantum-from-xwing-seed")!;
  const xw = new XWing();
  const pub = await xw.deserializePublicKey(unhex(v.public_key).buffer as ArrayBuffer);
  const { sharedSecret, enc } = await xw.encap({ recipientPublicKey: pub });
  const r = await xwingDecap96(unhex(v.private_key), new Uint8Array(enc));
  assert.equal(hex(r.ss), hex(new Uint8Array(sharedSecret)));
});

test("currentKey refuses a key id that does not match, a missing version, a shared key", () => {
  const pk = unhex("8f40c5adb68f25624ae5b214ea767a6ec94d829d3d7b5e1ad1ba6f3e2138285f");
  const good = { kem_id: 32, current: keyId(pk), keys: [{ key_id: keyId(pk), public_key: hex(pk) }], versions: [4] };
  assert.equal(currentKey(good, "classical", 4).keyId, "eedd883da0a94515");
  assert.throws(() => currentKey({ ...good, versions: [3] }, "classical", 4), /version 4/);
  assert.throws(() => currentKey({ ...good, keys: [{ key_id: keyId(pk), public_key: hex(pk).replace(/^8f/, "8e") }] }, "classical", 4), /does not match/);
  assert.throws(() => currentKey(good, "post-quantum", 4), /no post-quantum/);
});

test("sealing.json sealed-blocks-classical: a party's sealed blocks byte for byte (docs/sealing.md 3a)", async () => {
  const v = vectors("sealing.json").find((x) => x.type === "sealed_blocks")!;
  const pk = unhex(v.public_key);
  const key = { suite: "classical" as SuiteName, keyId: keyId(pk), publicKey: pk };
  for (const r of v.records) assert.equal(hex(pseudonym(unhex(v.party_key), v.study_id, r.individual)), r.pseudonym);
  const inp: SealInput = {
    studyId: v.study_id,
    serverId: v.server_id,
    key,
    content: CONTENT_BLOCK,
    party: v.party_index,
    reportIds: v.records.map((r: any) => unhex(r.block_id)),
    plaintexts: v.records.map((r: any) => concat(unhex(r.pseudonym), unhex(r.proof), unhex(r.share))),
  };
  const fixed = fixedHeader(inp, unhex(v.batch_id));
  assert.equal(hex(fixed), v.fixed);
  assert.equal(hex(prefix(v.study_id, v.server_id, v.party_index)), v.context);
  assert.equal(hex(info(inp, fixed)), v.info);
  const body = await seal(inp, { batchId: unhex(v.batch_id), secret: unhex(v.secret), sealedSecret: unhex(v.sealed_secret) });
  assert.equal(hex(body), v.body);
  // a block batch must name its party, and only a block batch may
  await assert.rejects(seal({ ...inp, party: undefined }), /names its party/);
  await assert.rejects(seal({ ...inp, content: 0x01 }), /names its party/);
  const fresh = await seal(inp);
  assert.equal(fresh.length, 101 + 32 + inp.plaintexts.reduce((a, p) => a + 16 + p.length, 0));
});

test("a validity study's helper seals its block seeds as content 0x04, naming its party (docs/sealing.md 3a)", async () => {
  const v = vectors("sealing.json").find((x) => x.type === "sealed_blocks")!;
  const pk = unhex(v.public_key);
  const key = { suite: "classical" as SuiteName, keyId: keyId(pk), publicKey: pk };
  const N = 2;
  const inp: SealInput = {
    studyId: v.study_id, serverId: v.server_id, key, content: CONTENT_BLOCK_SEED, party: v.party_index,
    reportIds: v.records.map((r: any) => unhex(r.block_id)),
    plaintexts: v.records.map((r: any) => concat(unhex(r.pseudonym), new Uint8Array(16 * N), new Uint8Array(32).fill(7))),
  };
  const fixed = fixedHeader(inp, unhex(v.batch_id));
  const blockFixed = fixedHeader({ ...inp, content: CONTENT_BLOCK }, unhex(v.batch_id));
  assert.equal(fixed[32], 0x04);
  assert.deepEqual([...fixed.subarray(0, 32), ...fixed.subarray(33)], [...blockFixed.subarray(0, 32), ...blockFixed.subarray(33)]);
  assert.equal(hex(prefix(v.study_id, v.server_id, v.party_index)), v.context);
  const body = await seal(inp);
  // as long as the plaintext block-seeds body (64 + 16 N bytes a record) plus the header and tag
  assert.equal(body.length, 101 + 32 + inp.reportIds.length * (64 + 16 * N));
  await assert.rejects(seal({ ...inp, party: undefined }), /names its party/);
});
