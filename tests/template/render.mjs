// A chat template rendered by @huggingface/jinja, the reference for kvtier's
// built-in renderers: `node tests/template/render.mjs BUNDLE TEMPLATE CASES.json`
//
// TEMPLATE is a path inside llama.cpp's source (models/templates/NAME.jinja),
// read from the git bundle BUNDLE (node-llama-cpp's llama/gitRelease.bundle)
// at its HEAD, so the template is the one of the llama.cpp release the other
// peer tests use. CASES.json (stdin when "-") is a JSON array of template
// contexts ({messages, tools, add_generation_prompt, bos_token, thinking,
// ...}); stdout gets one line per case, in order: the rendering as a JSON
// string, or {"error": message} when the template raised. Exit status 0
// unless the template cannot be read.
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { execFileSync } from "node:child_process";
import { Template } from "@huggingface/jinja";

const [bundle, name, casesPath = "-"] = process.argv.slice(2);
if (!bundle || !name) {
    process.stderr.write("usage: node render.mjs BUNDLE TEMPLATE [CASES.json|-]\n");
    process.exit(2);
}

// git show needs a repository: a bare clone of the bundle (about 1 s).
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "kvt-template-"));
let source;
try {
    execFileSync("git", ["clone", "-q", "--bare", bundle, tmp + "/r.git"], { stdio: ["ignore", "ignore", "inherit"] });
    source = execFileSync("git", ["--git-dir", tmp + "/r.git", "show", "HEAD:" + name], { encoding: "utf8" });
} finally {
    fs.rmSync(tmp, { recursive: true, force: true });
}

const template = new Template(source);
const cases = JSON.parse(fs.readFileSync(casesPath === "-" ? 0 : casesPath, "utf8"));
if (!Array.isArray(cases)) throw new Error("the cases must be a JSON array");
const out = [];
for (const c of cases) {
    try {
        out.push(JSON.stringify(template.render(c)));
    } catch (e) {
        out.push(JSON.stringify({ error: String(e.message || e) }));
    }
}
process.stdout.write(out.join("\n") + "\n");
