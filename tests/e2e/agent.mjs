// An agent-style session against kvtier serve on ds4-mini:
//   node agent.mjs BASE_URL PHASE STATE.json
//
// An agent resends a long, fixed system prompt (here ~25,000 tokens of
// pseudo-code: the built-in tokenizer is byte-level, one token per byte)
// with a growing conversation. The phases run against servers that
// tests/test_e2e.c starts and stops between them; STATE.json carries what a
// later phase compares with.
//
//   turns    fresh server, empty disk dir. Turn 1 (system + user 1, streamed)
//            is cold; turn 2 resends turn 1 with its exact reply plus a new
//            question and must reuse the whole turn-1 prompt from RAM.
//   disk     restarted on the same disk dir. Turn 3 (system + a new question,
//            a fresh conversation) must reuse the whole system prompt from
//            disk (turn 1 saved where its user turn begins), then the same
//            request again from RAM.
//   cold     fresh server, fresh empty disk dir: the same request cold. Its
//            greedy text must equal what the disk and RAM tiers produced.
//   prefill  fresh server: SSE comments keep a long streaming prefill alive,
//            and a client that goes away mid-prefill cancels it.
//
// ds4-mini has synthetic weights: its greedy text echoes the last prompt
// token (here the <｜Assistant｜> marker), whatever came before. Equal texts
// across the tiers therefore show that each tier's answer comes back whole
// and well formed, not that the cache rows are right; tiers.mjs makes that
// comparison on a trained model, with negative controls, and the engine
// tests compare the cache bytes themselves.
import OpenAI from 'openai';
import { readFileSync, writeFileSync } from 'node:fs';
import { check, getJSON, metrics, postJSON, pseudoCode, run, section, sleep, streamChat } from './lib.mjs';

const [base, phase, statePath] = process.argv.slice(2);
if (!base || !phase || !statePath) {
  console.error('usage: node agent.mjs BASE_URL turns|disk|cold|prefill STATE.json');
  process.exit(2);
}
const SYS_BYTES = 25000;
const SYS = pseudoCode(SYS_BYTES, 1);
const U1 = 'Which routines write to row? Answer with their names.';
const U2 = 'Now list the ones that read from tail.';
const U3 = 'Explain what blk_hash does, step by step.';
const openai = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'x', maxRetries: 0, timeout: 600000 });
const loadState = () => JSON.parse(readFileSync(statePath, 'utf8'));
const saveState = (s) => writeFileSync(statePath, JSON.stringify(s, null, 1));
const greedy = { temperature: 0, max_tokens: 16 };

// The turn-3 request, non-streaming, with the X-KVTier-Cache header.
async function turn3(label) {
  const t0 = performance.now();
  const { data, response } = await openai.chat.completions.create({
    messages: [{ role: 'system', content: SYS }, { role: 'user', content: U3 }], ...greedy,
  }).withResponse();
  const secs = (performance.now() - t0) / 1000;
  const header = response.headers.get('x-kvtier-cache') || '';
  const cached = data.usage.prompt_tokens_details.cached_tokens;
  console.log(`    ${label}: ${secs.toFixed(2)} s, X-KVTier-Cache "${header}", prompt ${data.usage.prompt_tokens}, ` +
    `cached ${cached}, text ${JSON.stringify(data.choices[0].message.content)}`);
  check(header.split(';')[0] === label, `${label}: X-KVTier-Cache names the tier "${label}"`, header);
  const m = /reused=(\d+)/.exec(header);
  check(m && Number(m[1]) === cached, `${label}: the header's reused= equals usage cached_tokens`, { header, cached });
  return { text: data.choices[0].message.content, usage: data.usage, secs };
}

