// Tenants, one per API key, must not see each other: node tenants.mjs BASE_URL MODE
//
// Each mode expects the server started with matching flags (tests/test_e2e.c
// does that; every server has --kv-cache-min-tokens 128
// --kv-cache-align-tokens 128, so a 1,000-token prompt saves a snapshot):
//   metrics      --api-key K1 --api-key K2 --metrics-key M: /metrics needs a
//                key and reports that key's figures only, unchanged by the
//                other key's requests; M reads every key's, labelled, and
//                nothing else
//   keys         --api-key abc --api-key abcdef --api-key xyz-0123456789:
//                keys of other lengths, prefixes and extensions of a key are
//                refused; each key is accepted and is its own namespace
//   budget       --api-key K1 K2 K3 --metrics-key M --kv-disk-mb 1: K1 and
//                K2 save under their share (a third of the total), then K3
//                and later K1 save several times their share; every key
//                stays within its share, the three within the total, and
//                the light key's entries stay as they were
//   budget-disk  the same flags after a restart: K2's prompts restore from
//                its disk store
// Raw fetch() only.
import { check, getJSON, metrics, parseMetrics, postJSON, pseudoCode, run, section } from './lib.mjs';

const [base, mode] = process.argv.slice(2);
if (!base || !mode) {
  console.error('usage: node tenants.mjs BASE_URL metrics|keys|budget|budget-disk');
  process.exit(2);
}
const COMPL = `${base}/v1/completions`;
const bearer = (k) => ({ authorization: `Bearer ${k}` });

// One completion of a 1,000-token prompt (ds4 presets: a token per byte),
// greedy, one token. Returns the response with its X-KVTier-Cache header.
async function complete(key, seed) {
  const r = await postJSON(COMPL, { prompt: pseudoCode(1000, seed), max_tokens: 1, temperature: 0 }, bearer(key));
  check(r.status === 200, `key ${key}, prompt ${seed}: 200`, r);
  r.cache = r.headers.get('x-kvtier-cache') || '';
  return r;
}

// The figures of a metrics map that concern one tenant, as a comparable text.
const figures = (m) => JSON.stringify(Object.entries(m).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)));

