/**
 * CPU seconds for the Node client to prove one batch of a study with batch proofs
 * (prepareProofBatch: noise, roots, shares, parts, projections, proof, records), one thread.
 * Input: a JSON file {study, rows, key (hex), leader}; output on stdout: JSON with the seconds,
 * the rows, the leader's record length and the SHA-256 of every record (bench/proof_batch.py
 * compares them with the Python SDK's prepare_proof_batch from the same key: the same bytes).
 */
import { readFileSync } from "node:fs";
import { sha256 } from "@noble/hashes/sha2.js";
import { hex, unhex } from "../src/bytes.js";
import { prepareProofBatch } from "../src/proof_batch.js";
import type { Study } from "../src/study.js";

const cfg = JSON.parse(readFileSync(process.argv[2], "utf8")) as { study: Study; rows: number[][]; key: string; leader: number };
const cpu = () => {
  const u = process.cpuUsage();
  return (u.user + u.system) / 1e6;
};
const t0 = cpu(), w0 = performance.now();
const b = prepareProofBatch(cfg.study, cfg.rows, unhex(cfg.key), cfg.leader);
const seconds = cpu() - t0, wall = (performance.now() - w0) / 1000;
process.stdout.write(JSON.stringify({
  rows: cfg.rows.length, seconds, wall, leaderBytes: b.records[b.leader].body.length,
  records: b.records.map((r) => hex(sha256(r.body))), batchId: hex(b.batchId),
}));
