// Error paths of kvtier serve: node errors.mjs BASE_URL MODE
//
// Each mode expects the server started with matching flags (tests/test_e2e.c
// does that):
//   basic   --strict-model: malformed JSON, wrong types, unknown model (a
//           404 only with that flag) and route, unsupported content; bodies
//           in the shape of the API asked
//   ctx     --ctx 256: a prompt longer than the context is a 400
//   body    --max-body-mb 1: a 2 MB body is a 413
//   auth    --api-key K: 401 without the key, 200 with either header
//   queue   --queue 1: concurrent long requests, at least one 429 with
//           Retry-After (judged once /metrics counts every request
//           admitted or refused: no fixed wait)
// Every mode ends by checking that the server still answers /health and a
// small request.
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';
import { check, getJSON, metrics, postJSON, run, section, sleep, waitMetrics } from './lib.mjs';

const [base, mode] = process.argv.slice(2);
if (!base || !mode) {
  console.error('usage: node errors.mjs BASE_URL basic|ctx|body|auth|queue');
  process.exit(2);
}
const CHAT = `${base}/v1/chat/completions`, MSGS = `${base}/v1/messages`, COMPL = `${base}/v1/completions`;
const user = (content) => [{ role: 'user', content }];

// {"error":{"message":...,"type":...}}
function openaiShape(r, status, what) {
  check(r.status === status, `${what}: status ${status}`, { status: r.status, body: r.body });
  check(typeof r.body === 'object' && r.body.error && typeof r.body.error.message === 'string' &&
    typeof r.body.error.type === 'string', `${what}: OpenAI error body {"error":{"message","type"}}`, r.body);
  check(/json/.test(r.headers.get('content-type') || ''), `${what}: JSON content type`, r.headers.get('content-type'));
}

// {"type":"error","error":{"type":...,"message":...}}
function anthropicShape(r, status, what) {
  check(r.status === status, `${what}: status ${status}`, { status: r.status, body: r.body });
  check(typeof r.body === 'object' && r.body.type === 'error' && r.body.error &&
    typeof r.body.error.type === 'string' && typeof r.body.error.message === 'string',
  `${what}: Anthropic error body {"type":"error","error":{"type","message"}}`, r.body);
}

async function stillServing(headers = {}) {
  section('the server still serves');
  const h = await getJSON(`${base}/health`);
  check(h.status === 200 && h.body.status === 'ok', 'GET /health is 200 {"status":"ok"}', h);
  const r = await postJSON(CHAT, { messages: user('still there?'), max_tokens: 2, temperature: 0 }, headers);
  check(r.status === 200 && r.body.usage.completion_tokens <= 2, 'a small chat completion is 200', r);
}

