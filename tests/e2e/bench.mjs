// Time to first token of the agent session, one tier at a time; driven by
// bench/serve.sh, which starts and restarts the server:
//   node bench.mjs BASE_URL cold|ram|disk STATE.json
//
//   cold  system prompt (25,000 tokens) + question 1, nothing cached
//   ram   the conversation resent with turn 1's reply + question 2: the live
//         session holds all of turn 1
//   disk  after a restart, system prompt + question 3 (a fresh conversation):
//         the snapshot turn 1 saved covers the system prompt
// Each prints one JSON line: {case, prompt_tokens, cached_tokens, ttft_s,
// total_s, load_s, prefill_s, save_s}, the last three from the server's
// /metrics (restoring from disk, prefilling, writing snapshots during this
// request). Raw fetch() and SSE parsing only, so no npm packages are needed.
import { readFileSync, writeFileSync } from 'node:fs';
import { metrics, pseudoCode, streamChat } from './lib.mjs';

// BENCH_SYS_BYTES: the system prompt's length in bytes (default 25000, the
// byte tokenizer's 25,000 tokens). BENCH_PEER=1: the server is llama.cpp's,
// whose /metrics differ; the tiers' timings are left out (null) and the
// cached tokens come from its timings.
const [base, phase, statePath] = process.argv.slice(2);
const SYS = pseudoCode(Number(process.env.BENCH_SYS_BYTES || 25000), 1);
const peer = process.env.BENCH_PEER === '1';
const U1 = 'Which routines write to row? Answer with their names.';
const U2 = 'Now list the ones that read from tail.';
const U3 = 'Explain what blk_hash does, step by step.';
const system = { role: 'system', content: SYS };
let messages;
if (phase === 'cold') messages = [system, { role: 'user', content: U1 }];
else if (phase === 'ram') {
  const { text1 } = JSON.parse(readFileSync(statePath, 'utf8'));
  messages = [system, { role: 'user', content: U1 }, { role: 'assistant', content: text1 }, { role: 'user', content: U2 }];
} else if (phase === 'disk') messages = [system, { role: 'user', content: U3 }];
else {
  console.error('usage: node bench.mjs BASE_URL cold|ram|disk STATE.json');
  process.exit(2);
}
const m0 = peer ? null : await metrics(base);
const t0 = performance.now();
const r = await streamChat(base, { messages, max_tokens: 16, temperature: 0 });
const total = (performance.now() - t0) / 1000;
// TTFT: the first generated token, answer or reasoning (a model that thinks
// first streams reasoning_content before any content)
const first = r.firstToken;
if (r.status !== 200 || first === null || !r.usage) {
  console.error(`bench.mjs ${phase}: HTTP ${r.status} ${r.error ?? ''}${first === null ? ' (no token)' : ''}`);
  process.exit(1);
}
const m1 = peer ? null : await metrics(base);
const spent = (name) => (peer ? null : Number((m1[name] - m0[name]).toFixed(3)));
if (phase === 'cold') writeFileSync(statePath, JSON.stringify({ text1: r.text }));
const cached = r.usage.prompt_tokens_details?.cached_tokens ?? r.timings?.cache_n ?? null;
console.log(JSON.stringify({
  case: phase, prompt_tokens: r.usage.prompt_tokens, cached_tokens: cached,
  ttft_s: Number(first.toFixed(3)), total_s: Number(total.toFixed(3)),
  load_s: spent('kvtier_load_seconds_sum'), prefill_s: spent('kvtier_prefill_seconds_sum'),
  save_s: spent('kvtier_save_seconds_sum'),
}));
