// One headless session of a real agent CLI against kvtier serve, through
// the recording proxy (proxy.mjs), with checks on what the proxy saw:
//
//   node run.mjs BASE_URL CLIENT KEY CHECK PROMPT STATE_DIR
//   node run.mjs check            (exit 0 when node_modules holds the pinned clients)
//
// CLIENT is one of
//   claude        Claude Code, Anthropic Messages   POST /v1/messages?beta=true
//   codex         Codex, OpenAI Responses           POST /v1/responses
//   pi-chat       Pi, api "openai-completions"      POST /v1/chat/completions
//   pi-responses  Pi, api "openai-responses"        POST /v1/responses
//   pi-messages   Pi, api "anthropic-messages"      POST /v1/messages
//
// KEY is the API key the client sends. Every session of a client in one
// STATE_DIR runs with the same HOME (STATE_DIR/CLIENT/home) and the same
// working directory (STATE_DIR/work): both appear in the clients' system
// prompts, so sessions of one user in one project share their prompt prefix.
//
// CHECK, applied to the session's first request to its API endpoint (the one
// that carries PROMPT; a client may send more, e.g. Claude Code asks again
// after an empty reply):
//   cold      nothing reused: cached 0, no tier reused anything
//   ram       cached >= 90% of the prompt, reused from RAM (no disk load)
//   disk      cached >= 90% of the prompt, restored from disk
//   ram:P, disk:P   the same with P% (a template that puts what follows the
//             user's text, such as a client's late system message, after
//             it leaves only the part before it to reuse)
//   isolated  the key's first request ever: cached 0 although another key
//             has the same prefix cached; a later request of the session may
//             reuse no more than this session itself computed before it
// and to every request: the client exited 0 and reports success; every
// exchange is a 2xx; every stream ends with its closing event
// (message_stop, response.completed, data: [DONE]) and carries usage; the
// usage's prompt size equals the server's kvtier_prompt_tokens_total delta,
// and its cached count equals the tier's kvtier_reused_tokens_total delta.
//
// Tier deltas come from /metrics, read by the proxy just before and just
// after each request (it forwards one request at a time).
//
// STATE_DIR/CLIENT/state.json keeps, per PROMPT, the prompt size the first
// session with it had, so that a later session with the same PROMPT (the
// isolation check under another key) is known to send the same prompt.
// Each session's exchanges are kept in STATE_DIR/CLIENT/session-N.jsonl and
// its output in STATE_DIR/CLIENT/session-N.out.
import { spawn } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { startProxy } from './proxy.mjs';

const HERE = dirname(fileURLToPath(import.meta.url));
const BIN = join(HERE, 'node_modules', '.bin');
const SESSION_TIMEOUT_MS = 180000;
const MAX_TOKENS = 64;

// The served model is synthetic: its greedy reply is arbitrary bytes and
// special tokens, and it seldom ends a reply by itself. Claude Code treats a
// reply cut by max_tokens as an error (after three "continue" requests), so
// its requests get stop sequences that end the reply at the first of 32
// likely outputs: the built-in byte tokenizer's 15 special markers and 17
// ASCII characters (stop_reason "stop_sequence"). Each generated token is
// one of them with probability 32/271, so a 64-token reply misses all of
// them with probability (239/271)^64, about 3e-4. Codex and Pi accept a
// reply cut at the length limit.
const STOPS = ['<｜begin▁of▁sentence｜>', '<｜end▁of▁sentence｜>', '<｜User｜>', '<｜Assistant｜>', '<think>', '</think>',
  '｜DSML｜', '<tool_result>', '</tool_result>', '<｜place▁holder▁no▁0｜>', '<｜place▁holder▁no▁1｜>',
  '<｜place▁holder▁no▁2｜>', '<｜place▁holder▁no▁3｜>', '<｜place▁holder▁no▁4｜>', '<｜place▁holder▁no▁5｜>',
  ...'0123456789ZKhoeat'];
const CLAUDE_EXTRA_BODY = JSON.stringify({ temperature: 0, stop_sequences: STOPS });

const CLIENTS = {
  claude: { path: (r) => r.url.startsWith('/v1/messages') && !r.url.startsWith('/v1/messages/count_tokens'), api: 'messages' },
  codex: { path: (r) => r.url.startsWith('/v1/responses'), api: 'responses' },
  'pi-chat': { path: (r) => r.url.startsWith('/v1/chat/completions'), api: 'chat', piApi: 'openai-completions' },
  'pi-responses': { path: (r) => r.url.startsWith('/v1/responses'), api: 'responses', piApi: 'openai-responses' },
  'pi-messages': { path: (r) => r.url.startsWith('/v1/messages'), api: 'messages', piApi: 'anthropic-messages' },
};

