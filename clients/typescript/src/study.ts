/**
 * The study (docs/protocol.md section 2): its id, its derived shape (width, noise grid, clip
 * bound B', the samplers' parameters, section 5) and the checks a client makes before it sends
 * anything. One module, because every later step reads these numbers.
 */
import { sha256 } from "@noble/hashes/sha2.js";
import { ascii, hex } from "./bytes.js";
import { canonical, type Json } from "./canonical.js";
import { noiseParameters } from "./noise.js";

export type Kind = "sketch" | "gram" | "moments" | "histogram" | "l1";

export interface Axis {
  column: string;
  edges: number[] | null;
  categories: string[] | null;
}

export interface Party {
  name: string;
  columns: string[];
  row_bound: number;
}

export interface Study {
  protocol: "dpsketch/2";
  name: string;
  columns: string[];
  label: string | null;
  row_bound: number;
  bounds?: [number, number][];
  kind: Kind;
  population?: string;
  histogram?: { axes: Axis[]; marginal?: boolean };
  l1?: { level0_buckets: number; levels: number; buckets: number; branching: number };
  parties?: Party[];
  k: number;
  s: number;
  seed: string;
  epsilon: number;
  delta: number;
  neighbouring: "replace-one" | "add-remove";
  lambda_star: number;
  sigma: number;
  server_sigma: number;
  epsilon_floor: number | null;
  servers: string[];
  t: number;
  min_reports: number;
  max_reports: number;
  frac_bits: number;
  secret_sign?: boolean;
  validity?: string;
  /** batch proofs (docs/protocol.md section 4d): only with validity, in a sketch or l1 study without parties */
  batch_proofs?: boolean;
}

const OPTIONAL = ["bounds", "histogram", "l1", "parties", "population", "validity", "secret_sign", "batch_proofs"];
const REQUIRED = ["protocol", "name", "columns", "label", "row_bound", "kind", "k", "s", "seed", "epsilon", "delta",
  "neighbouring", "lambda_star", "sigma", "server_sigma", "epsilon_floor", "servers", "t", "min_reports",
  "max_reports", "frac_bits"];

/** The study as its id is computed: `secret_sign: false` and `marginal: false` read as absent. */
export function normalize(study: Study): Study {
  const out: Record<string, unknown> = { ...study };
  if (out.secret_sign === false) delete out.secret_sign;
  if (out.batch_proofs === false) delete out.batch_proofs;
  for (const k of OPTIONAL) if (out[k] === undefined || out[k] === null) delete out[k];
  if (study.histogram) {
    const h: Record<string, unknown> = { ...study.histogram };
    if (h.marginal === false) delete h.marginal;
    h.axes = study.histogram.axes.map((a) => ({ column: a.column, edges: a.edges ?? null, categories: a.categories ?? null }));
    out.histogram = h;
  }
  return out as unknown as Study;
}

export function canonicalStudy(study: Study): string {
  return canonical(normalize(study) as unknown as Json);
}

/** Lower-case hex SHA-256 of the canonical encoding. */
export function studyId(study: Study): string {
  return hex(sha256(ascii(canonicalStudy(study))));
}

export function rowWidth(study: Study): number {
  const d = study.columns.length;
  const constant = study.bounds !== undefined && study.kind !== "gram" && study.kind !== "histogram";
  return d + (constant ? 1 : 0);
}

export function histogramCells(study: Study): number {
  const axes = study.histogram!.axes;
  const sizes = axes.map((a) => (a.edges ?? a.categories ?? []).length + 1);
  return study.histogram!.marginal ? sizes.reduce((x, y) => x + y, 0) : sizes.reduce((x, y) => x * y, 1);
}

/** The share width of section 2: values per share and per aggregate row. */
export function width(study: Study): number {
  const d = study.columns.length;
  switch (study.kind) {
    case "sketch":
    case "l1":
      return rowWidth(study);
    case "gram":
      return (d * (d + 3)) / 2 + 1;
    case "moments": {
      const w = rowWidth(study);
      return (w * (w + 1)) / 2;
    }
    case "histogram":
      return histogramCells(study);
  }
}

