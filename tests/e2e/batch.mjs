// Several requests at once (the scheduler of src/app/server.c: continuous
// batching), over raw fetch():
//
//   alone STATE    each target request of the seeded list (legacy
//                  completions, sampled with a seed, logprobs of every
//                  token) run alone, one after another; their replies are
//                  written to STATE
//   batched STATE  on a fresh server (nothing cached): each target again,
//                  inside a batch of 1 to 7 random others that start
//                  before it and after it, prefill long prompts or
//                  decode, stream or not; its text, tokens and every
//                  logprob must be STATE's exactly. /metrics must show
//                  passes that advanced several requests at once.
//   cancel         clients that hang up in their prefill and in their
//                  reply: their slots are free at the next step (no active
//                  request, the cancel counted), and the server serves on
//   fair KEY_A KEY_B  --parallel 1, two keys: a burst of A's long
//                  requests, then one of B's once the server holds the
//                  burst (/metrics); B's starts as soon as the running one
//                  ends, not behind A's whole burst
//
// Usage: node batch.mjs BASE_URL MODE [ARGS]
import fs from 'node:fs';
import { check, metrics, postJSON, rng, run, section, sleep, streamChat, waitMetrics } from './lib.mjs';

const [base, mode, ...args] = process.argv.slice(2);
if (!base || !mode) {
  console.error('usage: node batch.mjs BASE_URL alone|batched STATE | cancel | fair KEY_A KEY_B');
  process.exit(2);
}
const COMPL = `${base}/v1/completions`;
const WORDS = ['the', 'cat', 'sat', 'on', 'a', 'mat', 'and', 'then', 'she', 'ran', 'to', 'see', 'big', 'red',
  'ball', 'in', 'park', 'with', 'her', 'friend', 'tom', 'who', 'was', 'very', 'happy', 'day', 'sun'];
function words(r, n) {
  const out = [];
  for (let i = 0; i < n; i++) out.push(WORDS[Math.floor(r() * WORDS.length)]);
  return out.join(' ');
}

// The targets: a few prompts of different lengths (the long one's prefill
// spans several steps), sampled at temperature 0.9 with their own seed.
const R = rng(91);
const TARGETS = [8, 60, 300, 25].map((n, i) => ({
  prompt: `Once upon a time ${words(R, n)}`, max_tokens: 20 + 4 * i, temperature: 0.9, seed: 1000 + i,
  logprobs: 2,
}));

function reply(r) {
  const c = r.body && r.body.choices && r.body.choices[0];
  return c ? { text: c.text, tokens: c.logprobs.tokens, lp: c.logprobs.token_logprobs,
    top: c.logprobs.top_logprobs, finish: c.finish_reason } : null;
}

async function alone(state) {
  section('each target alone');
  const out = [];
  for (const [i, t] of TARGETS.entries()) {
    const r = await postJSON(COMPL, t);
    check(r.status === 200 && reply(r), `target ${i}: 200`, r.body);
    out.push(reply(r));
  }
  fs.writeFileSync(state, JSON.stringify(out));
}

// A random other request: a prompt of 5 to 400 words, 1 to 40 tokens,
// streaming or not.
async function other(r) {
  const prompt = words(r, 5 + Math.floor(r() * 400)), max_tokens = 1 + Math.floor(r() * 40);
  const body = { prompt, max_tokens, temperature: 0.7, seed: Math.floor(r() * 1e6), stream: r() < 0.5 };
  const res = await fetch(COMPL, { method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body) });
  const text = await res.text();
  return res.status === 200 && (!body.stream || text.includes('data: [DONE]')) ? 200 : `${res.status} ${text}`;
}

async function batched(state) {
  const want = JSON.parse(fs.readFileSync(state, 'utf8'));
  const r = rng(17);
  for (const [i, t] of TARGETS.entries()) {
    const k = 1 + Math.floor(r() * 7); // others
    const before = Math.floor(r() * (k + 1));
    section(`target ${i} (${t.prompt.split(' ').length} words) with ${k} others, ${before} started before it`);
    const jobs = [];
    for (let j = 0; j < before; j++) jobs.push(other(r));
    await sleep(Math.floor(r() * 150));
    const mine = postJSON(COMPL, t);
    await sleep(Math.floor(r() * 100));
    for (let j = before; j < k; j++) jobs.push(other(r));
    const [res, ...st] = await Promise.all([mine, ...jobs]);
    check(st.every((s) => s === 200), 'every other request: 200', st);
    const got = reply(res);
    check(res.status === 200 && got, 'the target: 200', res.body);
    check(got.text === want[i].text && JSON.stringify(got.tokens) === JSON.stringify(want[i].tokens),
      `the same ${got.tokens.length} tokens as alone`, { got: got.tokens, want: want[i].tokens });
    check(JSON.stringify(got.lp) === JSON.stringify(want[i].lp) &&
      JSON.stringify(got.top) === JSON.stringify(want[i].top), 'every logprob and alternative as alone, exactly',
    { got: got.lp, want: want[i].lp });
  }
  const m = await metrics(base);
  check(m['kvtier_step_requests_max'] >= 3, `passes advanced up to ${m['kvtier_step_requests_max']} requests at once`,
    m['kvtier_step_requests_max']);
  check(m['kvtier_step_requests_total'] > m['kvtier_steps_total'],
    `${m['kvtier_step_requests_total']} request steps in ${m['kvtier_steps_total']} passes`);
  check(m['kvtier_active_requests'] === 0, 'no active request left', m['kvtier_active_requests']);
}

