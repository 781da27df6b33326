/**
 * What a client can recompute of a study's promise (docs/protocol.md section 5): the Gaussian
 * mechanism's epsilon for replace-one, at lambda_star (the study's epsilon) and at lambda = 1
 * (its floor), mu = Delta_replace / sqrt(sigma^2 max(1, lambda) + server_sigma^2), epsilon the
 * root of delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2). This is the whole accounting
 * of an unsigned replace-one study (up to the discrete-noise slacks, below 1e-12); for a signed
 * study it is an upper bound (its epsilon is the smaller of this and the mixture's), and the
 * add/remove accounting (privacy-loss distributions) is not implemented here.
 */
import type { Study } from "./study.js";

/** log(erfc(x)) for x >= 0, accurate in the far tail (continued fraction beyond 0.5). */
function logErfc(x: number): number {
  if (x < 0.5) {
    // erf by its series: erf(x) = 2/sqrt(pi) sum (-1)^n x^(2n+1) / (n! (2n+1))
    let sum = 0, term = x;
    for (let n = 0; n < 60; n++) {
      sum += term / (2 * n + 1);
      term *= (-x * x) / (n + 1);
    }
    return Math.log(1 - (2 / Math.sqrt(Math.PI)) * sum);
  }
  // erfc(x) = exp(-x^2)/sqrt(pi) * 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + ...)))), by Lentz's method
  const tiny = 1e-300;
  let f = x, C = x, D = 0;
  for (let n = 1; n < 5000; n++) {
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
function logPhi(z: number): number {
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
 * The study's epsilon and floor recomputed where this client can (replace-one), refused (throws)
 * when they exceed the targets by more than `rtol` for a study whose accounting this is whole.
 */
export function checkPromise(study: Study, rtol = 1e-6): PromiseCheck {
  if (study.neighbouring !== "replace-one") return { status: "unverified", epsilon: null, floorEpsilon: null, why: "add/remove accounting not implemented in this client" };
  const eps = replaceOneEpsilon(study, study.lambda_star);
  const floor = study.epsilon_floor === null ? null : replaceOneEpsilon(study, 1);
  const within = eps <= study.epsilon * (1 + rtol) && (floor === null || floor <= study.epsilon_floor! * (1 + rtol));
  if (within) return { status: "verified", epsilon: eps, floorEpsilon: floor, why: "Gaussian mechanism, replace-one" };
  if (study.secret_sign) return { status: "unverified", epsilon: eps, floorEpsilon: floor, why: "a signed study's epsilon is the mixture's, below this bound" };
  throw new Error(`the study promises epsilon ${study.epsilon} (floor ${study.epsilon_floor}) but its noise gives ${eps} (floor ${floor})`);
}
