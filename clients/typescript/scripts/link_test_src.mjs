// After `tsc -b tsconfig.test.json`: dist-test/src made a link to dist. The tests and benches
// (dist-test/test, dist-test/bench) import ../src/*.js; tsconfig.test.json does not compile src
// again but references tsconfig.json (project references), so they are type-checked against the
// package's own build in dist and run on it. A directory left there by an older build is replaced.
import { lstatSync, mkdirSync, rmSync, symlinkSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const link = join(root, "dist-test", "src");
let stat = null;
try {
  stat = lstatSync(link);
} catch {
  // not there yet
}
if (!stat?.isSymbolicLink()) {
  if (stat) rmSync(link, { recursive: true });
  mkdirSync(dirname(link), { recursive: true });
  symlinkSync(join("..", "dist"), link, "junction"); // "junction": a directory link on Windows without privileges
}
