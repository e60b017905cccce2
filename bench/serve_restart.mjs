// Time to first token after a restart, and what an agent session writes to
// disk: by hand, not in CI (bench/SERVE.md, "After a restart").
//
//   node bench/serve_restart.mjs ttft ENGINE BIN MODEL PORT TOKENS API [EXTRA...]
//     a fresh server (ENGINE kvtier or llama, the binary BIN, --ctx or -c
//     from TOKENS), a prompt of about TOKENS tokens through API
//     (completions or chat), max_tokens 1: cold; then SIGTERM, a restart on
//     the same --kv-disk-dir and the same request. One JSON line per case:
//     prompt tokens, cached tokens (kvtier's usage; llama.cpp's timings'
//     cache_n), seconds from sending the request to its answer (one token:
//     the answer is the first token).
//   node bench/serve_restart.mjs session BIN MODEL PORT TURNS [EXTRA...]
//     kvtier only: an agent-like conversation through chat completions, a
//     2,000-word system prompt, then TURNS turns of a 400-word tool result
//     each and a reply of up to 32 tokens kept in the conversation; then
//     SIGKILL (a crash: no shutdown save, so what comes back is what the
//     save policy wrote) and `cache stats` (records written, bytes), a
//     restart and the next turn (its cached tokens and time).
// EXTRA arguments go to the server. The text is seeded pseudo-English
// (about 0.92 words, 3.7 bytes, per token of the llama SPM vocabulary).
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync, openSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { request } from 'node:http';
import { join } from 'node:path';

const WORDS = ('the of and to in is was for on that with as by at from his her an which this be are it or had not ' +
  'but were have their one all also its been has who they more other when into after first two over time only new ' +
  'some these than most used during between would about such later under year can made up out many may then what ' +
  'where while both each').split(' ');

function text(words, seed) {
  let s = seed >>> 0, out = [];
  const r = () => (s = (Math.imul(s, 1103515245) + 12345) >>> 0) >>> 8;
  for (let i = 0; i < words; i++) out.push(WORDS[r() % WORDS.length] + (r() % 11 === 0 ? '.' : ''));
  return out.join(' ');
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function start(engine, bin, model, port, ctx, dir, extra) {
  try {
    await fetch(`http://127.0.0.1:${port}/health`);
    throw new Error(`port ${port} is in use`);
  } catch (e) { if (e.message.startsWith('port')) throw e; }
  const args = engine === 'kvtier'
    ? ['serve', '--model', model, '--port', String(port), '--threads', '2', '--ctx', String(ctx), '--parallel', '1',
      '--kv-disk-dir', join(dir, 'kv'), '--kv-ram-mb', '8192', '--request-timeout', '3600', ...extra]
    : ['-m', model, '--port', String(port), '-t', '2', '-tb', '2', '-c', String(ctx), '-np', '1', '--no-webui', ...extra];
  const log = openSync(join(dir, `${engine}.log`), 'a');
  const p = spawn(bin, args, { stdio: ['ignore', log, log] });
  for (let i = 0; i < 1200; i++) {
    try {
      const r = await fetch(`http://127.0.0.1:${port}/health`);
      if (r.status === 200) return p;
    } catch { /* not up yet */ }
    if (p.exitCode !== null) throw new Error(`${bin} exited ${p.exitCode} (log ${dir})`);
    await sleep(100);
  }
  p.kill('SIGKILL');
  throw new Error(`${bin} did not come up`);
}

async function stop(p, sig = 'SIGTERM') {
  const done = new Promise((r) => p.once('exit', r));
  p.kill(sig);
  await done;
}

// POST without a client timeout (fetch gives up on headers after 300 s; a
// cold prefill of 20,000 tokens on 2 busy cores takes longer).
function post(port, path, obj) {
  return new Promise((resolve, reject) => {
    const data = JSON.stringify(obj);
    const req = request({ host: '127.0.0.1', port, path, method: 'POST',
      headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(data) } }, (res) => {
      let text = '';
      res.setEncoding('utf8');
      res.on('data', (c) => { text += c; });
      res.on('end', () => resolve({ status: res.statusCode, text }));
    });
    req.on('error', reject);
    req.end(data);
  });
}

