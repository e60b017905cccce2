// One copy of a prefix in RAM: by hand, not in CI (bench/SERVE.md, "Shared
// prefixes").
//
//   node bench/serve_share.mjs share BIN MODEL PORT WORDS COUNTS [EXTRA...]
//     kvtier only, no disk tier: conversations on one system prompt of
//     WORDS words (chat completions, a short user message of its own each,
//     max_tokens 1), one after another, up to the largest of COUNTS
//     (comma-separated, e.g. 1,2,4,8,16). After each count in COUNTS, one
//     JSON line: the server's anonymous resident memory (RssAnon, the KV
//     cache and scratch: the weights are mapped from the file), the RAM
//     tier's bytes from /metrics, and the time to first token of the
//     conversation just sent.
//   node bench/serve_share.mjs itl BIN MODEL PORT WORDS STREAM [EXTRA...]
//     kvtier with a disk tier: a prompt of WORDS words (max_tokens 1), whose
//     save the store thread runs after its prefill; as soon as it answers,
//     a stream of STREAM tokens on a short prompt of its own. One JSON line:
//     the times between the stream's tokens while the save ran (from
//     /metrics, kvtier_disk_queue polled every 10 ms) and after it (p50,
//     p99 by nearest rank), and the save's time.
// EXTRA arguments go to the server (the last of a repeated flag wins).
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ask, sleep, start, stop, text } from './serve_lib.mjs';

async function metric(port, name) {
  const t = await (await fetch(`http://127.0.0.1:${port}/metrics`)).text();
  for (const line of t.split('\n')) {
    if (line.startsWith(name + ' ') || line.startsWith(name + '{tier="ram"} ')) return +line.split(' ').pop();
  }
  return NaN;
}

function rssAnon(pid) {
  const m = /RssAnon:\s+(\d+) kB/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
  return m ? +m[1] * 1024 : NaN;
}

const gib = (b) => +(b / 2 ** 30).toFixed(3);

async function share([bin, model, port, words, counts, ...extra]) {
  const dir = mkdtempSync(join(tmpdir(), 'kvtier-share-'));
  const want = counts.split(',').map(Number), n = Math.max(...want);
  const system = text(+words, 11), ctx = Math.ceil((+words * 1.2 + 1024) / 1024) * 1024;
  let p;
  try {
    p = await start('kvtier', bin, model, +port, ctx, dir, ['--no-kv-disk', '--kv-ram-mb', '65536', ...extra]);
    const base = rssAnon(p.pid);
    for (let i = 1; i <= n; i++) {
      const r = await ask(+port, 'chat', { messages: [{ role: 'system', content: system },
        { role: 'user', content: `Conversation ${i}: ` + text(30, 1000 + i) }] });
      if (!want.includes(i)) continue;
      const rss = rssAnon(p.pid);
      console.log(JSON.stringify({ conversations: i, prompt: r.prompt, cached: r.cached, ttft_s: r.secs,
        rss_anon_gib: gib(rss), rss_anon_growth_gib: gib(rss - base),
        ram_tier_gib: gib(await metric(+port, 'kvtier_cache_bytes')), extra: extra.join(' ') }));
    }
    await stop(p);
    p = null;
  } finally {
    if (p && p.exitCode === null) p.kill('SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  }
}

// A streaming completion: the arrival time (ms) of each token's event.
async function stream(port, prompt, tokens) {
  const res = await fetch(`http://127.0.0.1:${port}/v1/completions`, {
    method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ prompt, max_tokens: tokens, temperature: 0, stream: true, ignore_eos: true }),
  });
  if (res.status !== 200) throw new Error(`stream: HTTP ${res.status}`);
  const times = [], dec = new TextDecoder();
  let buf = '';
  for await (const chunk of res.body) {
    const now = performance.now();
    buf += dec.decode(chunk, { stream: true });
    let i;
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const ev = buf.slice(0, i);
      buf = buf.slice(i + 2);
      if (ev.startsWith('data: {') && JSON.parse(ev.slice(6)).choices?.[0]?.text) times.push(now);
    }
  }
  return times;
}

function pct(gaps) {
  const s = [...gaps].sort((a, b) => a - b), q = (x) => s[Math.min(s.length - 1, Math.ceil(x * s.length) - 1)];
  return { n: s.length, p50_ms: +q(0.5)?.toFixed(2), p99_ms: +q(0.99)?.toFixed(2), max_ms: +s[s.length - 1]?.toFixed(2) };
}

async function itl([bin, model, port, words, tokens, ...extra]) {
  const dir = mkdtempSync(join(tmpdir(), 'kvtier-itl-'));
  const ctx = Math.ceil((+words * 1.2 + 1024) / 1024) * 1024;
  let p;
  try {
    p = await start('kvtier', bin, model, +port, ctx, dir, ['--parallel', '2', '--kv-ram-mb', '65536', ...extra]);
    const long = await ask(+port, 'completions', { prompt: text(+words, 21) });
    const t0 = performance.now();
    const s = stream(+port, text(20, 22), +tokens);
    let saving = true, end = t0;
    while (saving) {
      if (!(await metric(+port, 'kvtier_disk_queue') > 0)) { saving = false; end = performance.now(); }
      else await sleep(10);
    }
    const times = await s;
    const during = [], after = [];
    for (let i = 2; i < times.length; i++) (times[i] <= end ? during : after).push(times[i] - times[i - 1]);
    const d = pct(during), a = pct(after);
    console.log(JSON.stringify({ prompt: long.prompt, save_s: +((end - t0) / 1000).toFixed(3), during: d, after: a,
      p99_during_over_p50_after: +(d.p99_ms / a.p50_ms).toFixed(2), extra: extra.join(' ') }));
    await stop(p);
    p = null;
  } finally {
    if (p && p.exitCode === null) p.kill('SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  }
}

const [mode, ...rest] = process.argv.slice(2);
await (mode === 'share' ? share(rest) : mode === 'itl' ? itl(rest) : Promise.reject(new Error(
  'usage: serve_share.mjs share BIN MODEL PORT WORDS COUNTS [EXTRA...] | itl BIN MODEL PORT WORDS STREAM [EXTRA...]')));