async function cancel() {
  const r = rng(5);
  section('clients that hang up mid-prefill and mid-reply');
  const before = await metrics(base);
  const ctrls = [new AbortController(), new AbortController(), new AbortController()];
  // a long prefill (cut at its first progress comment or after 0.4 s), a long reply
  // (cut after its first token), and one that stays
  const long = { messages: [{ role: 'user', content: words(r, 3000) }], max_tokens: 8 };
  const chatty = { messages: [{ role: 'user', content: 'tell me' }], max_tokens: 4000, temperature: 1, seed: 3 };
  const a = streamChat(base, long, { signal: ctrls[0].signal }).catch((e) => e.name);
  const b = (async () => {
    const res = await fetch(`${base}/v1/chat/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ ...chatty, stream: true }), signal: ctrls[1].signal,
    });
    const rd = res.body.getReader();
    for (;;) {
      const { value } = await rd.read();
      if (value && new TextDecoder().decode(value).includes('"content"')) break;
    }
    ctrls[1].abort();
    return 'AbortError';
  })().catch((e) => e.name);
  const keep = postJSON(COMPL, { prompt: 'Once upon a time', max_tokens: 16, temperature: 0 });
  await sleep(400);
  ctrls[0].abort();
  const [ra, rb, rk] = await Promise.all([a, b, keep]);
  check(ra === 'AbortError' && rb === 'AbortError', 'two clients went away', [ra, rb]);
  check(rk.status === 200, 'the request beside them: 200', rk.status);
  let m;
  for (let i = 0; i < 100; i++) {
    m = await metrics(base);
    if (m['kvtier_active_requests'] === 0) break;
    await sleep(100);
  }
  check(m['kvtier_active_requests'] === 0, 'their slots are free', m['kvtier_active_requests']);
  check(m['kvtier_canceled_total'] > (before['kvtier_canceled_total'] || 0), 'the prefill counted as canceled',
    m['kvtier_canceled_total']);
  const again = await postJSON(COMPL, { prompt: 'Once upon a time', max_tokens: 16, temperature: 0 });
  check(again.status === 200 && again.body.choices[0].text === rk.body.choices[0].text,
    'the server serves on, the same text', again.body);
}

async function fair(keyA, keyB) {
  section('a burst of key A, then one request of key B (--parallel 1)');
  // Event-driven, not by sleeps: B is sent once the server holds all of
  // A's burst (one running, the rest queued), and judged by the server's
  // counts, not by how long anything took. B starts as soon as the running
  // request ends, so when B's reply arrives at most one more of A's has
  // finished than had when B reached the queue; behind A's whole burst,
  // all four would have.
  const r = rng(8);
  const hA = { authorization: `Bearer ${keyA}` }, hB = { authorization: `Bearer ${keyB}` };
  const OK = 'kvtier_requests_total{endpoint="completions",status="2xx"}';
  let doneA = 0;
  const A = [];
  for (let i = 0; i < 4; i++) {
    A.push(postJSON(COMPL, { prompt: words(r, 300), max_tokens: 24, temperature: 0 }, hA)
      .then((x) => { doneA++; return x.status; }));
  }
  const held = await waitMetrics(base, hA,
    (m) => m['kvtier_active_requests'] + m['kvtier_queue_depth'] + (m[OK] || 0) === 4, "all of A's burst");
  console.log(`    A: ${held['kvtier_active_requests']} running, ${held['kvtier_queue_depth']} queued, ${held[OK] || 0} done`);
  let doneAtB = -1;
  const B = postJSON(COMPL, { prompt: words(r, 20), max_tokens: 4, temperature: 0 }, hB)
    .then((x) => { doneAtB = doneA; return x.status; });
  await waitMetrics(base, hB, (m) => m['kvtier_active_requests'] + m['kvtier_queue_depth'] + (m[OK] || 0) >= 1,
    'B queued or run');
  // read after B arrived: at least as many of A's as had finished then
  const aAtArrival = (await metrics(base, hA))[OK] || 0;
  const st = await Promise.all([...A, B]);
  check(st.every((s) => s === 200), 'every request: 200', st);
  console.log(`    A's finished: ${aAtArrival} or fewer when B reached the server, ${doneAtB} when B's reply came`);
  check(aAtArrival <= 2, "B reached the server while A's burst still waited", aAtArrival);
  check(doneAtB <= aAtArrival + 1, "B ran as soon as the running request ended, not behind A's burst",
    { aAtArrival, doneAtB });
}

run(async () => {
  if (mode === 'alone') await alone(args[0]);
  else if (mode === 'batched') await batched(args[0]);
  else if (mode === 'cancel') await cancel();
  else if (mode === 'fair') await fair(args[0], args[1]);
  else throw new Error(`unknown mode ${mode}`);
});
