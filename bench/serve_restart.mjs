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
import { execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ask, sleep, start, stop, text } from './serve_lib.mjs';

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
