/**
 * conformance/flp.json: NormBound(w = 3, beta = 4, q = 3, R^2 = 200) reports through the
 * client's part of docs/validity.md: digits, joint randomness, proof, helper and leader shares.
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { unhex } from "../src/bytes.js";
import { NormBound, jointRand, prove, expandShare } from "../src/validity/flp.js";
import { sub } from "../src/validity/field.js";
import { vectors } from "./helpers.js";

const s = (xs: bigint[]) => xs.map(String);

for (const v of vectors("flp.json")) {
  test(`flp.json ${v.id}`, () => {
    const c = new NormBound(3, 4, 3, 200n);
    const valid = v.x.reduce((a: number, x: number) => a + x * x, 0) <= 200;
    if (valid) assert.deepEqual(s(c.encode(v.x.map(BigInt))), v.input, v.id);
    else assert.throws(() => c.encode(v.x.map(BigInt)), /exceeds/);
    const input = v.input.map(BigInt);
    const jr = jointRand(c, unhex(v.report_id));
    assert.deepEqual(jr.map((p) => s(p)), v.joint_rand, v.id);
    const proof = prove(c, input, jr, v.prove_rand.map(BigInt));
    assert.equal(proof.length, c.proofLen);
    assert.deepEqual(s(proof), v.proof, v.id);
    let leaderIn: bigint[] = input, leaderProof: bigint[] = proof;
    v.helper_seeds.forEach((seed: string, h: number) => {
      const e = expandShare(c, unhex(seed));
      assert.deepEqual(s(e.input), v.helper_input_shares[h], v.id);
      assert.deepEqual(s(e.proof), v.helper_proof_shares[h], v.id);
      leaderIn = leaderIn.map((x, i) => sub(x, e.input[i]));
      leaderProof = leaderProof.map((x, i) => sub(x, e.proof[i]));
    });
    assert.deepEqual(s(leaderIn), v.leader_input_share, v.id);
    assert.deepEqual(s(leaderProof), v.leader_proof_share, v.id);
  });
}
