/**
 * The client's recomputation of a study's promise: every unsigned replace-one study of
 * study_ids.json (designed by the reference to epsilon 1, floor 4) recomputes to at most its
 * targets and within 1e-5 of them, a study whose noise was halved is refused, a signed one is an upper bound.
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { checkPromise, gaussianDelta, replaceOneEpsilon } from "../src/accounting.js";
import type { Study } from "../src/study.js";
import { vectors } from "./helpers.js";

const studies = vectors("study_ids.json").filter((v) => v.type === "study").map((v) => ({ id: v.id, study: v.input as Study }));

for (const { id, study } of studies) {
  test(`accounting ${id}`, () => {
    const eps = replaceOneEpsilon(study, study.lambda_star);
    const floor = replaceOneEpsilon(study, 1);
    if (!study.secret_sign) {
      // at most the target (the study's check, section 2), and within 1e-5 of it (the reference's
      // calibration leaves about 1.1e-6 to spare)
      assert.ok(eps <= study.epsilon * (1 + 1e-9) && eps >= study.epsilon * (1 - 1e-5), `${id}: epsilon ${eps}`);
      assert.ok(floor <= study.epsilon_floor! * (1 + 1e-9) && floor >= study.epsilon_floor! * (1 - 1e-5), `${id}: floor ${floor}`);
      assert.equal(checkPromise(study).status, "verified");
      const weaker = { ...study, sigma: study.sigma / 2, server_sigma: study.server_sigma / 2 };
      assert.throws(() => checkPromise(weaker), /promises epsilon/);
    } else {
      // the plain Gaussian's epsilon is above the target; the sign mixture's delta bound meets it
      assert.ok(eps > study.epsilon);
      assert.equal(checkPromise(study).status, "verified");
      const weaker = { ...study, sigma: study.sigma * 0.9, server_sigma: study.server_sigma * 0.9 };
      assert.throws(() => checkPromise(weaker), /promises epsilon/);
    }
  });
}

test("Gaussian delta: mu = 1, eps = 1 (Balle and Wang's closed form)", () => {
  // Phi(-0.5) - e Phi(-1.5) = 0.3085375387259869 - 2.718281828459045 * 0.06680720126885807
  assert.ok(Math.abs(gaussianDelta(1, 1) - (0.3085375387259869 - Math.E * 0.06680720126885807)) < 1e-14);
});
