// The same request served cold, from RAM and from disk gives the same text,
// on a model whose text depends on the whole prompt:
//   node tiers.mjs BASE_URL PHASE STATE.json
//
// The synthetic ds4 presets (agent.mjs) write text that only echoes the last
// prompt token, so their texts would agree even on a wrong cache. The trained
// stories260K (a TinyStories llama, context 2048) continues a story in a way
// that depends on tokens far back, so here equal texts mean something, and
// negative controls show it: the same story with another first half, or
// with one word changed near its start, continues differently.
//
//   ram   fresh server (empty disk dir, a save policy scaled to this small
//         context): the story cold, then again from RAM, then the controls
//   disk  restarted on the same disk dir: the story from the snapshot the
//         cold request saved
import { readFileSync, writeFileSync } from 'node:fs';
import { check, metrics, postJSON, rng, run, section } from './lib.mjs';

const [base, phase, statePath] = process.argv.slice(2);
if (!base || !phase || !statePath) {
  console.error('usage: node tiers.mjs BASE_URL ram|disk STATE.json');
  process.exit(2);
}

// TinyStories-like sentences from a seeded generator.
function story(sentences, seed) {
  const r = rng(seed);
  const pick = (a) => a[Math.floor(r() * a.length)];
  const names = ['Lily', 'Tom', 'Ben', 'Mia', 'Sue', 'Max', 'Anna', 'Tim'];
  const things = ['ball', 'kite', 'cake', 'dog', 'cat', 'box', 'tree', 'boat', 'car', 'hat'];
  const adjs = ['big', 'red', 'little', 'happy', 'shiny', 'soft', 'blue', 'funny'];
  const verbs = ['saw', 'found', 'liked', 'wanted', 'took', 'made', 'gave', 'lost'];
  const out = [];
  for (let i = 0; i < sentences; i++) {
    switch (Math.floor(r() * 4)) {
      case 0: out.push(`${pick(names)} ${pick(verbs)} a ${pick(adjs)} ${pick(things)}.`); break;
      case 1: out.push(`"I like the ${pick(things)}," said ${pick(names)}.`); break;
      case 2: out.push(`${pick(names)} and ${pick(names)} went to the park with the ${pick(adjs)} ${pick(things)}.`); break;
      default: out.push(`The ${pick(things)} was very ${pick(adjs)}, so ${pick(names)} was happy.`);
    }
  }
  return out.join(' ');
}
const FIRST = story(35, 1), SECOND = story(35, 2), TAIL = ' One day, Lily went to the park. She';
const PROMPT = `Once upon a time, ${FIRST} ${SECOND}${TAIL}`;
const OTHER_FIRST = `Once upon a time, ${story(35, 7)} ${SECOND}${TAIL}`;
// One word of the first sentence changed: only the rows from there on differ.
const ONE_WORD = PROMPT.replace(/\b(ball|kite|cake|dog|cat|box|tree|boat|car|hat)\b/, (w) => (w === 'dog' ? 'cat' : 'dog'));
const loadState = () => JSON.parse(readFileSync(statePath, 'utf8'));
const saveState = (s) => writeFileSync(statePath, JSON.stringify(s, null, 1));

async function complete(prompt, label) {
  const r = await postJSON(`${base}/v1/completions`, { prompt, max_tokens: 40, temperature: 0 });
  check(r.status === 200, `${label}: 200`, r);
  const header = r.headers.get('x-kvtier-cache') || '';
  console.log(`    ${label}: X-KVTier-Cache "${header}", prompt ${r.body.usage.prompt_tokens}, ` +
    `cached ${r.body.usage.prompt_tokens_details.cached_tokens}, text ${JSON.stringify(r.body.choices[0].text)}`);
  return { text: r.body.choices[0].text, tier: header.split(';')[0], usage: r.body.usage };
}

async function ram() {
  section('cold, then from RAM');
  const c = await complete(PROMPT, 'cold');
  check(c.tier === 'none' && c.usage.prompt_tokens_details.cached_tokens === 0, 'the first request is cold', c.tier);
  check(c.usage.prompt_tokens > 600 && c.usage.prompt_tokens < 1500, 'the story is 600..1500 tokens',
    c.usage.prompt_tokens);
  check(c.text.trim().length > 0, 'the model writes text');
  const r = await complete(PROMPT, 'ram');
  check(r.tier === 'ram', 'the second request is served from RAM', r.tier);
  check(r.text === c.text, 'RAM text equals cold text');
  section('negative controls: the text depends on the whole prompt');
  const o = await complete(OTHER_FIRST, 'another first half');
  check(o.text !== c.text, 'the same story with another first half continues differently');
  const w = await complete(ONE_WORD, 'one word changed near the start');
  check(w.text !== c.text, 'the same story with one word changed near the start continues differently');
  const mx = await metrics(base);
  check(mx['kvtier_disk_saves_total'] >= 1, 'the cold request saved a snapshot', mx['kvtier_disk_saves_total']);
  saveState({ cold: c.text, ram: r.text, prompt_tokens: c.usage.prompt_tokens });
}

async function disk() {
  const st = loadState();
  section('after a restart, from disk');
  const d = await complete(PROMPT, 'disk');
  check(d.tier === 'disk', 'the request is served from disk', d.tier);
  check(d.usage.prompt_tokens_details.cached_tokens >= st.prompt_tokens / 2, 'most of the prompt comes from disk',
    d.usage);
  check(d.text === st.cold, 'disk text equals cold text', { disk: d.text, cold: st.cold });
}

const phases = { ram, disk };
if (!phases[phase]) {
  console.error(`tiers.mjs: unknown phase ${phase}`);
  process.exit(2);
}
await run(phases[phase]);