async function turns() {
  section('turn 1: system prompt + first question, streamed, cold');
  const t0 = performance.now();
  const s = await openai.chat.completions.create({
    messages: [{ role: 'system', content: SYS }, { role: 'user', content: U1 }], ...greedy,
    stream: true, stream_options: { include_usage: true },
  });
  let text1 = '', usage1 = null;
  for await (const ch of s) {
    if (ch.usage) usage1 = ch.usage;
    text1 += ch.choices[0]?.delta?.content ?? '';
  }
  const secs1 = (performance.now() - t0) / 1000;
  console.log(`    ${secs1.toFixed(2)} s, prompt ${usage1.prompt_tokens} tokens ` +
    `(${(usage1.prompt_tokens / secs1).toFixed(0)} tokens/s), text ${JSON.stringify(text1)}`);
  check(usage1.prompt_tokens > SYS_BYTES, `turn 1 prompt holds the system prompt (${usage1.prompt_tokens} tokens)`);
  check(usage1.prompt_tokens_details.cached_tokens < 64, 'turn 1 is cold (cached_tokens < 64)', usage1);
  // the synthetic model's greedy reply may end with its end-of-sentence token before max_tokens
  check(usage1.completion_tokens >= 1 && usage1.completion_tokens <= 16, 'turn 1 generated 1 to max_tokens (16) tokens', usage1);

  section('turn 2: turn 1 resent with its reply and a new question, from RAM');
  const { data, response } = await openai.chat.completions.create({
    messages: [{ role: 'system', content: SYS }, { role: 'user', content: U1 },
      { role: 'assistant', content: text1 }, { role: 'user', content: U2 }], ...greedy,
  }).withResponse();
  const header = response.headers.get('x-kvtier-cache') || '';
  const cached2 = data.usage.prompt_tokens_details.cached_tokens;
  console.log(`    X-KVTier-Cache "${header}", prompt ${data.usage.prompt_tokens}, cached ${cached2}`);
  check(header.startsWith('ram'), 'turn 2: X-KVTier-Cache names "ram"', header);
  check(cached2 >= usage1.prompt_tokens - 32,
    `turn 2 reuses the whole turn-1 prompt (${cached2} >= ${usage1.prompt_tokens} - 32)`, data.usage);
  check(cached2 < data.usage.prompt_tokens, 'turn 2 still prefills its new question');

  section('metrics');
  const mx = await metrics(base);
  check(mx['kvtier_cache_hits_total{tier="ram"}'] >= 1, 'kvtier_cache_hits_total{tier="ram"} >= 1', mx);
  check(mx['kvtier_cache_misses_total'] >= 1, 'kvtier_cache_misses_total >= 1 (turn 1)');
  check(mx['kvtier_reused_tokens_total{tier="ram"}'] >= cached2,
    `kvtier_reused_tokens_total{tier="ram"} >= ${cached2}`, mx['kvtier_reused_tokens_total{tier="ram"}']);
  check(mx['kvtier_disk_saves_total'] >= 1, 'kvtier_disk_saves_total >= 1 (turn 1 saved a snapshot)');
  check(mx['kvtier_cache_entries{tier="disk"}'] >= 1, 'kvtier_cache_entries{tier="disk"} >= 1');
  saveState({ text1, prompt1: usage1.prompt_tokens, cold_seconds: secs1 });
}

async function disk() {
  const st = loadState();
  section('turn 3 after a restart: system prompt + a new question, from disk');
  const d = await turn3('disk');
  // turn 1 saved where its user turn begins, so the whole system prompt
  // comes back, not only the part below the 128-token save grid
  check(d.usage.prompt_tokens_details.cached_tokens >= SYS_BYTES,
    `turn 3 reuses the whole system prompt from disk (${d.usage.prompt_tokens_details.cached_tokens} >= ${SYS_BYTES})`);
  section('the same request again, from RAM');
  const r = await turn3('ram');
  check(r.usage.prompt_tokens_details.cached_tokens >= d.usage.prompt_tokens - 32, 'RAM reuses the whole prompt',
    r.usage);
  check(r.text === d.text, 'greedy text from RAM equals greedy text from disk', { ram: r.text, disk: d.text });
  section('metrics');
  const mx = await metrics(base);
  check(mx['kvtier_cache_hits_total{tier="disk"}'] >= 1, 'kvtier_cache_hits_total{tier="disk"} >= 1', mx);
  check(mx['kvtier_cache_hits_total{tier="ram"}'] >= 1, 'kvtier_cache_hits_total{tier="ram"} >= 1');
  check(mx['kvtier_reused_tokens_total{tier="disk"}'] >= 0.9 * SYS_BYTES,
    'kvtier_reused_tokens_total{tier="disk"} >= 90% of the system prompt', mx['kvtier_reused_tokens_total{tier="disk"}']);
  check(mx['kvtier_load_seconds_count'] >= 1, 'kvtier_load_seconds_count >= 1');
  saveState({ ...st, disk_text: d.text, ram_text: r.text, disk_seconds: d.secs, ram_seconds: r.secs });
}

