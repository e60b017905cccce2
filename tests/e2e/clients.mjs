// The official clients against kvtier serve:
//   node clients.mjs BASE_URL [SERVED_MODEL_ID]
//
// openai (chat completions and legacy completions, streaming and not,
// models.list) and @anthropic-ai/sdk (messages.create, messages.stream), a
// model id of the client's own served and echoed, then the sampling
// parameters: greedy and seeded sampling are repeatable,
// max_tokens is a bound, and a stop sequence ends the text before it. The
// synthetic preset models write arbitrary text, so the stop string is picked
// from a first unconstrained greedy completion.
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';
import { check, run, section } from './lib.mjs';

const [base, servedId] = process.argv.slice(2);
if (!base) {
  console.error('usage: node clients.mjs BASE_URL [SERVED_MODEL_ID]');
  process.exit(2);
}
const openai = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'x', maxRetries: 0 });
const anthropic = new Anthropic({ baseURL: base, apiKey: 'x', maxRetries: 0 });
const isInt = (v) => Number.isInteger(v) && v >= 0;

// The stop string for a text: a few characters from its middle, and the
// prefix the text must be cut to (everything before the first occurrence).
// Characters, not bytes: the generated text may hold multi-byte markers.
// Not across a U+FFFD: that is the server's repair of bytes that are not
// UTF-8, and a stop sequence matches the bytes generated.
function pickStop(text) {
  const chars = Array.from(text);
  for (let k = Math.floor(chars.length / 2); k >= 0; k--) {
    const stop = chars.slice(k, k + 3).join('');
    if (stop.length === 0 || stop.includes('\uFFFD')) continue;
    const at = text.indexOf(stop);
    if (at > 0 || k === 0) return { stop, before: text.slice(0, at) };
  }
  return null;
}

