/**
 * What a client can recompute of a study's promise (docs/protocol.md section 5): the Gaussian
 * mechanism's epsilon for replace-one, at lambda_star (the study's epsilon) and at lambda = 1
 * (its floor), mu = Delta_replace / sqrt(sigma^2 max(1, lambda) + server_sigma^2), epsilon the
 * root of delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2). This is the whole accounting
 * of an unsigned replace-one study (up to the discrete-noise slacks, below 1e-12); a signed
 * study's is the smaller of this and the sign mixture's (secret_sign.ts); the add/remove
 * accounting (privacy-loss distributions) is not implemented here.
 */
import { MAX_EPSILON, MAX_RADIUS, replaceDelta } from "./secret_sign.js";
import type { Study } from "./study.js";

/** log(erfc(x)) for x >= 0: its series below 2, a continued fraction (Lentz) above. */
function logErfc(x: number): number {
  if (x < 2) {
    // erf(x) = 2/sqrt(pi) sum (-1)^n x^(2n+1) / (n! (2n+1))
    let sum = 0, term = x;
    for (let n = 0; n < 200; n++) {
      const add = term / (2 * n + 1);
      sum += add;
      if (Math.abs(add) < 1e-17 * Math.abs(sum)) break;
      term *= (-x * x) / (n + 1);
    }
    return Math.log(1 - (2 / Math.sqrt(Math.PI)) * sum);
  }
  // erfc(x) = exp(-x^2)/sqrt(pi) * 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + ...))))
  const tiny = 1e-300;
  let f = x, C = x, D = 0;
  for (let n = 1; n < 2000; n++) {
    const a = n / 2;
    D = x + a * D;
    D = Math.abs(D) < tiny ? tiny : D;
    C = x + a / C;
    C = Math.abs(C) < tiny ? tiny : C;
    D = 1 / D;
    const delta = C * D;
    f *= delta;
    if (Math.abs(delta - 1) < 1e-16) break;
  }
  return -x * x - Math.log(f) - 0.5 * Math.log(Math.PI);
}

/** log Phi(z) = log(erfc(-z / sqrt 2) / 2); for z >= 0 through the complement. */
export function logPhi(z: number): number {
  if (z < 0) return logErfc(-z / Math.SQRT2) - Math.LN2;
  return Math.log1p(-Math.exp(logErfc(z / Math.SQRT2) - Math.LN2));
}

/** delta(eps) of the Gaussian mechanism with parameter mu. */
export function gaussianDelta(eps: number, mu: number): number {
  const a = Math.exp(logPhi(-eps / mu + mu / 2));
  const b = Math.exp(eps + logPhi(-eps / mu - mu / 2));
  return a - b;
}

/** The smallest epsilon with gaussianDelta(epsilon, mu) <= delta (bisection; Infinity past 1e4). */
export function gaussianEpsilon(mu: number, delta: number): number {
  if (!(mu > 0)) return 0;
  if (gaussianDelta(0, mu) <= delta) return 0;
  let lo = 0, hi = 1;
  while (gaussianDelta(hi, mu) > delta) {
    hi *= 2;
    if (hi > 1e4) return Infinity;
  }
  for (let i = 0; i < 200 && hi - lo > 1e-15 * hi; i++) {
    const mid = 0.5 * (lo + hi);
    if (gaussianDelta(mid, mu) > delta) lo = mid;
    else hi = mid;
  }
  return hi;
}

export function replaceSensitivity(study: Study): number {
  const B = study.row_bound;
  switch (study.kind) {
    case "gram": {
      const b2 = B * B;
      return b2 < 0.5 ? 2 * Math.sqrt(b2) : Math.sqrt(2 * b2 * b2 + 2 * b2 + 0.5);
    }
    case "moments":
      return Math.SQRT2 * (B * B);
    case "histogram":
      return Math.SQRT2 * B;
    default:
      return 2 * B;
  }
}

export function replaceOneEpsilon(study: Study, lambda: number): number {
  const v = study.sigma ** 2 * Math.max(1, lambda) + study.server_sigma ** 2;
  if (v === 0) return Infinity;
  return gaussianEpsilon(replaceSensitivity(study) / Math.sqrt(v), study.delta);
}

export interface PromiseCheck {
  /** "verified": recomputed and within the study's targets; "unverified": not recomputable here */
  status: "verified" | "unverified";
  epsilon: number | null;
  floorEpsilon: number | null;
  why: string;
}

/**
 * Whether the noise gives epsilon at delta for one honest report with lambda worth of certified
 * honest reports (replace-one): the Gaussian mechanism's epsilon, or for a signed study the
 * smaller of it and the mixture's (its certified delta bound at the target epsilon).
 */
export function replaceOneHolds(study: Study, lambda: number, epsilon: number, rtol: number): { holds: boolean; gaussian: number } {
  const gaussian = replaceOneEpsilon(study, lambda);
  if (gaussian <= epsilon * (1 + rtol)) return { holds: true, gaussian };
  if (!study.secret_sign || epsilon > MAX_EPSILON) return { holds: false, gaussian };
  const v = study.sigma ** 2 * Math.max(1, lambda) + study.server_sigma ** 2;
  const r = study.row_bound / Math.sqrt(v);
  if (!(r <= MAX_RADIUS)) return { holds: false, gaussian };
  const limit = study.delta * (1 + rtol);
  return { holds: replaceDelta(r, epsilon * (1 + rtol), limit) <= limit, gaussian };
}

/**
 * The study's epsilon and floor recomputed where this client can (replace-one, signed or not),
 * refused (throws) when the noise does not give them (`rtol` for floating-point differences
 * from the reference: its calibration leaves about 1e-6 to spare).
 */
export function checkPromise(study: Study, rtol = 1e-6): PromiseCheck {
  if (study.neighbouring !== "replace-one") return { status: "unverified", epsilon: null, floorEpsilon: null, why: "add/remove accounting not implemented in this client" };
  const main = replaceOneHolds(study, study.lambda_star, study.epsilon, rtol);
  const floor = study.epsilon_floor === null ? null : replaceOneHolds(study, 1, study.epsilon_floor, rtol);
  if (main.holds && (floor === null || floor.holds))
    return { status: "verified", epsilon: main.gaussian, floorEpsilon: floor ? floor.gaussian : null,
      why: study.secret_sign ? "replace-one, the smaller of the Gaussian and the sign mixture" : "replace-one, Gaussian mechanism" };
  throw new Error(`the study promises epsilon ${study.epsilon} (floor ${study.epsilon_floor}) that its noise does not give (Gaussian: ${main.gaussian}, floor ${floor?.gaussian})`);
}
