// Log-probabilities and model ids through the official openai client:
//   node logprobs.mjs BASE_URL [SERVED_MODEL_ID]
//
// Chat completions, legacy completions and Responses, each streaming and
// not: OpenAI's shapes, the streamed pieces adding up to the non-streamed
// lists (with the client's own stream helpers, which merge them), the
// tokens' bytes adding up to the text, the alternatives sorted and led by
// the greedy choice, logprobs taken before temperature and top_p, the 400s
// for values outside OpenAI's ranges, and any model id accepted and echoed.
// The values themselves are checked against the model's logits by
// tests/test_e2e.c (e2e_logprobs), in C through the library.
import OpenAI from 'openai';
import { check, postJSON, run, section } from './lib.mjs';

const [base, givenId] = process.argv.slice(2);
if (!base) {
  console.error('usage: node logprobs.mjs BASE_URL [SERVED_MODEL_ID]');
  process.exit(2);
}
const openai = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'x', maxRetries: 0 });
const msgs = [{ role: 'user', content: 'Write one line about rivers.' }];
const PROMPT = 'The river runs';
const bytesOf = (entries) => Buffer.concat(entries.map((e) => Buffer.from(e.bytes)));
const isByte = (b) => Number.isInteger(b) && b >= 0 && b <= 255;

// What is wrong with a {token, logprob, bytes} entry (null: nothing): a
// string, a number <= 0, byte values; the token is the bytes as text, or
// OpenAI's "bytes:\xNN" spelling when they are not UTF-8 on their own.
function entryBad(e) {
  if (typeof e.token !== 'string' || typeof e.logprob !== 'number' || !(e.logprob <= 0) ||
    !Array.isArray(e.bytes) || !e.bytes.every(isByte)) return 'not {token, logprob <= 0, bytes}';
  const b = Buffer.from(e.bytes);
  const spelled = 'bytes:' + [...b].map((x) => `\\x${x.toString(16).padStart(2, '0')}`).join('');
  if (e.token !== b.toString('utf8') && e.token !== spelled) return 'token is not its bytes';
  return null;
}

// The chat / Responses list: per token n alternatives, most likely first,
// the first the sampled token itself when sampling is greedy. One check per
// property over the whole list, naming the first entry that breaks it.
function listOk(list, n, greedy, what) {
  check(Array.isArray(list) && list.length > 0, `${what}: a non-empty list`, list);
  const first = (f) => { const i = list.findIndex(f); return i < 0 ? null : { i, entry: list[i] }; };
  const bad = first((e) => entryBad(e) || !Array.isArray(e.top_logprobs) || e.top_logprobs.some(entryBad));
  check(!bad, `${what}: every entry and alternative is {token, logprob, bytes}`, bad);
  check(!first((e) => e.top_logprobs.length !== n), `${what}: ${n} top_logprobs each`, list.map((e) => e.top_logprobs.length));
  check(!first((e) => e.top_logprobs.some((a, k) => k && a.logprob > e.top_logprobs[k - 1].logprob)),
    `${what}: top_logprobs sorted, most likely first`);
  if (n) {
    check(!first((e) => e.logprob > e.top_logprobs[0].logprob), `${what}: no token above the first alternative`);
    if (greedy) {
      check(!first((e) => e.logprob !== e.top_logprobs[0].logprob ||
        !Buffer.from(e.bytes).equals(Buffer.from(e.top_logprobs[0].bytes))),
      `${what}: greedy sampling picked the first alternative each time`);
    }
  }
}

// The text is the tokens' bytes (the reply is not cut by a stop sequence).
function joinsOk(entries, text, what) {
  const b = bytesOf(entries);
  check(b.toString('utf8') === text, `${what}: the tokens' bytes are the text`, { text, joined: b.toString('utf8') });
}

async function badRequest(p, what) {
  try {
    await p;
    check(false, `${what} is refused`);
  } catch (e) {
    check(e instanceof OpenAI.BadRequestError && e.status === 400 && e.error?.type === 'invalid_request_error',
      `${what}: BadRequestError 400 invalid_request_error`, String(e));
  }
}