async function cold() {
  const st = loadState();
  section('the turn-3 request on a fresh server with an empty disk dir: cold');
  const c = await turn3('none');
  check(c.usage.prompt_tokens_details.cached_tokens < 64, 'cold: cached_tokens < 64', c.usage);
  check(c.text === st.disk_text, 'greedy text cold equals greedy text from disk and RAM',
    { cold: c.text, disk: st.disk_text, ram: st.ram_text });
  const mx = await metrics(base);
  check(mx['kvtier_cache_hits_total{tier="ram"}'] === 0 && mx['kvtier_cache_hits_total{tier="disk"}'] === 0 &&
    mx['kvtier_cache_misses_total'] === 1, 'metrics: no hits, one miss', mx);
  console.log(`    cold ${c.secs.toFixed(2)} s, disk ${st.disk_seconds.toFixed(2)} s, RAM ${st.ram_seconds.toFixed(2)} s`);
}

async function prefill() {
  section('a long streaming prefill sends SSE comments at least every 5 s');
  const body = {
    messages: [{ role: 'system', content: pseudoCode(20000, 2) }, { role: 'user', content: U1 }],
    max_tokens: 4, temperature: 0,
  };
  const s = await streamChat(base, body);
  check(s.status === 200, 'streaming request is 200', s);
  const maxGap = Math.max(...s.gaps);
  console.log(`    first content after ${s.firstContent?.toFixed(2)} s; ${s.comments.length} comments ` +
    `(${s.comments.slice(0, 3).map((c) => JSON.stringify(c.text)).join(', ')}, ...); longest silence ${maxGap.toFixed(2)} s`);
  check(s.comments.some((c) => /^: (keepalive|prefill)/.test(c.text)), 'comments ": keepalive" or ": prefill" arrive');
  check(maxGap <= 5, `no silence longer than 5 s before the first token (longest ${maxGap.toFixed(2)} s)`, s.gaps);
  check(s.usage && s.usage.completion_tokens === 4 && s.text.length > 0, 'the stream then delivers text and usage', s);

  section('a client that goes away mid-prefill cancels it');
  const ctrl = new AbortController();
  const before = (await metrics(base))['kvtier_canceled_total'];
  check(before === 0, 'kvtier_canceled_total starts at 0', before);
  setTimeout(() => ctrl.abort(), 1000);
  const t0 = performance.now();
  let aborted = false;
  try {
    await streamChat(base, {
      messages: [{ role: 'system', content: pseudoCode(20000, 3) }, { role: 'user', content: U1 }],
      max_tokens: 4, temperature: 0,
    }, { signal: ctrl.signal });
  } catch (e) {
    aborted = e.name === 'AbortError';
  }
  check(aborted, 'the request was aborted by the client');
  const h = await getJSON(`${base}/health`);
  check(h.status === 200, 'GET /health is 200 right after', h.status);
  let canceled = 0;
  for (let i = 0; i < 100 && canceled < 1; i++) {
    canceled = (await metrics(base))['kvtier_canceled_total'];
    if (canceled < 1) await sleep(100);
  }
  const waited = (performance.now() - t0) / 1000;
  check(canceled >= 1, `kvtier_canceled_total >= 1 (${waited.toFixed(2)} s after the request began)`, canceled);
  const t1 = performance.now();
  const r = await postJSON(`${base}/v1/chat/completions`, {
    messages: [{ role: 'user', content: 'short' }], max_tokens: 2, temperature: 0,
  });
  const secs = (performance.now() - t1) / 1000;
  check(r.status === 200, `the worker is free again: a small request is served (${secs.toFixed(2)} s)`, r);
}

const phases = { turns, disk, cold, prefill };
if (!phases[phase]) {
  console.error(`agent.mjs: unknown phase ${phase}`);
  process.exit(2);
}
await run(phases[phase]);