let failed = false;
function check(cond, what, detail) {
  if (cond) { console.log(`  ok   ${what}`); return true; }
  failed = true;
  console.log(`  FAIL ${what}${detail === undefined ? '' : `: ${typeof detail === 'string' ? detail : JSON.stringify(detail)}`}`);
  return false;
}

// The installed versions must be the pinned ones, and Claude Code's
// postinstall must have put its native binary in place.
function checkDeps() {
  const want = JSON.parse(readFileSync(join(HERE, 'package.json'), 'utf8')).dependencies;
  let ok = true;
  for (const [name, version] of Object.entries(want)) {
    const p = join(HERE, 'node_modules', name, 'package.json');
    const have = existsSync(p) ? JSON.parse(readFileSync(p, 'utf8')).version : null;
    if (have !== version) { console.log(`${name}: installed ${have ?? 'nothing'}, pinned ${version}`); ok = false; }
  }
  const exe = join(HERE, 'node_modules', '@anthropic-ai', 'claude-code', 'bin', 'claude.exe');
  if (!existsSync(exe) || statSync(exe).size < 1 << 20) {
    console.log('@anthropic-ai/claude-code: bin/claude.exe is not the native binary (its postinstall did not run)');
    ok = false;
  }
  for (const b of ['claude', 'codex', 'pi']) {
    if (!existsSync(join(BIN, b))) { console.log(`node_modules/.bin/${b} is missing`); ok = false; }
  }
  process.exit(ok ? 0 : 1);
}

// The client's configuration and command line, pointed at the proxy.
function setup(client, url, key, prompt, home) {
  const env = {
    PATH: `${BIN}:${process.env.PATH ?? '/usr/bin:/bin'}`,
    HOME: home,
    LANG: 'C.UTF-8',
    TERM: 'dumb',
    NO_COLOR: '1',
    TMPDIR: process.env.TMPDIR ?? '/tmp',
  };
  if (client === 'claude') {
    Object.assign(env, {
      ANTHROPIC_BASE_URL: url,
      ANTHROPIC_AUTH_TOKEN: key,
      CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC: '1',
      DISABLE_AUTOUPDATER: '1',
      CLAUDE_CODE_MAX_OUTPUT_TOKENS: String(MAX_TOKENS),
      CLAUDE_CODE_EXTRA_BODY: CLAUDE_EXTRA_BODY,
    });
    return { env, cmd: 'claude', args: ['-p', prompt, '--max-turns', '1', '--output-format', 'json'] };
  }
  if (client === 'codex') {
    const codexHome = join(home, '.codex');
    mkdirSync(codexHome, { recursive: true });
    writeFileSync(join(codexHome, 'config.toml'), [
      'model = "ds4-tiny"',
      'model_provider = "kvtier"',
      'check_for_update_on_startup = false',
      '',
      '[model_providers.kvtier]',
      'name = "kvtier"',
      `base_url = "${url}/v1"`,
      'wire_api = "responses"',
      'env_key = "KVTIER_API_KEY"',
      '',
    ].join('\n'));
    Object.assign(env, { CODEX_HOME: codexHome, KVTIER_API_KEY: key });
    return { env, cmd: 'codex', args: ['exec', '--json', '--skip-git-repo-check', prompt] };
  }
  // Pi: a provider in ~/.pi/agent/models.json
  const api = CLIENTS[client].piApi;
  const agentDir = join(home, '.pi', 'agent');
  mkdirSync(agentDir, { recursive: true });
  writeFileSync(join(agentDir, 'models.json'), JSON.stringify({
    providers: {
      kvtier: {
        // the Anthropic SDK appends /v1/messages itself; the OpenAI SDK appends /chat/completions or /responses
        baseUrl: api === 'anthropic-messages' ? url : `${url}/v1`,
        api,
        apiKey: 'KVTIER_API_KEY',
        models: [{ id: 'ds4-tiny', contextWindow: 131072, maxTokens: MAX_TOKENS }],
      },
    },
  }, null, 2));
  env.KVTIER_API_KEY = key;
  return { env, cmd: 'pi', args: ['-p', '--offline', '--mode', 'json', '--provider', 'kvtier', '--model', 'ds4-tiny', prompt] };
}

function runClient({ env, cmd, args }, cwd) {
  return new Promise((done) => {
    const child = spawn(join(BIN, cmd), args, { cwd, env, stdio: ['ignore', 'pipe', 'pipe'] });
    const out = [], err = [];
    child.stdout.on('data', (c) => out.push(c));
    child.stderr.on('data', (c) => err.push(c));
    const timer = setTimeout(() => child.kill('SIGKILL'), SESSION_TIMEOUT_MS);
    const t0 = performance.now();
    child.on('error', (e) => { clearTimeout(timer); done({ code: -1, signal: null, stdout: '', stderr: String(e), secs: 0 }); });
    child.on('close', (code, signal) => {
      clearTimeout(timer);
      done({ code, signal, stdout: Buffer.concat(out).toString('utf8'), stderr: Buffer.concat(err).toString('utf8'),
        secs: (performance.now() - t0) / 1000 });
    });
  });
}