await run(async () => {
  const model = (await openai.models.list()).data.map((m) => m.id);
  section(`models: ${JSON.stringify(model)}`);
  check(model.length >= 1, 'models.list() returns at least one model');
  if (servedId) check(model.includes(servedId), `models.list() contains the served id ${servedId}`, model);
  const id = servedId || model[0];
  const msgs = [{ role: 'system', content: 'You answer briefly.' }, { role: 'user', content: 'Name three rivers.' }];

  section('openai chat.completions, non-streaming');
  const c1 = await openai.chat.completions.create({ model: id, messages: msgs, max_tokens: 12, temperature: 0 });
  check(c1.object === 'chat.completion', 'object is chat.completion', c1.object);
  check(c1.model === id, 'model echoes the served id', c1.model);
  check(typeof c1.choices[0].message.content === 'string', 'message.content is a string');
  check(c1.choices[0].message.role === 'assistant', 'message.role is assistant');
  check(['stop', 'length'].includes(c1.choices[0].finish_reason), 'finish_reason is stop or length',
    c1.choices[0].finish_reason);
  check(isInt(c1.usage.prompt_tokens) && c1.usage.prompt_tokens > 0, 'usage.prompt_tokens > 0', c1.usage);
  check(isInt(c1.usage.completion_tokens) && c1.usage.completion_tokens <= 12, 'usage.completion_tokens <= 12',
    c1.usage);
  check(c1.usage.total_tokens === c1.usage.prompt_tokens + c1.usage.completion_tokens, 'usage.total_tokens adds up');
  check(isInt(c1.usage.prompt_tokens_details?.cached_tokens), 'usage.prompt_tokens_details.cached_tokens present',
    c1.usage);

  section('openai chat.completions, streaming with include_usage');
  const s1 = await openai.chat.completions.create({
    model: id, messages: msgs, max_tokens: 12, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  let streamed = '', finish = null, usage = null, chunks = 0;
  let badChunk = null;
  for await (const ch of s1) {
    chunks++;
    if (ch.object !== 'chat.completion.chunk' && !badChunk) badChunk = ch;
    if (ch.usage) usage = ch.usage;
    const c = ch.choices[0];
    if (!c) continue;
    if (typeof c.delta?.content === 'string') streamed += c.delta.content;
    if (c.finish_reason) finish = c.finish_reason;
  }
  check(chunks > 1 && !badChunk, `${chunks} chunks, each a chat.completion.chunk`, badChunk);
  check(['stop', 'length'].includes(finish), 'a chunk carries finish_reason', finish);
  check(usage && isInt(usage.prompt_tokens) && isInt(usage.completion_tokens), 'a usage chunk arrives', usage);
  check(isInt(usage.prompt_tokens_details?.cached_tokens), 'streamed usage has cached_tokens', usage);
  check(streamed === c1.choices[0].message.content, 'greedy streamed text equals the non-streamed text',
    { streamed, plain: c1.choices[0].message.content });
  check(usage.prompt_tokens === c1.usage.prompt_tokens, 'same prompt_tokens streamed and not');

  section('openai completions (legacy), non-streaming and streaming');
  const p1 = await openai.completions.create({ model: id, prompt: 'Once upon a time', max_tokens: 10, temperature: 0 });
  check(p1.object === 'text_completion', 'object is text_completion', p1.object);
  check(typeof p1.choices[0].text === 'string', 'choices[0].text is a string');
  check(['stop', 'length'].includes(p1.choices[0].finish_reason), 'finish_reason', p1.choices[0].finish_reason);
  check(isInt(p1.usage.prompt_tokens) && p1.usage.completion_tokens <= 10, 'usage within max_tokens', p1.usage);
  const ps = await openai.completions.create({
    model: id, prompt: 'Once upon a time', max_tokens: 10, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  });
  let ptext = '', pfinish = null, pusage = null;
  for await (const ch of ps) {
    if (ch.usage) pusage = ch.usage;
    if (ch.choices[0]) {
      ptext += ch.choices[0].text ?? '';
      if (ch.choices[0].finish_reason) pfinish = ch.choices[0].finish_reason;
    }
  }
  check(ptext === p1.choices[0].text, 'streamed completion equals the non-streamed one', { ptext, p1: p1.choices[0].text });
  check(pfinish === p1.choices[0].finish_reason, 'streamed finish_reason', pfinish);
  check(pusage && pusage.completion_tokens === p1.usage.completion_tokens, 'streamed completion usage', pusage);

  section('anthropic messages.create');
  const a1 = await anthropic.messages.create({
    model: id, max_tokens: 12, temperature: 0, system: 'You answer briefly.',
    messages: [{ role: 'user', content: 'Name three rivers.' }],
  });
  check(a1.type === 'message' && a1.role === 'assistant', 'type message, role assistant', a1);
  check(a1.content[0]?.type === 'text' && typeof a1.content[0].text === 'string', 'content[0] is a text block');
  check(['end_turn', 'max_tokens'].includes(a1.stop_reason), 'stop_reason', a1.stop_reason);
  const u = a1.usage;
  // the prompt is the chat request's above, which the server holds: its
  // regeneration reads the whole prompt from the cache
  check(isInt(u.input_tokens) && isInt(u.cache_read_input_tokens) && isInt(u.cache_creation_input_tokens) &&
    u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens === c1.usage.prompt_tokens,
  'usage: input + cache read + cache creation tokens = the prompt\'s tokens', { u, prompt: c1.usage.prompt_tokens });
  check(isInt(u.output_tokens) && u.output_tokens <= 12, 'usage.output_tokens <= 12', u);
  check(isInt(u.cache_read_input_tokens), 'usage.cache_read_input_tokens present', u);
  check(isInt(u.cache_creation_input_tokens), 'usage.cache_creation_input_tokens present', u);
  check(a1.content[0].text === c1.choices[0].message.content,
    'same conversation, same greedy text through both APIs', { anthropic: a1.content[0].text });

  section('any model id is served and echoed (the server runs without --strict-model)');
  const other = await anthropic.messages.create({
    model: 'claude-opus-4-1', max_tokens: 2, temperature: 0, messages: [{ role: 'user', content: 'Hi.' }],
  });
  check(other.model === 'claude-opus-4-1', 'anthropic: model echoes the id sent', other.model);
  const otherStream = await anthropic.messages.stream({
    model: 'claude-opus-4-1', max_tokens: 2, temperature: 0, messages: [{ role: 'user', content: 'Hi.' }],
  }).finalMessage();
  check(otherStream.model === 'claude-opus-4-1', 'anthropic stream: message_start echoes it', otherStream.model);
  const oc = await openai.chat.completions.create({ model: 'gpt-4o-mini', messages: msgs, max_tokens: 2 });
  check(oc.model === 'gpt-4o-mini', 'openai: model echoes the id sent', oc.model);

  section('anthropic messages.stream');
  const st = anthropic.messages.stream({
    model: id, max_tokens: 12, temperature: 0, system: 'You answer briefly.',
    messages: [{ role: 'user', content: 'Name three rivers.' }],
  });
  let atext = '', events = 0;
  st.on('text', (t) => { atext += t; events++; });
  const fin = await st.finalMessage();
  check(events >= 1, 'text events arrive', events);
  check(fin.content[0]?.type === 'text' && fin.content[0].text === atext, 'finalMessage() text equals the text events',
    { fin: fin.content, atext });
  check(atext === a1.content[0].text, 'streamed text equals messages.create text');
  check(fin.stop_reason === a1.stop_reason, 'finalMessage() stop_reason', fin.stop_reason);
  check(fin.usage.output_tokens === a1.usage.output_tokens && isInt(fin.usage.input_tokens),
    'finalMessage() usage', fin.usage);

  section('sampling: repeatability');
  const greedy = () => openai.chat.completions.create({
    model: id, messages: [{ role: 'user', content: 'Count to ten.' }], max_tokens: 24, temperature: 0,
  });
  const g1 = (await greedy()).choices[0].message.content, g2 = (await greedy()).choices[0].message.content;
  check(g1 === g2, 'temperature 0 twice gives identical text', { g1, g2 });
  const seeded = (seed) => openai.chat.completions.create({
    model: id, messages: [{ role: 'user', content: 'Count to ten.' }], max_tokens: 24, temperature: 0.8, seed,
  });
  const r1 = (await seeded(1234)).choices[0].message.content, r2 = (await seeded(1234)).choices[0].message.content;
  check(r1 === r2, 'seed 1234 + temperature 0.8 twice gives identical text', { r1, r2 });
  const agreedy = () => anthropic.messages.create({
    model: id, max_tokens: 24, temperature: 0, messages: [{ role: 'user', content: 'Count to ten.' }],
  });
  check((await agreedy()).content[0].text === g1, 'anthropic greedy equals openai greedy on the same conversation');

  section('sampling: max_tokens');
  for (const mt of [1, 5]) {
    const r = await openai.chat.completions.create({
      model: id, messages: [{ role: 'user', content: 'Tell a long story.' }], max_tokens: mt, temperature: 0.8, seed: 7,
    });
    check(r.usage.completion_tokens <= mt, `max_tokens ${mt}: completion_tokens ${r.usage.completion_tokens}`);
    check(r.choices[0].finish_reason === 'length' || r.usage.completion_tokens < mt, `max_tokens ${mt}: finish_reason`,
      r.choices[0].finish_reason);
    const a = await anthropic.messages.create({
      model: id, max_tokens: mt, messages: [{ role: 'user', content: 'Tell a long story.' }],
    });
    check(a.usage.output_tokens <= mt, `anthropic max_tokens ${mt}: output_tokens ${a.usage.output_tokens}`);
  }

  section('sampling: stop sequences');
  const conv = [{ role: 'user', content: 'Describe the weather in detail.' }];
  const free = await openai.chat.completions.create({ model: id, messages: conv, max_tokens: 40, temperature: 0 });
  const text = free.choices[0].message.content;
  check(text.length > 0, 'the unconstrained greedy completion has text', free);
  const ps_ = pickStop(text);
  check(ps_ !== null, 'a stop string can be picked', text);
  const { stop, before } = ps_;
  console.log(`    stop string ${JSON.stringify(stop)}; expected text ${JSON.stringify(before)}`);
  const o = await openai.chat.completions.create({ model: id, messages: conv, max_tokens: 40, temperature: 0, stop });
  check(o.choices[0].finish_reason === 'stop', 'openai stop: finish_reason stop', o.choices[0].finish_reason);
  check(!o.choices[0].message.content.includes(stop), 'openai stop: the text does not contain the stop string');
  check(o.choices[0].message.content === before, 'openai stop: the text is everything before the stop string',
    o.choices[0].message.content);
  const os = await openai.chat.completions.create({
    model: id, messages: conv, max_tokens: 40, temperature: 0, stop: [stop], stream: true,
  });
  let otext = '', ofin = null;
  for await (const ch of os) {
    if (ch.choices[0]?.delta?.content) otext += ch.choices[0].delta.content;
    if (ch.choices[0]?.finish_reason) ofin = ch.choices[0].finish_reason;
  }
  check(ofin === 'stop' && otext === before, 'openai stop, streaming: same cut, finish_reason stop', { otext, ofin });
  const a = await anthropic.messages.create({
    model: id, max_tokens: 40, temperature: 0, messages: conv, stop_sequences: [stop],
  });
  check(a.stop_reason === 'stop_sequence', 'anthropic stop: stop_reason stop_sequence', a.stop_reason);
  check(a.stop_sequence === stop, 'anthropic stop: stop_sequence names the string', a.stop_sequence);
  check(a.content[0].text === before, 'anthropic stop: the text is everything before the stop string',
    a.content[0].text);
  const ast = anthropic.messages.stream({
    model: id, max_tokens: 40, temperature: 0, messages: conv, stop_sequences: [stop],
  });
  const afin = await ast.finalMessage();
  check(afin.stop_reason === 'stop_sequence' && afin.content[0].text === before,
    'anthropic stop, streaming: same cut, stop_reason stop_sequence', afin);
});
