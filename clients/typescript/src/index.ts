/** dpsketch/2 client: the public surface. */
export { Client, batchKey, checkPolicy, type ConnectOptions, type SubmitOptions, type SubmitResult, type Progress, type ServerEndpoint } from "./client.js";
export { ProblemError, type RetryPolicy, type UploadResult } from "./upload.js";
export { studyId, canonicalStudy, validateStudy, width, noisePlan, clipBound, type Study } from "./study.js";
export { prepareBatch, plainBody, type PreparedBatch, type ServerBatch } from "./batch.js";
export { Keystream } from "./keystream.js";
export { draw, blockTable, noiseParameters } from "./noise.js";
export { encode, decode, expandSeed } from "./ring.js";
export { bind, commitment, reportId } from "./binding.js";
export { osnap, l1Rows } from "./sketch.js";
export * as sealedV4 from "./sealing/v4.js";
export { currentKey, keyId, type SuiteName } from "./sealing/suites.js";
export { hex, unhex } from "./bytes.js";
export { addRemoveStudyEpsilon, checkPromise, replaceOneEpsilon, gaussianEpsilon, type PromiseCheck } from "./accounting.js";
export { pseudonym, partySigns, prepareBlocks, blocksBody, blockMediaType, blocksMediaType, type BlockOptions, type PreparedBlocks } from "./parties.js";
export { blockPrefixes, blockId } from "./binding.js";
export { partyPlan, validityPlan, type ValidityPlan } from "./validity/study.js";
