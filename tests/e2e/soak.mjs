// The soak test's load (bench/soak.sh starts and restarts the server):
//
//   node soak.mjs BASE_URL load SECONDS CLIENTS STATE.json
//       CLIENTS clients loop for SECONDS, each request drawn at random:
//       one of a few long shared system prompts (1,500 to 3,500 bytes: ds4-tiny has a context of 4,096) or a
//       short prompt, a question, chat or completions, streaming or not,
//       1 to 48 tokens at temperature 0; one request in eight hangs up
//       after a random delay. Only 200 and 429 may come back (a 429 is
//       retried after its Retry-After); a hang-up is counted as such. The
//       answered non-streaming completions (prompt and text) go to STATE.
//   node soak.mjs BASE_URL replay STATE.json N
//       after a restart on the same disk directory: N of those prompts
//       again, each reply equal to the one the loaded server gave
//
// Raw fetch() only, no npm packages.
import fs from 'node:fs';
import { pseudoCode, rng, sleep } from './lib.mjs';

const [base, mode, ...args] = process.argv.slice(2);
const SYSTEMS = [1500, 2500, 3500].map((n, i) => pseudoCode(n, 40 + i));
const QUESTIONS = ['Which routines write to row?', 'List the ones that read tail.', 'What does blk_hash do?',
  'Name three loops.', 'Which function is longest?', 'Summarise listing two.'];

function pick(r, a) { return a[Math.floor(r() * a.length)]; }

async function one(r, stats, answered) {
  const long = r() < 0.6;
  const prompt = (long ? pick(r, SYSTEMS) + '\n' : '') + pick(r, QUESTIONS) + (r() < 0.3 ? ` (${Math.floor(r() * 50)})` : '');
  const chat = r() < 0.5, stream = r() < 0.5, max_tokens = 1 + Math.floor(r() * 48);
  const hangUp = r() < 0.125 ? 50 + Math.floor(r() * 3000) : null;
  const body = chat ? { messages: [{ role: 'user', content: prompt }], max_tokens, temperature: 0, stream }
    : { prompt, max_tokens, temperature: 0, stream };
  const ctrl = new AbortController();
  const timer = hangUp !== null ? setTimeout(() => ctrl.abort(), hangUp) : null;
  try {
    const res = await fetch(`${base}/v1/${chat ? 'chat/completions' : 'completions'}`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body),
      signal: ctrl.signal,
    });
    const text = await res.text();
    stats.status[res.status] = (stats.status[res.status] || 0) + 1;
    if (res.status === 429) await sleep(1000 * Number(res.headers.get('retry-after') || 1));
    else if (res.status !== 200) stats.bad.push(`${res.status} ${text.slice(0, 200)}`);
    else if (!chat && !stream) answered.push({ prompt, max_tokens, text: JSON.parse(text).choices[0].text });
  } catch (e) {
    if (e.name === 'AbortError') stats.hungUp++;
    else stats.bad.push(`${e.name}: ${e.message}`);
  } finally {
    if (timer) clearTimeout(timer);
  }
}

if (mode === 'load') {
  const [seconds, clients, state] = [Number(args[0]), Number(args[1]), args[2]];
  const end = performance.now() + seconds * 1000;
  const stats = { status: {}, hungUp: 0, bad: [] }, answered = [];
  await Promise.all(Array.from({ length: clients }, async (_, c) => {
    const r = rng(1000 + c);
    while (performance.now() < end) await one(r, stats, answered);
  }));
  fs.writeFileSync(state, JSON.stringify(answered));
  console.log(JSON.stringify({ status: stats.status, hung_up: stats.hungUp, bad: stats.bad.length,
    answered_completions: answered.length, first_bad: stats.bad.slice(0, 5) }));
  process.exit(stats.bad.length ? 1 : 0);
} else if (mode === 'replay') {
  const answered = JSON.parse(fs.readFileSync(args[0], 'utf8'));
  const n = Math.min(Number(args[1]), answered.length);
  const r = rng(9);
  let same = 0, disk = 0;
  const diff = [];
  for (let i = 0; i < n; i++) {
    const a = answered[Math.floor(r() * answered.length)];
    const res = await fetch(`${base}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ prompt: a.prompt, max_tokens: a.max_tokens, temperature: 0 }),
    });
    const j = await res.json();
    const cache = res.headers.get('x-kvtier-cache');
    if (/^disk/.test(cache || '')) disk++;
    if (res.status === 200 && j.choices[0].text === a.text) same++;
    else diff.push({ status: res.status, cache, prompt: a.prompt.slice(-60) });
  }
  console.log(JSON.stringify({ replayed: n, same, from_disk: disk, differ: diff.slice(0, 5) }));
  process.exit(same === n ? 0 : 1);
} else {
  console.error('usage: node soak.mjs BASE_URL load SECONDS CLIENTS STATE.json | replay STATE.json N');
  process.exit(2);
}