await run(async () => {
  const listed = (await openai.models.list()).data.map((m) => m.id);
  const servedId = givenId || listed[0];
  check(listed.length === 1 && listed[0] === servedId, `models.list() is the served id ${servedId}`, listed);

  section('chat.completions: logprobs true, top_logprobs 3');
  const req = { model: servedId, messages: msgs, max_tokens: 12, temperature: 0, logprobs: true, top_logprobs: 3 };
  const c = await openai.chat.completions.create(req);
  const content = c.choices[0].logprobs?.content;
  listOk(content, 3, true, 'logprobs.content');
  check(c.choices[0].logprobs.refusal === null, 'logprobs.refusal is null', c.choices[0].logprobs);
  check(content.length === c.usage.completion_tokens, 'one entry per completion token',
    { entries: content.length, usage: c.usage });
  joinsOk(content, c.choices[0].message.content, 'chat');

  const s = await openai.chat.completions.create({ ...req, stream: true });
  const streamed = [];
  let nullChunks = 0;
  let bare = null;
  for await (const ch of s) {
    const ch0 = ch.choices[0];
    if (!ch0) continue;
    if (ch0.logprobs) streamed.push(...ch0.logprobs.content);
    else nullChunks++;
    if (ch0.delta?.content && !(ch0.logprobs?.content?.length >= 1) && !bare) bare = ch0;
  }
  check(!bare, 'every chunk with content carries its logprobs', bare);
  check(nullChunks === 2, 'the role and the finish chunks carry logprobs: null', nullChunks);
  check(JSON.stringify(streamed) === JSON.stringify(content), 'streamed logprobs.content equals the non-streamed',
    { streamed: streamed.length, plain: content.length });
  const helper = await openai.chat.completions.stream(req).finalChatCompletion();
  check(JSON.stringify(helper.choices[0].logprobs.content) === JSON.stringify(content),
    'chat.completions.stream() merges them into the same list');

  section('chat.completions: sampled with temperature 1.5, top_p 0.5');
  const hot = await openai.chat.completions.create({ ...req, temperature: 1.5, top_p: 0.5, seed: 3, top_logprobs: 5 });
  listOk(hot.choices[0].logprobs.content, 5, false, 'sampled logprobs.content');
  // The model's distribution, not the sampler's: the greedy run's first
  // position has the same alternatives with the same values.
  check(JSON.stringify(hot.choices[0].logprobs.content[0].top_logprobs.slice(0, 3)) ===
    JSON.stringify(content[0].top_logprobs), 'first position: same alternatives as the greedy run (raw logits)',
  { hot: hot.choices[0].logprobs.content[0].top_logprobs, greedy: content[0].top_logprobs });
  const none = await openai.chat.completions.create({ model: servedId, messages: msgs, max_tokens: 2 });
  check(none.choices[0].logprobs === null, 'without logprobs: null', none.choices[0]);
  const zero = await openai.chat.completions.create({ ...req, top_logprobs: 0, max_tokens: 3 });
  listOk(zero.choices[0].logprobs.content, 0, true, 'top_logprobs 0');

  section('completions (legacy): logprobs 2');
  const creq = { model: servedId, prompt: PROMPT, max_tokens: 10, temperature: 0, logprobs: 2 };
  const p = await openai.completions.create(creq);
  const lp = p.choices[0].logprobs;
  const n = lp.tokens.length;
  check(n === p.usage.completion_tokens && lp.token_logprobs.length === n && lp.top_logprobs.length === n &&
    lp.text_offset.length === n, 'tokens, token_logprobs, top_logprobs, text_offset: one per token', lp);
  check(lp.text_offset[0] === Buffer.byteLength(PROMPT), 'text_offset starts at the end of the prompt',
    lp.text_offset);
  check(lp.top_logprobs.every((o) => Object.keys(o).length <= 2 && Object.keys(o).length >= 1),
    'top_logprobs: an object of at most 2 alternatives per token', lp.top_logprobs);
  check(lp.tokens.every((t, i) => lp.token_logprobs[i] === Math.max(...Object.values(lp.top_logprobs[i]))),
    'greedy sampling picked the most likely alternative each time', lp);
  check(lp.text_offset.every((o, i) => !i || o > lp.text_offset[i - 1]), 'text_offset increases', lp.text_offset);
  if (!p.choices[0].text.includes('\ufffd')) {
    check(lp.tokens.join('') === p.choices[0].text, 'the tokens are the text', { tokens: lp.tokens, text: p.choices[0].text });
  }
  const ps = await openai.completions.create({ ...creq, stream: true });
  const acc = { tokens: [], token_logprobs: [], top_logprobs: [], text_offset: [] };
  let without = null;
  for await (const ch of ps) {
    const l = ch.choices[0]?.logprobs;
    if (!(l && Array.isArray(l.tokens))) { without = without || ch; continue; }
    for (const k of Object.keys(acc)) acc[k].push(...l[k]);
  }
  check(!without, 'every completions chunk carries logprobs lists', without);
  check(JSON.stringify(acc) === JSON.stringify(lp), 'the streamed lists add up to the non-streamed ones',
    { acc, lp });

  section('responses: include message.output_text.logprobs, top_logprobs 2');
  const rreq = {
    model: servedId, input: 'Write one line about rivers.', max_output_tokens: 12, temperature: 0,
    include: ['message.output_text.logprobs'], top_logprobs: 2,
  };
  const r = await openai.responses.create(rreq);
  const part = r.output[0].content[0];
  listOk(part.logprobs, 2, true, 'output_text.logprobs');
  joinsOk(part.logprobs, part.text, 'responses');
  check(r.output_text === part.text, 'output_text is the part text');
  const rs = await openai.responses.create({ ...rreq, stream: true });
  const deltas = [];
  let done = null, completed = null;
  for await (const ev of rs) {
    if (ev.type === 'response.output_text.delta') deltas.push(...ev.logprobs);
    if (ev.type === 'response.output_text.done') done = ev.logprobs;
    if (ev.type === 'response.completed') completed = ev.response;
  }
  check(JSON.stringify(deltas) === JSON.stringify(part.logprobs), 'the delta events add up to the part\'s logprobs');
  check(JSON.stringify(done) === JSON.stringify(part.logprobs), 'response.output_text.done carries them all');
  check(JSON.stringify(completed.output[0].content[0].logprobs) === JSON.stringify(part.logprobs),
    'response.completed carries them all');
  const fin = await openai.responses.stream(rreq).finalResponse();
  check(JSON.stringify(fin.output[0].content[0].logprobs) === JSON.stringify(part.logprobs),
    'responses.stream() finalResponse() has the same logprobs');
  const plain = await openai.responses.create({ model: servedId, input: 'x', max_output_tokens: 2 });
  check(plain.output[0].content[0].logprobs === undefined, 'without the include: no logprobs on the part');

  section('values outside OpenAI\'s ranges are 400');
  await badRequest(openai.chat.completions.create({ ...req, top_logprobs: 21 }), 'chat top_logprobs 21');
  await badRequest(openai.chat.completions.create({ model: servedId, messages: msgs, top_logprobs: 2 }),
    'chat top_logprobs without logprobs');
  await badRequest(openai.completions.create({ ...creq, logprobs: 6 }), 'completions logprobs 6');
  await badRequest(openai.responses.create({ ...rreq, top_logprobs: 21 }), 'responses top_logprobs 21');

  section('any model id is served and echoed');
  const e1 = await openai.chat.completions.create({ ...req, model: 'gpt-4o-mini', max_tokens: 2 });
  check(e1.model === 'gpt-4o-mini', 'chat echoes the id sent', e1.model);
  const e2 = await openai.chat.completions.create({ ...req, model: 'gpt-4o-mini', max_tokens: 2, stream: true });
  let models = new Set();
  for await (const ch of e2) models.add(ch.model);
  check(models.size === 1 && models.has('gpt-4o-mini'), 'every chunk echoes it', [...models]);
  const e3 = await openai.responses.create({ ...rreq, model: 'o9-pro', max_output_tokens: 2 });
  check(e3.model === 'o9-pro', 'responses echoes it', e3.model);
  const e4 = await postJSON(`${base}/v1/completions`, { prompt: 'x', max_tokens: 1 });
  check(e4.status === 200 && e4.body.model === servedId, 'no model: the served id', e4.body.model);
});
