/**
 * Rows per CPU second to prepare (clip, signs, exact noise, seed-compressed shares, binding,
 * bodies) and to prepare and seal (version 4, classical, to fresh keys) in Node, one thread.
 * Input: a JSON file {study, studyId, rows, batchSize, repeats, party?}; output: JSON on stdout.
 * With `party` (a study with parties) the rows are that party's blocks (prepareBlocks, proved in a
 * validity study), each individual a fresh pseudonym with its party-key sign.
 * benchmarks/ts_client.py runs it against the Python SDK on the same rows in the same run.
 */
import { readFileSync } from "node:fs";
import { plainBody, prepareBatch } from "../src/batch.js";
import { concat, randomBytes } from "../src/bytes.js";
import { CONTENT_SEED } from "../src/binding.js";
import { blocksBody, partySigns, prepareBlocks } from "../src/parties.js";
import { CONTENT_BLOCK, CONTENT_BLOCK_SEED, seal } from "../src/sealing/v4.js";
import { keyId, suite, type ServerKey } from "../src/sealing/suites.js";
import type { Study } from "../src/study.js";

const cfg = JSON.parse(readFileSync(process.argv[2], "utf8")) as { study: Study; studyId: string; rows: number[][]; batchSize: number; repeats: number; party?: string };
const N = cfg.study.servers.length;
const cpu = () => {
  const u = process.cpuUsage();
  return (u.user + u.system) / 1e6;
};

async function keys(): Promise<ServerKey[]> {
  const s = suite("classical");
  const out: ServerKey[] = [];
  for (let j = 0; j < N; j++) {
    const kp = await s.hpke.kem.generateKeyPair();
    const pk = new Uint8Array(await s.hpke.kem.serializePublicKey(kp.publicKey));
    out.push({ suite: "classical", keyId: keyId(pk), publicKey: pk });
  }
  return out;
}

/** A party's blocks, batch by batch, the leader rotating (Client.submitBlocks without the I/O). */
async function runBlocks(sealed: boolean, ks: ServerKey[], party: string): Promise<{ seconds: number; bytes: number }> {
  const partyKey = randomBytes(32);
  const index = cfg.study.parties!.findIndex((q) => q.name === party);
  const t0 = cpu();
  let bytes = 0;
  const B = cfg.batchSize;
  for (let b = 0; b * B < cfg.rows.length; b++) {
    const rows = cfg.rows.slice(b * B, (b + 1) * B);
    const ps = rows.map(() => randomBytes(16));
    const signs = cfg.study.secret_sign ? partySigns(partyKey, cfg.studyId, ps) : null;
    const p = prepareBlocks(cfg.study, cfg.studyId, party, ps, rows, randomBytes(32), { signs, full: b % N });
    for (let j = 0; j < N; j++) {
      if (!sealed) bytes += blocksBody(p, j).length;
      else {
        const body = await seal({
          studyId: cfg.studyId, serverId: cfg.study.servers[j], key: ks[j], party: index,
          content: p.servers[j].content === CONTENT_SEED ? CONTENT_BLOCK_SEED : CONTENT_BLOCK,
          reportIds: p.blockIds, plaintexts: p.blockIds.map((_, i) => concat(p.pseudonyms[i], p.servers[j].proofs[i], p.servers[j].payloads[i])),
        });
        bytes += body.length;
      }
    }
  }
  return { seconds: cpu() - t0, bytes };
}

async function run(sealed: boolean, ks: ServerKey[]): Promise<{ seconds: number; bytes: number }> {
  if (cfg.party) return runBlocks(sealed, ks, cfg.party);
  const t0 = cpu();
  let bytes = 0;
  const B = cfg.batchSize;
  for (let b = 0; b * B < cfg.rows.length; b++) {
    const p = prepareBatch(cfg.study, cfg.studyId, cfg.rows.slice(b * B, (b + 1) * B), randomBytes(32), { full: b % N });
    for (const sb of p.servers) {
      if (!sealed) bytes += plainBody(p.reportIds, sb).length;
      else {
        const body = await seal({
          studyId: cfg.studyId, serverId: cfg.study.servers[sb.position], key: ks[sb.position], content: sb.content,
          reportIds: p.reportIds, plaintexts: p.reportIds.map((_, i) => concat(sb.proofs[i], sb.payloads[i])),
        });
        bytes += body.length;
      }
    }
  }
  return { seconds: cpu() - t0, bytes };
}

const ks = await keys();
await run(true, ks); // warm-up: JIT, tables, key import
const out: Record<string, number[]> = { prepare: [], prepare_seal: [] };
let bytes = { prepare: 0, prepare_seal: 0 };
for (let r = 0; r < cfg.repeats; r++) {
  const a = await run(false, ks);
  const b = await run(true, ks);
  out.prepare.push(a.seconds);
  out.prepare_seal.push(b.seconds);
  bytes = { prepare: a.bytes, prepare_seal: b.bytes };
}
process.stdout.write(JSON.stringify({ seconds: out, bytes, rows: cfg.rows.length, node: process.version }));