// { prompt, cached, output } from any of the three usage shapes.
function counts(api, u) {
  if (!u) return null;
  if (api === 'messages') {
    const read = u.cache_read_input_tokens ?? 0, made = u.cache_creation_input_tokens ?? 0;
    return { prompt: (u.input_tokens ?? 0) + read + made, cached: read, output: u.output_tokens ?? 0 };
  }
  if (api === 'responses')
    return { prompt: u.input_tokens, cached: u.input_tokens_details?.cached_tokens ?? 0, output: u.output_tokens };
  return { prompt: u.prompt_tokens, cached: u.prompt_tokens_details?.cached_tokens ?? 0, output: u.completion_tokens };
}

const CLOSING = { messages: 'message_stop', responses: 'response.completed', chat: '[DONE]' };

// What the client itself says about the session.
function clientVerdict(client, res) {
  if (client === 'claude') {
    const line = res.stdout.trim().split('\n').filter((l) => l.startsWith('{')).pop();
    let j = null;
    try { j = JSON.parse(line); } catch { /* below */ }
    check(j && j.type === 'result' && j.subtype === 'success' && j.is_error === false,
      'Claude Code reports success (result, subtype success, is_error false)', j ?? res.stdout.slice(-400));
    if (j) console.log(`    claude: stop_reason ${j.stop_reason}, num_turns ${j.num_turns}, usage input ${j.usage?.input_tokens} ` +
      `cache_read ${j.usage?.cache_read_input_tokens} cache_creation ${j.usage?.cache_creation_input_tokens} output ${j.usage?.output_tokens}`);
    return;
  }
  const events = res.stdout.split('\n').filter((l) => l.startsWith('{')).map((l) => { try { return JSON.parse(l); } catch { return null; } })
    .filter(Boolean);
  if (client === 'codex') {
    const done = events.find((e) => e.type === 'turn.completed');
    const bad = events.filter((e) => e.type === 'turn.failed' || e.type === 'error');
    check(done && !bad.length, 'Codex reports turn.completed and no error event', bad.length ? bad : res.stdout.slice(-400));
    if (done) console.log(`    codex: turn.completed usage ${JSON.stringify(done.usage)}`);
    return;
  }
  const end = events.filter((e) => e.type === 'message_end' && e.message?.role === 'assistant').pop();
  const m = end?.message;
  check(m && ['stop', 'length'].includes(m.stopReason), 'Pi ends the assistant message with stopReason stop or length',
    m ? { stopReason: m.stopReason, errorMessage: m.errorMessage } : res.stdout.slice(-400));
  if (m) console.log(`    pi: stopReason ${m.stopReason}, usage ${JSON.stringify({ ...m.usage, cost: undefined })}`);
}

