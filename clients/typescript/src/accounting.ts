/**
 * What a client recomputes of a study's promise (docs/protocol.md section 5, "Per-report
 * epsilon"), exactly as the reference's `Study.report_epsilon` does, so that a TypeScript and a
 * Python client accept and refuse the same studies (conformance/accounting.json):
 *
 * - the noise really drawn (section 5a's argument: the client noise on its grid, the server
 *   variance less the rounding radius, the slacks taken off delta and added to epsilon);
 * - replace-one: the Gaussian mechanism's epsilon at mu = Delta_replace / sqrt(sigma^2
 *   max(1, lambda) + tau^2), the root of delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2);
 *   a signed study's is the smaller of this and the sign mixture's (secret_sign.ts);
 * - add/remove: the privacy-loss distribution of the presence pair (pld.ts), or of its signed
 *   mixture, read at delta;
 *
 * at lambda_star (the study's epsilon) and at lambda = 1 (its floor), checked against the
 * targets with the reference's relative tolerance, 1e-9.
 */
import { MAX_EPSILON, MAX_RADIUS, replaceDelta } from "./secret_sign.js";
import { addRemoveEpsilon, presenceEpsilon } from "./pld.js";
import { erfc } from "./special.js";
import { serverStd, spacing, width, type Study } from "./study.js";

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

/**
 * The replace-one Gaussian epsilon of one honest report with lambda worth of certified honest
 * reports, for the noise really drawn (Study.report_epsilon without the sign):
 * mu = Delta_replace / sqrt(sigma^2 max(1, lambda) + tau^2) read at delta, section 5a's slacks included.
 */
export function replaceOneEpsilon(study: Study, lambda: number): number {
  const m = studyMechanism(study);
  const v = m.sigma ** 2 * Math.max(1, lambda) + m.tau ** 2;
  if (!(v > 0)) return Infinity;
  return gaussianEpsilon(replaceSensitivity(study) / Math.sqrt(v), m.delta) + m.epsilonSlack;
}

/** Delta_presence: the largest ||x|| of a report's shared vector (section 5; 2a, 2b). */
export function presenceSensitivity(study: Study): number {
  const B = study.row_bound;
  switch (study.kind) {
    case "gram": {
      const b2 = B * B;
      return Math.sqrt(b2 + b2 * b2 + 1);
    }
    case "moments":
      return B * B;
    default:
      return B;
  }
}

/** The reference's check tolerance on a study's epsilons (privacy.SIGMA_RTOL). */
export const SIGMA_RTOL = 1e-9;
/** Section 5a's error bounds the argument is made for: eps1 <= 2^-100, eps2 = 2^-300. */
const MAX_ERROR_LOG2 = -100;
const ROUNDING_ERROR_LOG2 = -300;
/** An honest validity report redrawn outside the predicate's bound (section 4b): 2^-96 each. */
const REFUSAL_LOG2 = -96;

/** Section 5a's discrete-noise argument for a study (`smoothing.argument`). */
export interface DiscreteArgument {
  covered: boolean;
  clientStd: number; // sigma_c = t_c h (0 without client noise)
  serverStd: number; // tau_c = t_s h per unscaled cell (0 without server noise)
  radius: number; // r, the rounding radius
  linearLog2: number; // log2 eps1
  columns: number;
}

function smoothingErrorLog2(beta: number, dimension: number): number {
  const x = Math.PI / (beta * beta) - Math.log(2 * dimension);
  if (x <= Math.LN2) return Infinity;
  if (x > 700) return -x / Math.LN2;
  return -Math.log2(Math.expm1(x));
}

const gridScale = (sd: number, h: number) => Math.max(1, Math.ceil(sd / h));

export function discreteArgument(study: Study): DiscreteArgument {
  const h = spacing(study), columns = width(study), k = study.k;
  const nonzeros = study.kind === "l1" ? study.s + 1 : study.s;
  const sigmaC = study.sigma > 0 ? gridScale(study.sigma, h) * h : 0;
  const sstd = serverStd(study);
  const tauC = sstd > 0 ? gridScale(sstd, h) * h : 0;
  const radius = 2 * h * Math.sqrt(Math.log(2 * k * (1 + 1 / 2 ** ROUNDING_ERROR_LOG2)) / Math.PI);
  const result = (covered: boolean, linearLog2: number): DiscreteArgument =>
    ({ covered, clientStd: sigmaC, serverStd: tauC, radius, linearLog2, columns });
  let linear: number, smallest: number;
  if (tauC > 0) {
    linear = sigmaC > 0 ? smoothingErrorLog2(h * Math.sqrt(1 / sigmaC ** 2 + nonzeros / tauC ** 2), study.max_reports + k) : -Infinity;
    smallest = tauC;
  } else if (sigmaC > 0 && nonzeros === 1) {
    linear = smoothingErrorLog2((Math.SQRT2 * h) / sigmaC, study.max_reports);
    smallest = sigmaC;
  } else {
    return result(false, Infinity);
  }
  if (linear > MAX_ERROR_LOG2) return result(false, linear);
  if (smallest < 2 * radius) return result(false, linear);
  return result(true, linear);
}