/** s' of section 5: s, or s + 1 for an l1 study. */
function sPrime(study: Study): number {
  return study.kind === "l1" ? study.s + 1 : study.s;
}

export function serverStd(study: Study): number {
  return study.server_sigma * Math.sqrt(sPrime(study));
}

/**
 * Whether clients share raw products (a gram or moments study with validity proofs, section 4b):
 * their features times `provedScale`, the strict upper triangle's noise at sigma / sqrt(2).
 */
export function provedFeatures(study: Study): boolean {
  return study.validity !== undefined && (study.kind === "gram" || study.kind === "moments");
}

/** 1 / sqrt(2) as the reference computes it (1.0 / math.sqrt(2.0)): not Math.SQRT1_2, one ulp above. */
export const INV_SQRT2 = 1 / Math.SQRT2;

/**
 * What a client multiplies its features (and their noise's sd) by (features.proved_scale): 1 /
 * sqrt(2) on the strict upper triangle of a study with proved features, 1 elsewhere.
 */
export function provedScale(study: Study): number[] {
  const w = width(study);
  const scale = new Array(w).fill(1);
  if (!provedFeatures(study)) return scale;
  const d = rowWidth(study);
  const start = study.kind === "gram" ? d : 0;
  for (let i = start + d; i < start + (d * (d + 1)) / 2; i++) scale[i] = INV_SQRT2;
  return scale;
}

/** The grid 4^-m of a gram or moments validity study: the least m with smallest 4^m >= 4096. */
function gramShift(smallest: number, f: number): number {
  let m = 0;
  while (smallest * 4 ** m < 4096) m++;
  if (2 * m > f) throw new Error(`the noise (${smallest}) is too small for the study's ${f} fractional bits: a validity gram study needs its grid 4^-m on the ring`);
  return f - 2 * m;
}

/** The coarsest power-of-two grid of a validity study with `smallest` at 64 steps or more. */
function validityShift(smallest: number, f: number): number {
  for (let shift = f; shift >= 0; shift--) if (smallest * 2 ** (f - shift) >= 64) return shift;
  return 0;
}

/** shift of the noise grid (section 5; section 4b for a validity study). */
export function gridShift(study: Study): number {
  const f = study.frac_bits;
  if (study.validity !== undefined && study.sigma === 0 && serverStd(study) > 0) {
    // epsilon at the floor, no client noise (validity.floor_grid): the coarsest grid whose step h
    // keeps max_reports h / 2 <= (the servers' smallest noise) / 16, with >= 64 (4096) steps per
    // it and at most 2^20 steps (F_p's room for the norm)
    const gram = provedFeatures(study);
    const cap = (serverStd(study) * (gram ? INV_SQRT2 : 1)) / Math.min(Math.max(64, (16 * study.max_reports) / 2), 2 ** 20);
    return gram ? gramShift(cap * 4096, f) : validityShift(cap * 64, f);
  }
  if (provedFeatures(study) && study.sigma > 0) {
    // h = 4^-m for the least m with the strict upper triangle's noise at 4096 steps or more
    return gramShift(Math.min(...[study.sigma, serverStd(study)].filter((x) => x > 0)) * INV_SQRT2, f);
  }
  if (study.validity !== undefined) {
    const cand = [study.sigma, serverStd(study)].filter((x) => x > 0);
    if (cand.length === 0) return 0;
    return validityShift(Math.min(...cand), f);
  }
  const big = Math.max(study.sigma, serverStd(study));
  if (big === 0) return 0;
  let shift = 0;
  while (big * 2 ** (f - shift) > 2 ** 24) shift++;
  return shift;
}

export function spacing(study: Study): number {
  return 2 ** (gridShift(study) - study.frac_bits);
}

