// llama.cpp's tokenizer as a peer: `node tests/peer/tokenize.mjs MODEL.gguf [CASES.json]`
//
// Loads only the vocabulary of MODEL.gguf (no weights) into the llama.cpp that
// node-llama-cpp ships prebuilt (@node-llama-cpp/linux-x64, CPU only; never
// built or downloaded), reads a JSON array of {"text": string, "special": bool}
// from CASES.json (stdin when absent or "-") and prints one line per case, in
// order: the JSON array of the ids llama.cpp gives. model.tokenize(text, special)
// is the addon's common_tokenize(vocab, text, add_special = false,
// parse_special = special), i.e. llama_tokenize without BOS/EOS.
//
// Before those lines comes a header, {"llama_cpp": "REPO@RELEASE", "build":
// "prebuilt", "vocab": TYPE}, so the caller can tell whose tokenizer answered.
// stdout carries only JSON; llama.cpp's log lines (errors only) go to stderr.
// Two of them are expected: loadModel first tries a full load to estimate
// memory ("missing tensor 'token_embd.weight'" for a vocab-only file), then
// falls back to a heuristic and loads the vocabulary. Exit status 0 on
// success, 1 on any error.
import fs from "node:fs";
import { getLlama, LlamaLogLevel } from "node-llama-cpp";

const [modelPath, casesPath = "-"] = process.argv.slice(2);
if (!modelPath) {
    process.stderr.write("usage: node tokenize.mjs MODEL.gguf [CASES.json|-]\n");
    process.exit(2);
}

const cases = JSON.parse(fs.readFileSync(casesPath === "-" ? 0 : casesPath, "utf8"));
if (!Array.isArray(cases)) throw new Error("the cases must be a JSON array");

const llama = await getLlama({
    gpu: false,
    build: "never",
    skipDownload: true,
    usePrebuiltBinaries: true,
    progressLogs: false,
    logLevel: LlamaLogLevel.error,
    logger: (level, message) => process.stderr.write(`[llama.cpp ${level}] ${message}\n`),
});
const model = await llama.loadModel({ modelPath, vocabOnly: true });

const out = [JSON.stringify({
    llama_cpp: `${llama.llamaCppRelease.repo}@${llama.llamaCppRelease.release}`,
    build: llama.buildType,
    vocab: model.vocabularyType,
})];
for (const c of cases) {
    if (typeof c?.text !== "string") throw new Error("a case without a text string");
    out.push(JSON.stringify(model.tokenize(c.text, Boolean(c.special))));
}
process.stdout.write(out.join("\n") + "\n");

await model.dispose();
await llama.dispose();