/** 2 w ln((1 + eps1) / (1 - eps1)): what the argument adds to epsilon. */
function epsilonSlack(arg: DiscreteArgument): number {
  const eps1 = 2 ** arg.linearLog2;
  return 2 * arg.columns * Math.log1p((2 * eps1) / (1 - eps1));
}

/** (e^mu - 1) delta + e^mu 8 w eps2 (1 + e^epsilon): what the argument takes off delta. */
function deltaSlack(arg: DiscreteArgument, delta: number, epsilon: number): number {
  const mu = epsilonSlack(arg) / 2;
  return Math.expm1(mu) * delta + Math.exp(mu) * 8 * arg.columns * 2 ** ROUNDING_ERROR_LOG2 * (1 + Math.exp(Math.min(epsilon, 700)));
}

/** P(|X| > limit) bound for X ~ N_Z(t) (noise.tail_probability). */
function tailProbability(t: number, limit: number): number {
  const a = (limit + 1) / t;
  const mass = Math.exp(-0.5 * a * a) + t * Math.sqrt(Math.PI / 2) * erfc(a / Math.SQRT2);
  return (2 * mass) / (t * Math.sqrt(2 * Math.PI) - 1);
}

/** What conditioning every noise value on its 20-sigma cut can cost of delta (Study.tail_delta). */
export function tailDelta(study: Study): number {
  const h = spacing(study), w = width(study);
  let mp = 0;
  for (const [sd, count] of [[study.sigma, study.max_reports * w], [serverStd(study), study.servers.length * study.k * w]]) {
    if (sd > 0) mp += count * tailProbability(gridScale(sd, h), Math.max(0, Math.floor((20 * sd) / h) - 1));
  }
  if (study.validity !== undefined) mp += study.max_reports * 2 ** REFUSAL_LOG2;
  // and each batch of a study with batch proofs redrawn for a wrap-around projection outside T
  if (study.batch_proofs) mp += study.max_reports * 2 ** REFUSAL_LOG2;
  if (mp >= 1) return Infinity;
  return ((Math.exp(Math.min(study.epsilon, 700)) + 1) * mp) / (1 - mp);
}

/**
 * epsilon at delta of one honest report of an add/remove study with client noise sigma and
 * server noise tau (release units) when lambda_min(S_H S_H^T) >= lambda (accounting.report_epsilon):
 * M = Delta_presence / sqrt(var), r = 1 + sigma^2 / var, var = sigma^2 max(0, lambda - 1) + tau^2.
 */
export function presenceMechanismEpsilon(study: Study, sigma: number, tau: number, lambda: number, delta: number): number {
  const s2 = sigma * sigma, t2 = tau * tau, w = width(study);
  const v = s2 * Math.max(0, Math.max(1, lambda) - 1) + t2;
  if (!(v > 0)) return Infinity; // nothing but the report's own noise: its presence shows
  const ratio = 1 + s2 / v;
  const plain = ratio === 1 || w < 1 ? gaussianEpsilon(presenceSensitivity(study) / Math.sqrt(v), delta)
    : addRemoveEpsilon(presenceSensitivity(study) / Math.sqrt(v), ratio, w, delta);
  if (!study.secret_sign) return plain;
  return Math.min(presenceEpsilon(study.row_bound / Math.sqrt(v), ratio, w, delta), plain);
}

/**
 * The continuous mechanism a study's release is a post-processing of (Study.mechanism and
 * Study.report_epsilon): the clients' noise on its grid (sigma_c = t_c h >= sigma), the servers'
 * less the rounding radius r (without server noise, replace-one gives up r^2 of the clients'
 * variance and add/remove r^2 / sigma_c^2 of lambda), delta less the argument's and the tail
 * cut's shares, and the argument's epsilon slack to add. A study the argument does not cover is
 * accounted as the continuous mechanism it approximates.
 */
export interface StudyMechanism {
  sigma: number;
  tau: number;
  lambdaLoss: number;
  delta: number;
  epsilonSlack: number;
}