async function basic() {
  section('malformed JSON');
  openaiShape(await postJSON(CHAT, '{"messages": [', {}), 400, 'chat, truncated JSON');
  anthropicShape(await postJSON(MSGS, '{"messages": [', {}), 400, 'messages, truncated JSON');
  openaiShape(await postJSON(COMPL, 'not json at all', {}), 400, 'completions, not JSON');
  openaiShape(await postJSON(CHAT, '', {}), 400, 'chat, empty body');
  openaiShape(await postJSON(CHAT, '[1, 2]', {}), 400, 'chat, a JSON array as the body');

  section('wrong types and missing fields');
  openaiShape(await postJSON(CHAT, { messages: 'hello' }), 400, 'chat, messages is a string');
  anthropicShape(await postJSON(MSGS, { messages: { role: 'user' }, max_tokens: 5 }), 400, 'messages, messages is an object');
  openaiShape(await postJSON(CHAT, { messages: user('x'), max_tokens: 'abc' }), 400, 'chat, max_tokens "abc"');
  anthropicShape(await postJSON(MSGS, { messages: user('x'), max_tokens: 'abc' }), 400, 'messages, max_tokens "abc"');
  anthropicShape(await postJSON(MSGS, { messages: user('x') }), 400, 'messages, max_tokens missing');
  openaiShape(await postJSON(CHAT, { messages: user('x'), temperature: 'hot' }), 400, 'chat, temperature "hot"');
  openaiShape(await postJSON(CHAT, { messages: user('x'), max_tokens: 0 }), 400, 'chat, max_tokens 0');
  openaiShape(await postJSON(CHAT, { messages: user('x'), temperature: 7 }), 400, 'chat, temperature 7');
  openaiShape(await postJSON(CHAT, {}), 400, 'chat, no messages');
  openaiShape(await postJSON(CHAT, { messages: [] }), 400, 'chat, empty messages');
  openaiShape(await postJSON(CHAT, { messages: [{ role: 'wizard', content: 'x' }] }), 400, 'chat, unknown role');
  openaiShape(await postJSON(COMPL, { prompt: 42 }), 400, 'completions, prompt is a number');
  openaiShape(await postJSON(CHAT, { messages: user('x'), stream: 'yes' }), 400, 'chat, stream "yes"');
  openaiShape(await postJSON(CHAT, { messages: user('x'), n: 2 }), 400, 'chat, n 2');
  openaiShape(await postJSON(CHAT, {
    messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'data:,' } }] }],
  }), 400, 'chat, image content');
  const r = await postJSON(CHAT, { messages: user('x'), max_tokens: 'abc' });
  check(/max_tokens/.test(r.body.error.message), 'the message names the field', r.body.error.message);

  section('unknown model and route');
  openaiShape(await postJSON(CHAT, { model: 'no-such-model', messages: user('x') }), 404, 'chat, unknown model');
  anthropicShape(await postJSON(MSGS, { model: 'no-such-model', messages: user('x'), max_tokens: 4 }), 404,
    'messages, unknown model');
  openaiShape(await postJSON(`${base}/v1/embeddings`, { input: 'x' }), 404, 'POST /v1/embeddings (no route)');
  const g = await getJSON(CHAT);
  check(g.status === 405 || g.status === 404, 'GET on a POST endpoint is refused (405)', g.status);

  section('the official clients raise typed errors');
  const openai = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'x', maxRetries: 0 });
  const anthropic = new Anthropic({ baseURL: base, apiKey: 'x', maxRetries: 0 });
  try {
    await openai.chat.completions.create({ model: 'no-such-model', messages: user('x') });
    check(false, 'openai: unknown model throws');
  } catch (e) {
    check(e instanceof OpenAI.NotFoundError && e.status === 404, 'openai: unknown model is NotFoundError 404',
      String(e));
    check(/no-such-model/.test(e.message), 'openai: the message names the model', e.message);
  }
  try {
    await openai.chat.completions.create({ messages: user('x'), max_tokens: -1 });
    check(false, 'openai: max_tokens -1 throws');
  } catch (e) {
    check(e instanceof OpenAI.BadRequestError && e.status === 400, 'openai: max_tokens -1 is BadRequestError 400',
      String(e));
  }
  try {
    await anthropic.messages.create({ model: 'no-such-model', max_tokens: 4, messages: user('x') });
    check(false, 'anthropic: unknown model throws');
  } catch (e) {
    check(e instanceof Anthropic.NotFoundError && e.status === 404, 'anthropic: unknown model is NotFoundError 404',
      String(e));
    check(e.error?.type === 'error' && e.error?.error?.type === 'not_found_error',
      'anthropic: error.type not_found_error', e.error);
  }
  await stillServing();
}

async function ctx() {
  section('a prompt longer than the context (--ctx 256)');
  const long = 'x'.repeat(1000);
  const r = await postJSON(CHAT, { messages: user(long), max_tokens: 4 });
  openaiShape(r, 400, 'chat, 1000-token prompt');
  check(/context/.test(r.body.error.message), 'the message mentions the context', r.body.error.message);
  anthropicShape(await postJSON(MSGS, { messages: user(long), max_tokens: 4 }), 400, 'messages, 1000-token prompt');
  openaiShape(await postJSON(COMPL, { prompt: long, max_tokens: 4 }), 400, 'completions, 1000-token prompt');
  const s = await fetch(CHAT, {
    method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ messages: user(long), max_tokens: 4, stream: true }),
  });
  check(s.status === 400, 'streaming, 1000-token prompt: 400 before any event', s.status);
  await s.text();
  section('generation stops at the end of the context');
  const f = await postJSON(COMPL, { prompt: 'y'.repeat(200), max_tokens: 500, temperature: 0 });
  check(f.status === 200, '200-token prompt with max_tokens 500 is served', f);
  check(f.body.usage.prompt_tokens + f.body.usage.completion_tokens <= 256,
    'prompt + completion fit the 256-token context', f.body.usage);
  check(f.body.choices[0].finish_reason === 'length', 'finish_reason is length', f.body.choices[0].finish_reason);
  await stillServing();
}