async function ask(port, api, body) {
  const t0 = performance.now();
  const r = await post(port, `/v1/${api === 'chat' ? 'chat/completions' : 'completions'}`,
    { max_tokens: 1, temperature: 0, ...body });
  const secs = (performance.now() - t0) / 1000;
  if (r.status !== 200) throw new Error(`HTTP ${r.status}: ${r.text.slice(0, 300)}`);
  const j = JSON.parse(r.text);
  const u = j.usage || {};
  const cached = j.timings ? j.timings.cache_n : (u.prompt_tokens_details || {}).cached_tokens;
  const reply = api === 'chat' ? j.choices[0].message.content : j.choices[0].text;
  return { prompt: u.prompt_tokens, cached, secs: +secs.toFixed(3), reply };
}

function body(api, words) {
  const t = text(words, 7);
  return api === 'chat' ? { messages: [{ role: 'user', content: t }] } : { prompt: t };
}

async function ttft([engine, bin, model, port, tokens, api, ...extra]) {
  const dir = mkdtempSync(join(tmpdir(), 'kvtier-restart-'));
  const n = +tokens, ctx = Math.ceil((n * 1.1 + 256) / 1024) * 1024, b = body(api, Math.round(n * 0.915));
  let p;
  try {
    p = await start(engine, bin, model, +port, ctx, dir, extra);
    const cold = await ask(+port, api, b);
    await stop(p);
    p = await start(engine, bin, model, +port, ctx, dir, extra);
    const again = await ask(+port, api, b);
    await stop(p);
    p = null;
    for (const [c, r] of [['cold', cold], ['restart', again]])
      console.log(JSON.stringify({ engine, bin, api, case: c, prompt: r.prompt, cached: r.cached,
        prefilled: r.prompt - (r.cached || 0), secs: r.secs, extra: extra.join(' ') }));
  } finally {
    if (p && p.exitCode === null) p.kill('SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  }
}

function stats(bin, dir) {
  const out = execFileSync(bin, ['cache', 'stats', '--kv-disk-dir', join(dir, 'kv')], { encoding: 'utf8' });
  return out.trim().replace(/\n+/g, '; ');
}

async function session([bin, model, port, turns, ...extra]) {
  const dir = mkdtempSync(join(tmpdir(), 'kvtier-session-'));
  const msgs = [{ role: 'system', content: text(2000, 1) }];
  try {
    let p = await start('kvtier', bin, model, +port, 32768, dir, extra);
    let last;
    for (let i = 0; i < +turns; i++) {
      msgs.push({ role: 'user', content: `Tool result ${i}: ` + text(400, 100 + i) });
      last = await ask(+port, 'chat', { messages: msgs, max_tokens: 32 });
      msgs.push({ role: 'assistant', content: last.reply });
    }
    await sleep(3000); /* the store thread's last saves */
    await stop(p, 'SIGKILL');
    const st = stats(bin, dir);
    msgs.push({ role: 'user', content: `Tool result ${turns}: ` + text(400, 100 + +turns) });
    p = await start('kvtier', bin, model, +port, 32768, dir, extra);
    const next = await ask(+port, 'chat', { messages: msgs });
    await stop(p);
    console.log(JSON.stringify({ bin, turns: +turns, last_prompt: last.prompt, stats: st, next_prompt: next.prompt,
      next_cached: next.cached, next_prefilled: next.prompt - next.cached, next_secs: next.secs,
      extra: extra.join(' ') }));
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

const [mode, ...rest] = process.argv.slice(2);
await (mode === 'ttft' ? ttft(rest) : mode === 'session' ? session(rest) : Promise.reject(new Error(
  'usage: serve_restart.mjs ttft ENGINE BIN MODEL PORT TOKENS API [EXTRA...] | session BIN MODEL PORT TURNS [EXTRA...]')));