export function studyMechanism(study: Study): StudyMechanism {
  const arg = discreteArgument(study);
  if (!arg.covered) return { sigma: study.sigma, tau: study.server_sigma, lambdaLoss: 0, delta: study.delta, epsilonSlack: 0 };
  let sigma = arg.clientStd, tau = 0;
  if (arg.serverStd > 0) tau = (Math.sqrt(Math.max(0, arg.serverStd ** 2 - arg.radius ** 2)) * study.server_sigma) / serverStd(study);
  else if (study.neighbouring === "replace-one" && sigma > 0) sigma = Math.sqrt(sigma ** 2 - arg.radius ** 2);
  const lambdaLoss = study.neighbouring === "add-remove" && arg.serverStd === 0 && arg.clientStd > 0 ? (arg.radius / arg.clientStd) ** 2 : 0;
  const delta = study.delta - deltaSlack(arg, study.delta, study.epsilon) - tailDelta(study);
  return { sigma, tau, lambdaLoss, delta, epsilonSlack: epsilonSlack(arg) };
}

/**
 * The study's epsilon for one honest report under add/remove with lambda worth of certified
 * honest reports (1: the floor), for the noise really drawn (Study.report_epsilon).
 */
export function addRemoveStudyEpsilon(study: Study, lambda: number): number {
  const m = studyMechanism(study);
  return presenceMechanismEpsilon(study, m.sigma, m.tau, lambda - m.lambdaLoss, m.delta) + m.epsilonSlack;
}

/** The checks of section 5 and 5a a study must pass before its epsilons mean anything. */
function checkSlacks(study: Study): void {
  const tail = tailDelta(study);
  if (!(tail <= 1e-6 * study.delta)) throw new Error(`the noise's 20-sigma cut could cost ${tail} of delta = ${study.delta}`);
  const arg = discreteArgument(study);
  if (arg.covered && deltaSlack(arg, study.delta, study.epsilon) > 1e-6 * study.delta)
    throw new Error("the discrete noise argument leaves too little of delta");
}

export interface PromiseCheck {
  /** "verified": recomputed and within the study's targets (a study that is not is refused) */
  status: "verified";
  epsilon: number | null;
  floorEpsilon: number | null;
  why: string;
}

/**
 * Whether the noise gives epsilon for one honest report with lambda worth of certified honest
 * reports (replace-one), as the reference decides it: the Gaussian mechanism's epsilon, or for a
 * signed study the smaller of it and the mixture's, within `rtol` of the target (the mixture's
 * certified delta bound at the target, less the slack, against the study's delta less its share).
 */
export function replaceOneHolds(study: Study, lambda: number, epsilon: number, rtol: number): { holds: boolean; gaussian: number } {
  const gaussian = replaceOneEpsilon(study, lambda);
  const target = epsilon * (1 + rtol);
  if (gaussian <= target) return { holds: true, gaussian };
  const m = studyMechanism(study);
  const at = target - m.epsilonSlack;
  if (!study.secret_sign || at > MAX_EPSILON) return { holds: false, gaussian };
  const v = m.sigma ** 2 * Math.max(1, lambda) + m.tau ** 2;
  const r = study.row_bound / Math.sqrt(v);
  if (!(r <= MAX_RADIUS)) return { holds: false, gaussian };
  return { holds: replaceDelta(r, at, m.delta) <= m.delta, gaussian };
}

/**
 * The study's epsilon and floor recomputed as the reference recomputes them, refused (throws)
 * when the noise does not give them within the reference's relative tolerance (1e-9): the same
 * verdict a Python client reaches (conformance/accounting.json).
 */
export function checkPromise(study: Study, rtol = SIGMA_RTOL): PromiseCheck {
  checkSlacks(study);
  if (study.neighbouring === "add-remove") {
    const eps = addRemoveStudyEpsilon(study, study.lambda_star);
    const floor = study.epsilon_floor === null ? null : addRemoveStudyEpsilon(study, 1);
    if (eps <= study.epsilon * (1 + rtol) && (floor === null || floor <= study.epsilon_floor! * (1 + rtol)))
      return { status: "verified", epsilon: eps, floorEpsilon: floor,
        why: study.secret_sign ? "add/remove, privacy-loss distributions of the sign mixture and of the Gaussian pair"
          : "add/remove, privacy-loss distribution of the presence pair" };
    throw new Error(`the study promises epsilon ${study.epsilon} (floor ${study.epsilon_floor}) that its noise does not give (add/remove: ${eps}, floor ${floor})`);
  }
  const main = replaceOneHolds(study, study.lambda_star, study.epsilon, rtol);
  const floor = study.epsilon_floor === null ? null : replaceOneHolds(study, 1, study.epsilon_floor, rtol);
  if (main.holds && (floor === null || floor.holds))
    return { status: "verified", epsilon: main.gaussian, floorEpsilon: floor ? floor.gaussian : null,
      why: study.secret_sign ? "replace-one, the smaller of the Gaussian and the sign mixture" : "replace-one, Gaussian mechanism" };
  throw new Error(`the study promises epsilon ${study.epsilon} (floor ${study.epsilon_floor}) that its noise does not give (Gaussian: ${main.gaussian}, floor ${floor?.gaussian})`);
}
