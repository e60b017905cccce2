// Chat templates rendered by @huggingface/jinja, the reference for kvtier's
// built-in renderers:
//   node tests/template/render.mjs BUNDLE TEMPLATE CASES.json [SOURCE_DIR]
//
// TEMPLATE is a path inside llama.cpp's source (models/templates/NAME.jinja),
// read from the git bundle BUNDLE (node-llama-cpp's llama/gitRelease.bundle)
// at its HEAD, so the template is the one of the llama.cpp release the other
// peer tests use. CASES.json (stdin when "-") is a JSON array of template
// contexts ({messages, tools, add_generation_prompt, bos_token, thinking,
// ...}); a context may name another template of the bundle ("__template")
// and substitutions to make in its text first ("__patch": [[FROM, TO], ...],
// each FROM found exactly once, else the script fails). stdout gets one line
// per case, in order: the rendering as a JSON string, or {"error": message}
// when the template raised. SOURCE_DIR, when given, receives the text of
// every template read, as it is in the bundle, under its base name. Exit
// status 0 unless a template cannot be read or patched.
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { execFileSync } from "node:child_process";
import { Template } from "@huggingface/jinja";

const [bundle, name, casesPath = "-", sourceDir] = process.argv.slice(2);
if (!bundle || !name) {
    process.stderr.write("usage: node render.mjs BUNDLE TEMPLATE [CASES.json|-] [SOURCE_DIR]\n");
    process.exit(2);
}

const cases = JSON.parse(fs.readFileSync(casesPath === "-" ? 0 : casesPath, "utf8"));
if (!Array.isArray(cases)) throw new Error("the cases must be a JSON array");

// git show needs a repository: a bare clone of the bundle (about 1 s).
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "kvt-template-"));
const sources = new Map();
try {
    execFileSync("git", ["clone", "-q", "--bare", bundle, tmp + "/r.git"], { stdio: ["ignore", "ignore", "inherit"] });
    for (const n of new Set([name, ...cases.map((c) => c.__template).filter(Boolean)]))
        sources.set(n, execFileSync("git", ["--git-dir", tmp + "/r.git", "show", "HEAD:" + n], { encoding: "utf8" }));
} finally {
    fs.rmSync(tmp, { recursive: true, force: true });
}
if (sourceDir) for (const [n, src] of sources) fs.writeFileSync(path.join(sourceDir, path.basename(n)), src);

const templates = new Map();
function template(n, patch) {
    const key = JSON.stringify([n, patch]);
    if (!templates.has(key)) {
        let src = sources.get(n);
        for (const [from, to] of patch) {
            const at = src.indexOf(from);
            if (at < 0 || src.indexOf(from, at + 1) >= 0)
                throw new Error(`${n}: the patch text ${JSON.stringify(from)} is not there exactly once`);
            src = src.slice(0, at) + to + src.slice(at + from.length);
        }
        templates.set(key, new Template(src));
    }
    return templates.get(key);
}

const out = [];
for (const c of cases) {
    const t = template(c.__template || name, c.__patch || []);
    delete c.__template;
    delete c.__patch;
    try {
        out.push(JSON.stringify(t.render(c)));
    } catch (e) {
        out.push(JSON.stringify({ error: String(e.message || e) }));
    }
}
process.stdout.write(out.join("\n") + "\n");
