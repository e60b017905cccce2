// What the serving benchmarks share (bench/serve_restart.mjs,
// bench/serve_share.mjs): seeded pseudo-English, a server started and
// stopped, a request without a client timeout.
import { spawn } from 'node:child_process';
import { openSync } from 'node:fs';
import { request } from 'node:http';
import { join } from 'node:path';

const WORDS = ('the of and to in is was for on that with as by at from his her an which this be are it or had not ' +
  'but were have their one all also its been has who they more other when into after first two over time only new ' +
  'some these than most used during between would about such later under year can made up out many may then what ' +
  'where while both each').split(' ');

export function text(words, seed) {
  let s = seed >>> 0, out = [];
  const r = () => (s = (Math.imul(s, 1103515245) + 12345) >>> 0) >>> 8;
  for (let i = 0; i < words; i++) out.push(WORDS[r() % WORDS.length] + (r() % 11 === 0 ? '.' : ''));
  return out.join(' ');
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

export async function start(engine, bin, model, port, ctx, dir, extra) {
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

export async function stop(p, sig = 'SIGTERM') {
  const done = new Promise((r) => p.once('exit', r));
  p.kill(sig);
  await done;
}

// POST without a client timeout (fetch gives up on headers after 300 s; a
// cold prefill of 20,000 tokens on 2 busy cores takes longer).
export function post(port, path, obj) {
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

export async function ask(port, api, body) {
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