type Sens = (b: number) => number;
function sensitivities(study: Study): { replace: Sens; presence: Sens } {
  switch (study.kind) {
    case "gram":
      return {
        replace: (b) => {
          const b2 = b * b;
          return b2 < 0.5 ? 2 * Math.sqrt(b2) : Math.sqrt(2 * b2 * b2 + 2 * b2 + 0.5);
        },
        presence: (b) => {
          const b2 = b * b;
          return Math.sqrt(b2 + b2 * b2 + 1);
        },
      };
    case "moments":
      return { replace: (b) => Math.SQRT2 * (b * b), presence: (b) => b * b };
    case "histogram":
      return { replace: (b) => Math.SQRT2 * b, presence: (b) => b };
    default:
      return { replace: (b) => 2 * b, presence: (b) => b };
  }
}

/** B' of section 5: the bisection every client computes to the same double. */
export function clipBound(study: Study): number {
  const B = study.row_bound;
  if (study.kind === "histogram") return B;
  // a study with proved features lies on sqrt(2) h on its strict upper triangle (section 4b)
  const rho = spacing(study) * Math.sqrt(width(study)) * (provedFeatures(study) ? Math.SQRT2 : 1);
  const { replace, presence } = sensitivities(study);
  const rB = replace(B), pB = presence(B);
  let lo = 0, hi = B;
  for (let i = 0; i < 80; i++) {
    const mid = 0.5 * (lo + hi);
    if (replace(mid) + rho <= rB && presence(mid) + rho <= pB) lo = mid;
    else hi = mid;
  }
  return lo;
}

/** B'_j of a study with parties: max(0, B_j - (h sqrt(d_j)) / 2). */
export function partyClipBounds(study: Study): { name: string; clip_bound: number }[] | null {
  if (!study.parties) return null;
  const h = spacing(study);
  return study.parties.map((p) => ({ name: p.name, clip_bound: Math.max(0, p.row_bound - (h * Math.sqrt(p.columns.length)) / 2) }));
}

export interface NoisePlan {
  shift: number;
  spacing: number;
  clipBound: number;
  width: number;
  client: { t: number; limit: number } | null;
  /** the strict upper triangle's client noise (sd sigma / sqrt(2)) of a study with proved features */
  clientUpper: { t: number; limit: number } | null;
  server: { std: number; t: number; limit: number } | null;
}

export function noisePlan(study: Study): NoisePlan {
  const h = spacing(study);
  const sstd = serverStd(study);
  return {
    shift: gridShift(study),
    spacing: h,
    clipBound: clipBound(study),
    width: width(study),
    client: study.sigma > 0 ? noiseParameters(study.sigma, h) : null,
    clientUpper: study.sigma > 0 && provedFeatures(study) ? noiseParameters(study.sigma * INV_SQRT2, h) : null,
    server: study.server_sigma > 0 ? { std: sstd, ...noiseParameters(sstd, h) } : null,
  };
}

/** The largest |value| a share encodes before noise (section 2's overflow bound). */
export function valueBound(study: Study): number {
  const B = study.row_bound;
  if (study.kind === "gram") return Math.max(B, B * B, 1);
  if (study.kind === "moments") return Math.max(B * B, B);
  if (study.kind === "histogram") return 1;
  return B;
}

const ID_RE = /^[a-z0-9][a-z0-9.\-]{0,62}$/;
const COL_RE = /^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$/;

/**
 * The structural checks of section 2 a client can make without the privacy accountant (members,
 * limits, kinds, the overflow bound); throws an Error naming the first failure.
 */