async function main() {
  const [base, client, key, checkArg, prompt, stateDir] = process.argv.slice(2);
  if (base === 'check') return checkDeps();
  // ram and disk take the share they must reuse: ram:40 is 40% (default 90)
  const [what, share] = (checkArg || '').split(':');
  const least = share === undefined ? 90 : Number(share);
  if (!base || !CLIENTS[client] || !key || !['cold', 'ram', 'disk', 'isolated'].includes(what) || !prompt || !stateDir ||
      !(least > 0 && least <= 100) || (share !== undefined && what !== 'ram' && what !== 'disk')) {
    console.error('usage: node run.mjs BASE_URL claude|codex|pi-chat|pi-responses|pi-messages KEY cold|ram[:P]|disk[:P]|isolated PROMPT STATE_DIR');
    process.exit(2);
  }
  const spec = CLIENTS[client];
  const dir = resolve(stateDir, client), home = join(dir, 'home'), work = resolve(stateDir, 'work');
  mkdirSync(home, { recursive: true });
  mkdirSync(work, { recursive: true });
  const statePath = join(dir, 'state.json');
  const state = existsSync(statePath) ? JSON.parse(readFileSync(statePath, 'utf8')) : { sessions: 0, prompts: {} };
  const n = ++state.sessions;
  writeFileSync(statePath, JSON.stringify(state, null, 1));
  const log = join(dir, `session-${n}.jsonl`);
  writeFileSync(log, '');

  console.log(`${client} session ${n}: key ${key}, expect ${what}, prompt ${JSON.stringify(prompt)}`);
  const proxy = await startProxy(base, { log });
  const res = await runClient(setup(client, proxy.url, key, prompt, home), work);
  await proxy.close();
  writeFileSync(join(dir, `session-${n}.out`), `exit ${res.code} signal ${res.signal}\n--- stdout\n${res.stdout}\n--- stderr\n${res.stderr}`);
  console.log(`    ${res.secs.toFixed(1)} s, exit ${res.code}${res.signal ? ` (signal ${res.signal})` : ''}, ${proxy.records.length} exchange(s):`);

  const recs = proxy.records;
  for (const r of recs) {
    const c = counts(spec.api, r.usage);
    console.log(`    #${r.n} ${r.method} ${r.url} ${r.status} ${r.ms} ms` +
      (c ? `: prompt ${c.prompt}, cached ${c.cached}, output ${c.output}` : '') +
      (r.tier ? ` (metrics: prompt +${r.tier.prompt}, ram +${r.tier.ram}, disk +${r.tier.disk})` : '') +
      (r.error ? ` error ${JSON.stringify(r.error).slice(0, 300)}` : ''));
  }
  const tail = (s) => s.length > 3000 ? `...${s.slice(-3000)}` : s;
  if (!check(res.code === 0, `${client} exits 0`, { code: res.code, signal: res.signal, stderr: tail(res.stderr), stdout: tail(res.stdout) }))
    return;
  clientVerdict(client, res);

  // every exchange
  check(recs.length > 0, 'the client sent requests through the proxy');
  for (const r of recs) check(r.status >= 200 && r.status < 300, `#${r.n} ${r.method} ${r.url} answered 2xx`, { status: r.status, error: r.error });
  const main = recs.filter((r) => r.method === 'POST' && spec.path(r));
  if (!check(main.length > 0, `at least one POST to the ${spec.api} endpoint`, recs.map((r) => `${r.method} ${r.url}`))) return;
  for (const r of main) {
    const c = counts(spec.api, r.usage);
    if (r.stream) check(r.events?.includes(CLOSING[spec.api]) && !r.error, `#${r.n} stream ends with ${CLOSING[spec.api]}`, { events: r.events, error: r.error });
    if (!check(c && Number.isInteger(c.prompt) && c.prompt > 0, `#${r.n} carries usage`, r.usage)) continue;
    if (r.tier) {
      check(c.prompt === r.tier.prompt, `#${r.n} usage prompt (${c.prompt}) = kvtier_prompt_tokens_total delta`, r.tier);
      check(c.cached === r.tier.ram + r.tier.disk, `#${r.n} usage cached (${c.cached}) = kvtier_reused_tokens_total delta`, r.tier);
    }
  }

  // the tier of the session's first request
  const first = main[0], c = counts(spec.api, first.usage), tier = first.tier;
  if (!c || !tier) {
    check(false, `#${first.n} has usage and metric deltas`, { status: first.status, usage: first.usage ?? null, tier: tier ?? null });
    return;
  }
  const pct = (x) => `${((100 * x) / c.prompt).toFixed(1)}%`;
  if (what === 'cold') {
    check(c.cached === 0 && tier.ram === 0 && tier.disk === 0, `first request is cold (cached ${c.cached})`, tier);
  } else if (what === 'ram') {
    check(c.cached >= least / 100 * c.prompt && tier.ram >= least / 100 * c.prompt && tier.disk === 0,
      `first request reuses >= ${least}% from RAM: ${tier.ram} of ${c.prompt} (${pct(tier.ram)})`, { usage: c, tier });
  } else if (what === 'disk') {
    check(c.cached >= least / 100 * c.prompt && tier.disk >= least / 100 * c.prompt && tier.ram === 0,
      `first request restores >= ${least}% from disk: ${tier.disk} of ${c.prompt} (${pct(tier.disk)})`, { usage: c, tier });
  } else {
    check(c.cached === 0 && tier.ram === 0 && tier.disk === 0,
      `first request of key ${key} reuses nothing (cached ${c.cached}, ram +${tier.ram}, disk +${tier.disk})`, { usage: c, tier });
    // what this session computed so far bounds what its later requests may reuse
    let own = c.prompt + c.output;
    for (const r of main.slice(1)) {
      const k = counts(spec.api, r.usage);
      if (!k) continue;
      check(k.cached <= own, `#${r.n} reuses no more than this key computed before (${k.cached} <= ${own})`, k);
      own = Math.max(own, k.prompt + k.output);
    }
  }
  const seen = state.prompts[prompt];
  if (seen === undefined) state.prompts[prompt] = c.prompt;
  else check(Math.abs(seen - c.prompt) <= 0.01 * seen, `the same prompt as the earlier session with it (${c.prompt} vs ${seen} tokens)`);
  writeFileSync(statePath, JSON.stringify(state, null, 1));
}

try {
  await main();
} catch (e) {
  failed = true;
  console.log(`  FAIL uncaught: ${e && e.stack ? e.stack : e}`);
}
console.log(failed ? 'failed' : 'all checks passed');
process.exit(failed ? 1 : 0);
