/**
 * The canonical study encoding of docs/protocol.md section 2 ("Study id"): sorted members, no
 * whitespace, numbers as ECMAScript writes them, strings with every unit outside U+0020..U+007E
 * escaped as \uXXXX (DEL and non-ASCII too: the difference from RFC 8785).
 */

export type Json = null | boolean | number | bigint | string | Json[] | { [k: string]: Json };

const SHORT: Record<number, string> = { 0x22: '\\"', 0x5c: "\\\\", 0x08: "\\b", 0x09: "\\t", 0x0a: "\\n", 0x0c: "\\f", 0x0d: "\\r" };

function encodeString(s: string): string {
  let out = '"';
  for (let i = 0; i < s.length; i++) {
    const u = s.charCodeAt(i);
    const short = SHORT[u];
    if (short !== undefined) out += short;
    else if (u >= 0x20 && u <= 0x7e) out += s[i];
    else out += "\\u" + u.toString(16).padStart(4, "0");
  }
  return out + '"';
}

function encodeNumber(x: number): string {
  if (!Number.isFinite(x)) throw new Error("a study has no canonical encoding with a non-finite number");
  // Number.prototype.toString is the rule of the document (integers come out in plain decimal up
  // to 1e21, beyond any integer a study member holds); -0 writes "0".
  return String(x);
}

export function canonical(value: Json): string {
  if (value === null) return "null";
  if (value === true) return "true";
  if (value === false) return "false";
  if (typeof value === "number") return encodeNumber(value);
  if (typeof value === "bigint") return value.toString(); // an integer beyond 2^53 (never in a study)
  if (typeof value === "string") return encodeString(value);
  if (Array.isArray(value)) return "[" + value.map(canonical).join(",") + "]";
  const keys = Object.keys(value).filter((k) => value[k] !== undefined);
  // code point order; member names are ASCII so UTF-16 order is the same
  keys.sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
  return "{" + keys.map((k) => encodeString(k) + ":" + canonical(value[k])).join(",") + "}";
}
