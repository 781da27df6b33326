/**
 * conformance/validity.json: validity studies (N = 2 and 3; sketch, histogram, l1, gram and
 * moments) from their noisy ring vectors to what each server receives: the plan, digits, helpers'
 * seeds, binding, joint randomness, proofs and the leader's shares, from the client key; a gram
 * or moments study's also from its rows (clipping, proved scale, two noise blocks, witness).
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { Keystream } from "../src/keystream.js";
import { sha256 } from "@noble/hashes/sha2.js";
import { ascii, hex, unhex } from "../src/bytes.js";
import { encodeNoisy } from "../src/batch.js";
import { mapper } from "../src/features.js";
import { provedScale, studyId, validateStudy, width, type Study } from "../src/study.js";
import type { NormBound } from "../src/validity/flp.js";
import { GramNorm, hypot } from "../src/validity/gram.js";
import { validityPlan, proveBatch, witnessRows } from "../src/validity/study.js";
import { prepareBlocks } from "../src/parties.js";
import { vectors } from "./helpers.js";

for (const v of vectors("validity.json")) {
  if (v.type === "validity_parties_study") {
    // a study with parties and validity (docs/validity.md section 13): this client validates the
    // study and refuses, clearly and before any request, to prepare its blocks (it cannot prove them)
    test(`validity.json ${v.id}: a study with parties is refused for blocks, not sent unproved`, () => {
      const study = v.study as Study;
      validateStudy(study);
      assert.equal(studyId(study), v.study_id);
      for (const p of v.parties) {
        const rows = (v.rows as number[][]).map((r) => r.slice(p.index === 0 ? 0 : 1, p.index === 0 ? 1 : 3));
        assert.throws(() => prepareBlocks(study, v.study_id, p.party, v.pseudonyms.map(unhex), rows, new Uint8Array(32)),
                      /does not prove a party's blocks yet; submit them with the Python SDK/);
      }
      assert.throws(() => validityPlan(study), /not yet available for a study with parties/);
    });
    continue;
  }
  if (v.plan.circuit === "GramNorm") {
    // a gram or moments study (circuit GramNorm, docs/validity.md section 12): from the rows
    // themselves, the clipped rows, the proved scale, the noise in two blocks, the witness and the
    // noise e = u - psi(r) (the vector's noise keystream key is the generator's,
    // scripts/make_validity_vectors.py: SHA-256("dpsketch/validity-vector/1/" || id || "/noise"))
    test(`validity.json ${v.id}: gram plan, rows to noisy features, witness`, () => {
      const study = v.study as Study;
      const plan = validityPlan(study);
      const c = plan.circuit as GramNorm;
      assert.ok(c instanceof GramNorm);
      assert.equal(plan.tUpper, v.plan.t_upper);
      assert.equal(c.lin, BigInt(v.plan.lin));
      assert.equal(c.countUnit, BigInt(v.plan.count_unit));
      assert.equal(c.r2Row, BigInt(v.plan.r2_row));
      assert.equal(c.qRow, v.plan.q_row);
      assert.equal(c.halfRow, BigInt(v.plan.H_row));
      assert.equal(c.rowSlackDigits, v.plan.row_slack_digits);
      assert.deepEqual(provedScale(study), v.proved_scale);
      const mp = mapper(study);
      const clipped = v.rows.map((r: number[]) => mp.clipped(r));
      assert.deepEqual(clipped, v.clipped);
      const witness = witnessRows(plan, clipped);
      assert.deepEqual(witness.map((r) => r.map(Number)), v.witness);
      const ks = new Keystream(sha256(ascii(`dpsketch/validity-vector/1/${v.id}/noise`)));
      const W = width(study);
      const { noisy } = encodeNoisy(study, clipped.map((a: number[]) => mp.features(a)), null, ks, W);
      assert.deepEqual(Array.from(noisy, String), v.encoded.flat());
      const units = witness.map((r, i) => {
        const psi = c.features(r);
        return psi.map((p, j) => Number(BigInt.asIntN(64, noisy[i * W + j]) / (1n << BigInt(plan.shift)) - p));
      });
      assert.deepEqual(units, v.units);
    });
  }
  test(`validity.json ${v.id}`, () => {
    const study = v.study as Study;
    assert.equal(studyId(study), v.study_id);
    const plan = validityPlan(study);
    assert.equal(plan.shift, v.plan.grid_shift);
    assert.equal(plan.t, v.plan.t);
    assert.equal(plan.r2, BigInt(v.plan.r2));
    assert.equal(plan.q, v.plan.q);
    assert.equal(plan.circuit.half, BigInt(v.plan.H));
    assert.equal(plan.circuit.slackDigits, v.plan.slack_digits);
    assert.equal(plan.circuit.inputLen, v.plan.input_len);
    assert.equal(plan.circuit.proofLen, v.plan.proof_len);
    assert.equal(plan.circuit.verifierLen, v.plan.verifier_len);
    assert.equal(plan.leaderWidth, v.plan.leader_width);
    const noisy = BigUint64Array.from(v.encoded.flat().map((x: string) => BigInt(x)));
    const ks = new Keystream(unhex(v.client_key));
    const b = proveBatch(study, v.study_id, plan, noisy, ks, v.full, v.onehot, v.clipped ?? null);
    if (v.plan.unit !== null) assert.equal((plan.circuit as NormBound).oneHot!.unit, BigInt(v.plan.unit));
    if (v.plan.blocks !== null) assert.deepEqual((plan.circuit as NormBound).oneHot!.blocks, v.plan.blocks);
    assert.deepEqual(b.inputs.map((r) => r.map(String)), v.input);
    assert.deepEqual(b.reportIds.map(hex), v.report_ids);
    b.servers.forEach((s, j) => {
      assert.equal(hex(Uint8Array.from(s.proofs.flatMap((p) => Array.from(p)))), v.binding[j], `binding ${j}`);
      if (j !== v.full) assert.equal(hex(Uint8Array.from(s.payloads.flatMap((p) => Array.from(p)))), v.helper_seeds[String(j)], `seeds ${j}`);
    });
    assert.deepEqual(b.proofs.map((r) => r.map(String)), v.proof);
    const leader = b.servers[v.full].payloads.map((p) => {
      const dv = new DataView(p.buffer, p.byteOffset, p.length);
      return Array.from({ length: p.length / 8 }, (_, k) => dv.getBigUint64(8 * k, true).toString());
    });
    assert.deepEqual(leader, v.leader);
  });
}

test("hypot is Python's math.hypot (correctly rounded) where Math.hypot is an ulp off", () => {
  // gram residuals hypot(delta, delta (2 B + delta)) and Python 3.11's math.hypot of them (Node
  // 20's Math.hypot misses each by an ulp, and 12,501 of 40,000 such pairs measured); R^2 of a
  // gram study (docs/protocol.md section 4b) depends on this double
  const cases: [number, number, number][] = [
    [0.01295556558732578, 0.25927915842620314, 0.25960263610735473],
    [0.0013810679320049757, 0.0013829752806377882, 0.0019544741644922474],
    [0.3801726581436387, 7.747984412872774, 7.757305828193153],
    [0.09757809372497497, 0.20467767182494995, 0.22674751094263837],
  ];
  for (const [x, y, want] of cases) {
    assert.equal(hypot(x, y), want);
  }
  assert.equal(hypot(0, 0.5), 0.5);
  assert.equal(hypot(3, 4), 5);
});

test("validateStudy accepts validity on every kind, with parties too, and refuses it without client noise", () => {
  const studies = vectors("validity.json").map((v) => v.study as Study);
  assert.deepEqual([...new Set(studies.map((s) => s.kind))].sort(), ["gram", "histogram", "l1", "moments", "sketch"]);
  for (const s of studies) validateStudy(s);
  assert.ok(studies.some((s) => s.parties));
  const sketch = studies.find((s) => s.kind === "sketch")!;
  assert.throws(() => validateStudy({ ...sketch, sigma: 0 }), /validity/);
});
