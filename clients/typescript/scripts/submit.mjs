// Submit rows through the package, for the interop test (tests/test_ts_client.py): reads
// {"studyId", "servers": [{"url", "token"}], "rows", "sealing"?, "secret"? (hex), "batchSize"? (null: the
// client's default), "batchProofs"? (false: per-report proofs in a study with batch proofs)}
// as JSON on stdin and prints {"reportIds", "accepted", "duplicates", "secret", "vectors", "progress"}.
import { Client, hex, unhex } from "../dist/index.js";

const chunks = [];
for await (const c of process.stdin) chunks.push(c);
const cfg = JSON.parse(Buffer.concat(chunks).toString("utf8"));
const client = await Client.connect({ studyId: cfg.studyId, servers: cfg.servers, sealing: cfg.sealing ?? "none" });
const progress = [];
const retries = [];
const opts = {
  batchSize: cfg.batchSize === null ? undefined : cfg.batchSize ?? 1000,
  batchProofs: cfg.batchProofs,
  secret: cfg.secret ? unhex(cfg.secret) : undefined,
  keepVectors: true,
  onProgress: (p) => progress.push(p),
  onRetry: (server, attempt, why) => retries.push({ server, attempt, why }),
};
// a party's blocks: {"party", "partyKey" (hex), "individuals"} besides the rows
const r = cfg.party
  ? await client.submitBlocks(cfg.party, unhex(cfg.partyKey), cfg.individuals, cfg.rows, opts)
  : await client.submit(cfg.rows, opts);
process.stdout.write(JSON.stringify({
  reportIds: r.reportIds,
  accepted: r.accepted,
  duplicates: r.duplicates,
  secret: hex(r.secret),
  vectors: r.vectors.map((v) => v.map(String)),
  progress,
  retries,
  promise: client.promise,
}));