async function body() {
  section('an oversized body (--max-body-mb 1)');
  const big = JSON.stringify({ messages: user('z'.repeat(2 << 20)), max_tokens: 1 });
  const r = await postJSON(CHAT, big);
  openaiShape(r, 413, 'chat, 2 MB body');
  check(r.body.error.type === 'request_too_large', 'error type request_too_large', r.body.error);
  anthropicShape(await postJSON(MSGS, big), 413, 'messages, 2 MB body');
  const ok = await postJSON(CHAT, JSON.stringify({ messages: user('z'.repeat(500 << 10)), max_tokens: 1 }));
  check(ok.status !== 413, 'a 0.5 MB body is under the limit (not 413)', ok.status);
  await stillServing();
}

async function auth() {
  const KEY = 'K';
  section('--api-key');
  openaiShape(await postJSON(CHAT, { messages: user('x'), max_tokens: 1 }), 401, 'chat, no key');
  anthropicShape(await postJSON(MSGS, { messages: user('x'), max_tokens: 1 }), 401, 'messages, no key');
  openaiShape(await postJSON(CHAT, { messages: user('x'), max_tokens: 1 }, { authorization: 'Bearer wrong' }), 401,
    'chat, wrong Bearer key');
  anthropicShape(await postJSON(MSGS, { messages: user('x'), max_tokens: 1 }, { 'x-api-key': 'wrong' }), 401,
    'messages, wrong x-api-key');
  const b = await postJSON(CHAT, { messages: user('x'), max_tokens: 1 }, { authorization: `Bearer ${KEY}` });
  check(b.status === 200, 'Authorization: Bearer K is 200', b);
  const x = await postJSON(MSGS, { messages: user('x'), max_tokens: 1 }, { 'x-api-key': KEY });
  check(x.status === 200, 'x-api-key: K is 200', x);
  const m = await getJSON(`${base}/v1/models`);
  check(m.status === 401, 'GET /v1/models without the key is 401', m.status);
  const h = await getJSON(`${base}/health`);
  check(h.status === 200, 'GET /health without the key is 200', h.status);
  // the two liveness probes need no key (they tell nothing but that the
  // server is up); anything else at / does
  const hr = await fetch(`${base}/`, { method: 'HEAD' });
  check(hr.status === 200, 'HEAD / without the key is 200', hr.status);
  const gr = await fetch(`${base}/`);
  check(gr.status === 401, 'GET / without the key is 401', gr.status);

  section('the official clients with and without the key');
  const good = new OpenAI({ baseURL: `${base}/v1`, apiKey: KEY, maxRetries: 0 });
  const r = await good.chat.completions.create({ messages: user('x'), max_tokens: 1 });
  check(r.usage.completion_tokens === 1, 'openai client with apiKey K is served');
  const a = await new Anthropic({ baseURL: base, apiKey: KEY, maxRetries: 0 }).messages.create({
    model: (await good.models.list()).data[0].id, max_tokens: 1, messages: user('x'),
  });
  check(a.usage.output_tokens === 1, 'anthropic client with apiKey K is served');
  try {
    await new OpenAI({ baseURL: `${base}/v1`, apiKey: 'wrong', maxRetries: 0 }).models.list();
    check(false, 'openai client with a wrong key throws');
  } catch (e) {
    check(e instanceof OpenAI.AuthenticationError && e.status === 401, 'openai: AuthenticationError 401', String(e));
  }
  try {
    await new Anthropic({ baseURL: base, apiKey: 'wrong', maxRetries: 0 }).messages.create({
      model: 'm', max_tokens: 1, messages: user('x'),
    });
    check(false, 'anthropic client with a wrong key throws');
  } catch (e) {
    check(e instanceof Anthropic.AuthenticationError && e.status === 401, 'anthropic: AuthenticationError 401',
      String(e));
  }
  await stillServing({ authorization: `Bearer ${KEY}` });
}

