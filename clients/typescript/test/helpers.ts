import { readFileSync, existsSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

/** The repository root: the first ancestor holding conformance/. */
export function repoRoot(): string {
  let d = dirname(fileURLToPath(import.meta.url));
  for (let i = 0; i < 8; i++) {
    if (existsSync(join(d, "conformance", "ring.json"))) return d;
    d = resolve(d, "..");
  }
  throw new Error("conformance/ not found above the test");
}

/** A JSON parser that keeps integers beyond 2^53 exact (as BigInt): long digit runs outside strings. */
export function parseJsonExact(text: string): unknown {
  let out = "";
  let inString = false;
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (inString) {
      out += c;
      if (c === "\\") out += text[++i];
      else if (c === '"') inString = false;
      continue;
    }
    if (c === '"') {
      inString = true;
      out += c;
      continue;
    }
    const m = /^-?\d+(?![.eE\d])/.exec(text.slice(i, i + 40));
    if (m && (i === 0 || !/[\d.eE+-]/.test(text[i - 1]))) {
      const lit = m[0];
      out += Number.isSafeInteger(Number(lit)) ? lit : `{"__big__":"${lit}"}`;
      i += lit.length - 1;
      continue;
    }
    out += c;
  }
  return JSON.parse(out, (_k, v) =>
    v && typeof v === "object" && !Array.isArray(v) && Object.keys(v).length === 1 && "__big__" in v ? BigInt(v.__big__) : v,
  );
}

export interface Vector {
  id: string;
  type: string;
  [k: string]: any;
}

export function vectors(file: string): Vector[] {
  const text = readFileSync(join(repoRoot(), "conformance", file), "utf8");
  return (parseJsonExact(text) as { vectors: Vector[] }).vectors;
}

/** The JSON block of docs/protocol.md section 9. */
export function section9(): any {
  const doc = readFileSync(join(repoRoot(), "docs", "protocol.md"), "utf8");
  const start = doc.indexOf("## 9. Test vectors");
  const block = doc.slice(start).split("```json")[1].split("```")[0];
  return parseJsonExact(block);
}

export function closeTo(got: number, want: number, tol: { rtol: number; atol: number }): boolean {
  return Math.abs(got - want) <= tol.atol + tol.rtol * Math.abs(want);
}