export function validateStudy(study: Study): void {
  const fail = (why: string) => {
    throw new Error(`invalid study: ${why}`);
  };
  const keys = Object.keys(study).filter((k) => (study as unknown as Record<string, unknown>)[k] !== undefined);
  for (const k of REQUIRED) if (!keys.includes(k)) fail(`member ${k} missing`);
  for (const k of keys) if (!REQUIRED.includes(k) && !OPTIONAL.includes(k)) fail(`unknown member ${k}`);
  if (study.protocol !== "dpsketch/2") fail("protocol is not dpsketch/2");
  const d = study.columns.length;
  if (d < 1 || d > 4096 || new Set(study.columns).size !== d || !study.columns.every((c) => COL_RE.test(c))) fail("columns");
  if (study.label !== null && !study.columns.includes(study.label)) fail("label is not a column");
  if (!(study.row_bound > 0 && study.row_bound <= 1e6)) fail("row_bound");
  if (!(Number.isInteger(study.k) && study.k >= 1 && study.k <= 2 ** 20)) fail("k");
  if (!(Number.isInteger(study.s) && study.s >= 1 && study.s <= (study.kind === "l1" ? 6 : 8))) fail("s");
  if (study.kind !== "l1" && study.k % study.s !== 0) fail("s does not divide k");
  if (!/^[0-9a-f]{64}$/.test(study.seed)) fail("seed");
  if (!(study.epsilon > 0 && study.epsilon <= 100)) fail("epsilon");
  if (!(study.delta > 0 && study.delta < 1)) fail("delta");
  if (study.neighbouring !== "replace-one" && study.neighbouring !== "add-remove") fail("neighbouring");
  if (!(study.lambda_star >= 1)) fail("lambda_star");
  if (!(study.sigma >= 0) || !(study.server_sigma >= 0)) fail("sigma");
  if (study.epsilon_floor !== null && !(study.epsilon_floor > 0 && study.epsilon_floor <= 100 && study.epsilon_floor >= study.epsilon)) fail("epsilon_floor");
  const N = study.servers.length;
  if (N < 2 || N > 16 || new Set(study.servers).size !== N || !study.servers.every((s) => ID_RE.test(s))) fail("servers");
  if (!(Number.isInteger(study.t) && study.t >= 0)) fail("t");
  if (!(Number.isInteger(study.max_reports) && study.max_reports >= 1 && study.max_reports <= 2 ** 40)) fail("max_reports");
  if (!(Number.isInteger(study.min_reports) && study.t < study.min_reports && study.min_reports <= study.max_reports)) fail("min_reports");
  if (!(Number.isInteger(study.frac_bits) && study.frac_bits >= 0 && study.frac_bits <= 62)) fail("frac_bits");
  if (study.secret_sign === true && !(study.kind === "sketch" && study.k > 1)) fail("secret_sign only in a sketch study with k > 1");
  // (a study with parties may have validity: each party's blocks proved with its own plan, parties.ts)
  if (study.validity !== undefined && (study.validity !== "norm-bound/1" || !(study.sigma > 0 || study.server_sigma > 0))) fail("validity: norm-bound/1, with client or server noise");
  if (study.batch_proofs !== undefined && typeof study.batch_proofs !== "boolean") fail("batch_proofs is a boolean");
  if (study.batch_proofs === true && (study.validity === undefined || (study.kind !== "sketch" && study.kind !== "l1") || study.parties))
    fail("batch_proofs only with validity, in a sketch or l1 study without parties (section 4d)");
  if (study.bounds !== undefined) {
    if (study.kind === "histogram" || study.parties) fail("bounds not in a histogram study or one with parties");
    if (study.bounds.length !== d) fail("bounds: one pair per column");
    for (const [lo, hi] of study.bounds)
      if (!(Number.isFinite(lo) && Number.isFinite(hi) && lo < hi && Math.abs(lo) <= 1e15 && Math.abs(hi) <= 1e15 && hi / 2 - lo / 2 > 0)) fail("bounds: a pair");
  }
  if (study.kind === "gram" && (study.k !== 1 || study.s !== 1 || d > 256)) fail("gram study shape");
  if ((study.kind === "moments" || study.kind === "histogram") && (study.k !== 1 || study.s !== 1)) fail(`${study.kind} study shape`);
  if ((study.kind === "histogram") !== (study.histogram !== undefined)) fail("histogram member");
  if ((study.kind === "l1") !== (study.l1 !== undefined)) fail("l1 member");
  const sd = Math.max(study.sigma, 0);
  const cells = study.validity ? 0 : (study.max_reports * (valueBound(study) + 20 * sd) + N * 20 * study.server_sigma * Math.sqrt(sPrime(study))) * 2 ** study.frac_bits;
  if (!(cells < 2 ** 63)) fail("overflow bound");
}