async function queue() {
  section('a full queue (--queue 1): concurrent long streaming requests');
  // One request runs, one may wait in the queue (unless it arrived before
  // the worker took the first), the rest are refused. A streaming request is
  // answered at once: 200 headers when admitted (then keepalive comments
  // while queued), 429 when the queue is full. The test
  // waits for the server's count of both to reach N (/metrics; counted at
  // admission or refusal), then for the N replies: no fixed wait.
  const N = 5;
  const ctrls = Array.from({ length: N }, () => new AbortController());
  const started = performance.now();
  const pending = ctrls.map((c, i) => fetch(CHAT, {
    method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ messages: user(`long story ${i}`), max_tokens: 2000, temperature: 0.8, seed: i, stream: true }),
    signal: c.signal,
  }).then((r) => r, (e) => e));
  const R429 = 'kvtier_requests_total{endpoint="chat_completions",status="429"}';
  const R200 = 'kvtier_requests_total{endpoint="chat_completions",status="2xx"}';
  const m0 = await waitMetrics(base, {}, (m) => (m[R429] || 0) + (m[R200] || 0) === N,
    'every request admitted or refused');
  console.log(`    server: ${m0[R200] || 0} admitted (${m0['kvtier_active_requests']} running, ` +
    `${m0['kvtier_queue_depth']} queued), ${m0[R429] || 0} refused`);
  const res = await Promise.all(pending);
  const codes = res.map((r) => (r instanceof Response ? r.status : String(r)));
  console.log(`    statuses ${JSON.stringify(codes)} after ${((performance.now() - started) / 1000).toFixed(2)} s`);
  check(codes.filter((c) => c === 429).length === (m0[R429] || 0), 'the client got the 429s the server counted',
    codes);
  const full = res.filter((r) => r instanceof Response && r.status === 429);
  check(full.length >= 1, 'at least one request is refused with 429', codes);
  check(codes.every((c) => c === 200 || c === 429), 'the others are accepted (200: running or queued)', codes);
  check(codes.filter((c) => c === 200).length >= 1, 'the running one is accepted (200)', codes);
  for (const r of full) {
    check(/^\d+$/.test(r.headers.get('retry-after') || ''), `429 has a Retry-After header (${r.headers.get('retry-after')})`);
    const b = await r.json();
    check(b.error && b.error.type === 'rate_limit_error', '429 body is an OpenAI rate_limit_error', b);
  }
  // The clients go away: the server cancels their jobs at their next step.
  ctrls.forEach((c) => c.abort());
  for (const r of res) if (r instanceof Response) r.body?.cancel().catch(() => {});
  await Promise.all(pending);
  const deadline = performance.now() + 60000;
  let served = null;
  while (performance.now() < deadline) {
    served = await postJSON(CHAT, { messages: user('after'), max_tokens: 2, temperature: 0 });
    if (served.status === 200) break;
    await sleep(250);
  }
  check(served && served.status === 200, 'after the clients go away a new request is served', served);
  const m = await metrics(base);
  const refused = m['kvtier_requests_total{endpoint="chat_completions",status="429"}'];
  check(refused >= full.length && !m['kvtier_requests_total{endpoint="chat_completions",status="5xx"}'],
    `/metrics counts the ${refused} refused as 429, none as 5xx`, m);
  console.log(`    served ${((performance.now() - started) / 1000).toFixed(2)} s after the burst began`);
  await stillServing();
}

const modes = { basic, ctx, body, auth, queue };
if (!modes[mode]) {
  console.error(`errors.mjs: unknown mode ${mode}`);
  process.exit(2);
}
await run(modes[mode]);