async function metricsMode() {
  section('/metrics needs a key');
  const none = await getJSON(`${base}/metrics`);
  check(none.status === 401, 'GET /metrics without a key is 401', none.status);
  const wrong = await getJSON(`${base}/metrics`, { headers: bearer('K3') });
  check(wrong.status === 401, 'GET /metrics with a wrong key is 401', wrong.status);
  const pre = await getJSON(`${base}/metrics`, { headers: bearer('K') });
  check(pre.status === 401, 'GET /metrics with a prefix of a key is 401', pre.status);

  section('a fresh key sees zeros');
  for (const k of ['K1', 'K2']) {
    const m = await metrics(base, bearer(k));
    check(m.kvtier_prompt_tokens_total === 0 && m['kvtier_cache_entries{tier="disk"}'] === 0 &&
      m['kvtier_cache_entries{tier="ram"}'] === 0, `${k}: no prompt tokens, no entries`, m);
    check(!Object.keys(m).some((s) => s.startsWith('kvtier_requests_total')),
      `${k}: no requests counted (the 401s above belong to no key)`, m);
  }

  section('K1 works; K2 sees none of it');
  const a = await complete('K1', 11);
  const b = await complete('K1', 11);
  check(a.cache.startsWith('none') && b.cache.startsWith('ram'), 'K1: cold, then RAM', [a.cache, b.cache]);
  const prompt1 = a.body.usage.prompt_tokens + b.body.usage.prompt_tokens;
  const cached1 = b.body.usage.prompt_tokens_details.cached_tokens;
  const m1 = await metrics(base, bearer('K1'));
  check(m1.kvtier_prompt_tokens_total === prompt1, `K1: its prompt tokens (${prompt1})`, m1);
  check(m1['kvtier_reused_tokens_total{tier="ram"}'] === cached1 && m1['kvtier_cache_hits_total{tier="ram"}'] === 1 &&
    m1.kvtier_cache_misses_total === 1, `K1: its RAM hit (${cached1} tokens) and its miss`, m1);
  check(m1['kvtier_requests_total{endpoint="completions",status="2xx"}'] === 2, 'K1: its 2 requests', m1);
  check(m1['kvtier_cache_entries{tier="disk"}'] >= 1 && m1['kvtier_cache_bytes{tier="disk"}'] > 0 &&
    m1['kvtier_cache_entries{tier="ram"}'] >= 1 && m1['kvtier_cache_bytes{tier="ram"}'] > 0,
  'K1: its RAM and disk entries', m1);
  const m2 = await metrics(base, bearer('K2'));
  const zero = ['kvtier_prompt_tokens_total', 'kvtier_prefilled_tokens_total', 'kvtier_generated_tokens_total',
    'kvtier_reused_tokens_total{tier="ram"}', 'kvtier_reused_tokens_total{tier="disk"}',
    'kvtier_cache_hits_total{tier="ram"}', 'kvtier_cache_hits_total{tier="disk"}', 'kvtier_cache_misses_total',
    'kvtier_cache_bytes{tier="ram"}', 'kvtier_cache_bytes{tier="disk"}', 'kvtier_cache_entries{tier="ram"}',
    'kvtier_cache_entries{tier="disk"}', 'kvtier_disk_saves_total', 'kvtier_prefill_seconds_count',
    'kvtier_save_seconds_count', 'kvtier_load_seconds_count'];
  for (const name of zero) check(m2[name] === 0, `K2: ${name} is 0`, m2[name]);
  check(!Object.keys(m2).some((s) => s.startsWith('kvtier_requests_total')), 'K2: no requests counted', m2);
  check(m2['kvtier_cache_budget_bytes{tier="disk"}'] === m1['kvtier_cache_budget_bytes{tier="disk"}'],
    'K1 and K2: the same disk share', [m1, m2]);

  section('K2 works; K1\'s figures do not move');
  const c = await complete('K2', 11);
  check(c.cache.startsWith('none'), 'K2: the prompt K1 holds is cold for K2', c.cache);
  const m1b = await metrics(base, bearer('K1'));
  check(figures(m1b) === figures(m1), 'K1: every figure as before K2\'s request', { before: m1, after: m1b });
  const m2b = await metrics(base, bearer('K2'));
  check(m2b.kvtier_prompt_tokens_total === c.body.usage.prompt_tokens && m2b.kvtier_cache_misses_total === 1 &&
    m2b['kvtier_requests_total{endpoint="completions",status="2xx"}'] === 1, 'K2: its own request only', m2b);

  section('the metrics key');
  const all = await getJSON(`${base}/metrics`, { headers: bearer('M') });
  check(all.status === 200, 'GET /metrics with M is 200', all.status);
  const mm = parseMetrics(all.body);
  const tenants = [...new Set(Object.keys(mm).map((s) => (s.match(/tenant="([^"]*)"/) || [])[1]).filter(Boolean))];
  // labels tell nothing of the keys: K1 unnamed is key1, K2 was given as second=K2
  check(tenants.length === 2 && tenants.includes('key1') && tenants.includes('second'),
    'M: two tenants, labelled key1 and second', tenants);
  check(!all.body.includes('K1') && !all.body.includes('K2') && !/ns-[0-9a-f]/.test(all.body),
    'M: nothing of a key (nor a hash of one) in the operator view', all.body.slice(0, 300));
  // each tenant's series equal that key's own view, label removed
  for (const [own, t] of [[m1b, 'key1'], [m2b, 'second']]) {
    check(mm[`kvtier_prompt_tokens_total{tenant="${t}"}`] === own.kvtier_prompt_tokens_total,
      `M: ${t} has its key's prompt tokens`, { own, mm });
    const mine = {};
    for (const [k, v] of Object.entries(mm)) {
      if (!k.includes(`tenant="${t}"`)) continue;
      mine[k.replace(`tenant="${t}",`, '').replace(`{tenant="${t}"}`, '')] = v;
    }
    check(figures(mine) === figures(own), `M: ${t}'s series equal its key's own /metrics`, { mine, own });
  }
  check(mm.kvtier_refused_requests_total >= 3, 'M: the refused requests (401s) are counted', mm.kvtier_refused_requests_total);
  const inf = await postJSON(COMPL, { prompt: 'x', max_tokens: 1 }, bearer('M'));
  check(inf.status === 403 && inf.body.error.type === 'permission_error', 'M on /v1/completions is 403', inf);
  const mod = await getJSON(`${base}/v1/models`, { headers: { 'x-api-key': 'M' } });
  check(mod.status === 403, 'M on /v1/models is 403', mod.status);
  const m1c = await metrics(base, { 'x-api-key': 'K1' });
  check(figures(m1c) === figures(m1), 'K1 (x-api-key): still every figure as before', { before: m1, after: m1c });
}

async function keysMode() {
  const KEYS = ['abc', 'abcdef', 'xyz-0123456789'];
  const tiny = { prompt: 'x', max_tokens: 1, temperature: 0 };
  section('keys that are not configured');
  const refused = ['a', 'ab', 'abcd', 'abcde', 'abcdefg', 'abcdefabc', 'ABC', 'Abcdef', 'abd', 'bc', 'abcabcdef',
    'xyz-012345678', 'xyz-01234567890', 'xyz-0123456788', 'abcxyz-0123456789', 'abc\tdef', 'K'];
  for (const k of refused) {
    const r = await postJSON(COMPL, tiny, bearer(k));
    check(r.status === 401, `Bearer ${JSON.stringify(k)} (${k.length} bytes) is 401`, r.status);
    const x = await postJSON(COMPL, tiny, { 'x-api-key': k });
    check(x.status === 401, `x-api-key ${JSON.stringify(k)} is 401`, x.status);
  }
  const empty = await postJSON(COMPL, tiny, { authorization: 'Bearer ' });
  check(empty.status === 401, 'an empty Bearer key is 401', empty.status);
  const basic = await postJSON(COMPL, tiny, { authorization: 'Basic abc' });
  check(basic.status === 401, 'Authorization: Basic abc is 401', basic.status);

  section('each configured key, and each is its own namespace');
  for (const k of KEYS) {
    const r = await postJSON(COMPL, tiny, bearer(k));
    check(r.status === 200, `Bearer ${k} is 200`, r.status);
    const x = await postJSON(COMPL, tiny, { 'x-api-key': k });
    check(x.status === 200, `x-api-key ${k} is 200`, x.status);
  }
  // the same prompt under each key: cold for each, then a RAM hit for its own
  for (const k of KEYS) {
    const a = await complete(k, 21);
    check(a.cache.startsWith('none'), `${k}: the prompt is cold (the other keys' sessions are not its own)`, a.cache);
    const b = await complete(k, 21);
    check(b.cache.startsWith('ram'), `${k}: then a RAM hit`, b.cache);
  }
  for (const k of KEYS) {
    const m = await metrics(base, bearer(k));
    // the tiny prompt sent twice (Bearer, then x-api-key) is a regeneration
    // the second time: a RAM hit too
    check(m['kvtier_requests_total{endpoint="completions",status="2xx"}'] === 4 &&
      m['kvtier_cache_hits_total{tier="ram"}'] === 2, `${k}: /metrics counts its 4 requests and its 2 hits`, m);
  }
}

// Per key: its disk bytes, entries, saves, evictions and share, read with
// the metrics key.
async function disk() {
  const r = await getJSON(`${base}/metrics`, { headers: bearer('M') });
  check(r.status === 200, 'GET /metrics with M', r.status);
  const mm = parseMetrics(r.body);
  const out = {};
  for (const [k, v] of Object.entries(mm)) {
    const t = (k.match(/tenant="([^"]*)"/) || [])[1];
    if (!t) continue;
    const o = (out[t] ??= {});
    if (k.startsWith('kvtier_cache_bytes{') && k.includes('tier="disk"')) o.bytes = v;
    if (k.startsWith('kvtier_cache_entries{') && k.includes('tier="disk"')) o.entries = v;
    if (k.startsWith('kvtier_cache_evictions_total{') && k.includes('tier="disk"')) o.evictions = v;
    if (k.startsWith('kvtier_cache_budget_bytes{') && k.includes('tier="disk"')) o.budget = v;
    if (k.startsWith('kvtier_disk_saves_total{')) o.saves = v;
    if (k.startsWith('kvtier_prompt_tokens_total{')) o.prompt = v;
  }
  return out;
}

// The three keys' tenants by their prompt tokens so far (K1, K2, K3 send
// different amounts).
async function perKey() {
  const own = {};
  for (const k of ['K1', 'K2', 'K3']) {
    const m = await metrics(base, bearer(k));
    own[k] = {
      bytes: m['kvtier_cache_bytes{tier="disk"}'], entries: m['kvtier_cache_entries{tier="disk"}'],
      evictions: m['kvtier_cache_evictions_total{tier="disk"}'], budget: m['kvtier_cache_budget_bytes{tier="disk"}'],
      saves: m.kvtier_disk_saves_total,
    };
  }
  return own;
}

const TOTAL = 1 << 20; // --kv-disk-mb 1
// Prompts of K1 and K2 before the heavy use: under their share, with room
// for the shutdown saves of their live sessions (reason "shutdown", one a
// session), so that after a restart K2's snapshots are all still there.
const LIGHT = 2;       // prompts of a light key (ds4-tiny entries of ~60 KB: under half its share)
const HEAVY = 40;      // prompts of a heavy key: several times its share

function show(what, d) {
  const sum = Object.values(d).reduce((s, x) => s + x.bytes, 0);
  console.log(`  ${what}: ${Object.entries(d).map(([k, x]) => `${k} ${x.bytes} B in ${x.entries} entries` +
    ` (${x.saves} saved, ${x.evictions} evicted)`).join('; ')}; sum ${sum} B of ${TOTAL}`);
  return sum;
}

function within(d, what) {
  const share = Math.floor(TOTAL / 3);
  for (const [k, x] of Object.entries(d)) {
    check(x.budget === share, `${what}: ${k}'s share is a third of the total (${share} B)`, x);
    check(x.bytes <= share, `${what}: ${k} holds ${x.bytes} B <= its share`, x);
  }
  const sum = Object.values(d).reduce((s, x) => s + x.bytes, 0);
  check(sum <= TOTAL, `${what}: the three hold ${sum} B <= the total ${TOTAL} B`, d);
  return sum;
}

async function budgetMode() {
  section('K1 and K2 save under their share');
  for (let i = 0; i < LIGHT; i++) {
    await complete('K1', 100 + i);
    await complete('K2', 200 + i);
  }
  const d1 = await perKey();
  show('after the light use', d1);
  within(d1, 'light use');
  for (const k of ['K1', 'K2']) {
    check(d1[k].entries >= LIGHT && d1[k].evictions === 0, `${k}: ${d1[k].entries} entries, none evicted`, d1[k]);
    check(d1[k].bytes < 0.5 * d1[k].budget, `${k}: under its share (${d1[k].bytes} of ${d1[k].budget} B)`, d1[k]);
  }
  const snap = d1.K1.bytes / d1.K1.entries;

  section('K3 saves several times its share');
  for (let i = 0; i < HEAVY; i++) await complete('K3', 300 + i);
  const d2 = await perKey();
  show('after K3\'s heavy use', d2);
  within(d2, 'K3 heavy');
  check(d2.K3.saves * snap > TOTAL, `K3 wrote about ${Math.round(d2.K3.saves * snap)} B, more than the total`, d2.K3);
  check(d2.K3.evictions > 0 && d2.K3.bytes > 0.5 * d2.K3.budget, 'K3 evicted its own entries and fills its share',
    d2.K3);
  for (const k of ['K1', 'K2'])
    check(d2[k].bytes === d1[k].bytes && d2[k].entries === d1[k].entries && d2[k].evictions === 0,
      `${k}: its entries untouched by K3 (${d2[k].entries}, ${d2[k].bytes} B)`, { before: d1[k], after: d2[k] });

  section('K1 too saves several times its share');
  for (let i = 0; i < HEAVY; i++) await complete('K1', 400 + i);
  const d3 = await perKey();
  show('after K1\'s heavy use', d3);
  within(d3, 'K1 heavy');
  check(d3.K1.evictions > 0, 'K1 evicted its own entries', d3.K1);
  check(d3.K2.bytes === d1.K2.bytes && d3.K2.entries === d1.K2.entries && d3.K2.evictions === 0,
    `K2: its entries untouched (${d3.K2.entries}, ${d3.K2.bytes} B)`, { before: d1.K2, after: d3.K2 });
  check(d3.K3.bytes === d2.K3.bytes && d3.K3.entries === d2.K3.entries, 'K3: untouched by K1', { d2: d2.K3, d3: d3.K3 });

  section('the metrics key sees the same');
  const op = await disk();
  check(Object.keys(op).length === 3, 'M: three tenants', op);
  const sum = Object.values(op).reduce((s, x) => s + x.bytes, 0);
  const own = Object.values(d3).reduce((s, x) => s + x.bytes, 0);
  check(sum === own && sum <= TOTAL, `M: the three hold ${sum} B, as their keys report`, { op, d3 });
  console.log(`  figures: ${JSON.stringify({ total: TOTAL, share: Math.floor(TOTAL / 3), snapshot: Math.round(snap), light: d1, k3: d2.K3, end: d3 })}`);
}

async function budgetDiskMode() {
  section('after a restart, K2\'s prompts come from its disk store');
  for (let i = 0; i < LIGHT; i++) {
    const r = await complete('K2', 200 + i);
    check(r.cache.startsWith('disk') && r.body.usage.prompt_tokens_details.cached_tokens >= 896,
      `K2, prompt ${200 + i}: ${r.cache}`, r.cache);
  }
  const d = await perKey();
  show('after the restart', d);
  within(d, 'after the restart');
  check(d.K2.evictions === 0 && d.K2.entries >= LIGHT, `K2: nothing of its own evicted (${d.K2.entries} entries)`, d.K2);
}

const modes = { metrics: metricsMode, keys: keysMode, budget: budgetMode, 'budget-disk': budgetDiskMode };
if (!modes[mode]) {
  console.error(`unknown mode ${mode}`);
  process.exit(2);
}
run(modes[mode]);
