// The remote tier's time to first token: by hand, not in CI (bench/SERVE.md,
// "Remote tier").
//
//   node bench/serve_remote.mjs BIN MODEL PORT WORDS [EXTRA...]
//
// Starts a redis-server of its own on a free port (no persistence,
// maxmemory 16 GB with allkeys-lru), then three kvtier servers one after
// another, each on PORT with --threads 2 and --parallel 1 (the two with
// the remote tier with --kv-remote-timeout-ms 1000):
//   A  an empty disk, --kv-remote: an agent prompt (a system prompt of WORDS
//      words and a short user message, chat completions, max_tokens 1),
//      prefilled cold; its save committed and uploaded before A stops;
//   A' A's disk again, no remote tier: the same prompt, a disk hit;
//   B  another empty disk, --kv-remote: the same prompt, a remote hit.
// One JSON line: each time to first token, the tokens each reused, the
// bytes B read from Redis (kvtier_remote_bytes_total) and what A wrote, the
// remote load's time, the most bytes of values B's restore held at once
// (kvtier_remote_load_peak_bytes), the peak resident set (VmHWM) of A' and
// B, Redis's used memory, and whether the three replies (greedy) agree.
// EXTRA arguments go to every server.
import { spawn } from 'node:child_process';
import { mkdirSync, mkdtempSync, openSync, readFileSync, rmSync } from 'node:fs';
import { createServer, connect } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ask, sleep, start, stop, text } from './serve_lib.mjs';

function freePort() {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => { const p = s.address().port; s.close(() => resolve(p)); });
  });
}

// One inline command to Redis; the reply's text.
function redis(port, line) {
  return new Promise((resolve, reject) => {
    const c = connect(port, '127.0.0.1');
    let buf = '';
    c.on('error', reject);
    c.on('data', (d) => {
      buf += d;
      const m = /^\$(\d+)\r\n/.exec(buf);
      if ((buf[0] === '+' || buf[0] === '-' || buf[0] === ':') && buf.endsWith('\r\n')) { c.end(); resolve(buf); }
      else if (m && buf.length >= m[0].length + +m[1] + 2) { c.end(); resolve(buf.slice(m[0].length, m[0].length + +m[1])); }
    });
    c.write(line + '\r\n');
  });
}

// A process's peak resident set in kB (VmHWM), null when it cannot be read.
function hwm(p) {
  try { return +/VmHWM:\s+(\d+)/.exec(readFileSync(`/proc/${p.pid}/status`, 'utf8'))[1]; } catch { return null; }
}

async function metrics(port) {
  const t = await (await fetch(`http://127.0.0.1:${port}/metrics`)).text(), out = {};
  for (const line of t.split('\n')) if (line && line[0] !== '#') out[line.slice(0, line.lastIndexOf(' '))] = +line.split(' ').pop();
  return out;
}

const [bin, model, port, words, ...extra] = process.argv.slice(2);
if (!words) throw new Error('usage: serve_remote.mjs BIN MODEL PORT WORDS [EXTRA...]');
const dir = mkdtempSync(join(tmpdir(), 'kvtier-remote-'));
mkdirSync(join(dir, 'a'));
mkdirSync(join(dir, 'b'));
const rport = await freePort(), url = `redis://127.0.0.1:${rport}`;
const rlog = openSync(join(dir, 'redis.log'), 'a');
const rs = spawn('redis-server', ['--port', String(rport), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no',
  '--dir', dir, '--maxmemory', '16gb', '--maxmemory-policy', 'allkeys-lru'], { stdio: ['ignore', rlog, rlog] });
const ctx = Math.ceil((+words * 1.2 + 1024) / 1024) * 1024;
const body = { messages: [{ role: 'system', content: text(+words, 31) },
  { role: 'user', content: 'Task 1: ' + text(30, 32) }] };
let p;
try {
  for (let i = 0; ; i++) {
    try { if ((await redis(rport, 'PING')).startsWith('+PONG')) break; } catch { /* not up yet */ }
    if (i > 100) throw new Error('redis-server did not come up');
    await sleep(100);
  }
  // a lookup of a 20,000-token prompt is 154 HGETALLs in one pipeline:
  // 20 ms (the default) is too short with Redis on 2 busy cores
  const remote = ['--kv-remote', url, '--kv-remote-timeout-ms', '1000', ...extra];
  // A: cold, saved, uploaded
  p = await start('kvtier', bin, model, +port, ctx, join(dir, 'a'), remote);
  const cold = await ask(+port, 'chat', body);
  let ma;
  for (let i = 0, quiet = 0; ; i++) { // idle on two polls a second apart
    ma = await metrics(+port);
    const idle = ma['kvtier_remote_uploads_total'] >= 1 && !ma['kvtier_remote_upload_queue'] && !ma['kvtier_disk_queue'];
    if (idle && ++quiet >= 2) break;
    if (!idle) quiet = 0;
    if (i > 3600) throw new Error('A did not upload');
    await sleep(1000);
  }
  await stop(p);
  // A': the disk hit
  p = await start('kvtier', bin, model, +port, ctx, join(dir, 'a'), extra);
  const disk = await ask(+port, 'chat', body);
  const disk_hwm = hwm(p);
  await stop(p);
  // B: an empty disk, the remote hit
  p = await start('kvtier', bin, model, +port, ctx, join(dir, 'b'), remote);
  const hit = await ask(+port, 'chat', body);
  const mb = await metrics(+port);
  const remote_hwm = hwm(p);
  await stop(p);
  p = null;
  const mem = /used_memory:(\d+)/.exec(await redis(rport, 'INFO memory'));
  console.log(JSON.stringify({
    model: model.split('/').pop(), prompt: cold.prompt,
    cold_ttft_s: cold.secs, disk_ttft_s: disk.secs, disk_cached: disk.cached,
    remote_ttft_s: hit.secs, remote_cached: hit.cached,
    remote_bytes_read: mb['kvtier_remote_bytes_total{direction="read"}'],
    remote_bytes_per_token: Math.round(mb['kvtier_remote_bytes_total{direction="read"}'] / hit.cached),
    remote_load_s: +mb['kvtier_remote_seconds_total{phase="hit_load"}'].toFixed(3),
    remote_lookup_s: +mb['kvtier_remote_seconds_total{phase="lookup"}'].toFixed(4),
    remote_load_peak_bytes: mb['kvtier_remote_load_peak_bytes'], disk_hwm_kb: disk_hwm, remote_hwm_kb: remote_hwm,
    uploaded_bytes: ma['kvtier_remote_bytes_total{direction="written"}'],
    redis_used_memory: mem ? +mem[1] : null,
    remote_abandoned: mb['kvtier_remote_abandoned_total'], remote_errors: mb['kvtier_remote_errors_total'],
    remote_misses: mb['kvtier_remote_lookups_total{result="miss"}'],
    same_reply: cold.reply === disk.reply && cold.reply === hit.reply, extra: extra.join(' '),
  }));
} finally {
  if (p && p.exitCode === null) p.kill('SIGKILL');
  rs.kill('SIGKILL');
  rmSync(dir, { recursive: true, force: true });
}
