// Shared helpers of the end-to-end scripts: deterministic prompt text, a
// check() that stops the script at the first failure, SSE reading over raw
// fetch(), and /metrics parsing. Nothing here needs node_modules, so the
// serving benchmark (bench/serve.sh) can use it on a bare Node install.

// mulberry32: a small seeded PRNG, so every run sends the same bytes.
export function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const WORDS = ['buf', 'len', 'row', 'col', 'key', 'val', 'node', 'next', 'head', 'tail', 'off', 'cap',
  'seq', 'pos', 'tok', 'blk', 'hash', 'slot', 'page', 'ring', 'mask', 'span', 'step', 'sum'];
const OPS = ['+', '-', '*', '^', '&', '|', '<<', '>>'];

// Exactly `bytes` bytes of ASCII pseudo-code: numbered functions with varied
// statements. The built-in tokenizer of the ds4 presets is byte-level, so
// this is also exactly `bytes` prompt tokens. Different seeds diverge from
// the first byte on (the header names the seed).
export function pseudoCode(bytes, seed = 1) {
  const r = rng(seed);
  const pick = (a) => a[Math.floor(r() * a.length)];
  const parts = [`// listing ${seed}: reference routines of the block store\n`];
  let len = parts[0].length;
  for (let f = 0; len < bytes; f++) {
    const lines = [`fn ${pick(WORDS)}_${pick(WORDS)}_${f}(${pick(WORDS)}, ${pick(WORDS)}) {\n`];
    const n = 3 + Math.floor(r() * 6);
    for (let i = 0; i < n; i++) {
      const a = pick(WORDS), b = pick(WORDS), c = Math.floor(r() * 4096);
      switch (Math.floor(r() * 4)) {
        case 0: lines.push(`    let ${a} = ${b} ${pick(OPS)} ${c};\n`); break;
        case 1: lines.push(`    if ${a} > ${b} { ${a} = ${a} ${pick(OPS)} ${c}; }\n`); break;
        case 2: lines.push(`    for i in 0..${c} { ${a}[i] = ${b}[i ${pick(OPS)} ${c % 97}]; }\n`); break;
        default: lines.push(`    ${a}.${b} = load(${b}, ${c});\n`);
      }
    }
    lines.push(`    return ${pick(WORDS)};\n}\n\n`);
    const s = lines.join('');
    parts.push(s);
    len += s.length;
  }
  return parts.join('').slice(0, bytes);
}

let failures = 0;
// Print what is checked; exit non-zero on the first failure.
export function check(cond, what, detail) {
  if (cond) {
    console.log(`  ok   ${what}`);
    return;
  }
  failures++;
  console.log(`  FAIL ${what}${detail === undefined ? '' : `: ${typeof detail === 'string' ? detail : JSON.stringify(detail)}`}`);
  process.exit(1);
}

export function section(name) { console.log(name); }

// Run main(), turning an exception into a failure with its message.
export async function run(main) {
  try {
    await main();
  } catch (e) {
    console.log(`  FAIL uncaught: ${e && e.stack ? e.stack : e}`);
    process.exit(1);
  }
  console.log(failures ? 'failed' : 'all checks passed');
  process.exit(failures ? 1 : 0);
}

export async function getJSON(url, init) {
  const res = await fetch(url, init);
  const text = await res.text();
  let body;
  try { body = JSON.parse(text); } catch { body = text; }
  return { status: res.status, headers: res.headers, body };
}

export function postJSON(url, body, headers = {}) {
  return getJSON(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: typeof body === 'string' ? body : JSON.stringify(body),
  });
}

// Prometheus text to { 'name{labels}': value }.
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const i = line.lastIndexOf(' ');
    out[line.slice(0, i)] = Number(line.slice(i + 1));
  }
  return out;
}

// GET /metrics (with headers: an API key's own figures) as parseMetrics
// gives them; throws unless the status is 200. Saves and disk loads run on
// the server's store thread after the response: the figures are read once
// its queue (kvtier_disk_queue) is empty, within 60 s, so that they count
// the saves of the requests answered before.
export async function metrics(base, headers = {}) {
  for (const t0 = performance.now(); ;) {
    const res = await fetch(`${base}/metrics`, { headers });
    const text = await res.text();
    if (res.status !== 200) throw new Error(`GET /metrics: HTTP ${res.status} ${text}`);
    const m = parseMetrics(text);
    const busy = Object.keys(m).some((k) => /^kvtier_disk_queue(\{|$)/.test(k) && m[k] > 0);
    if (!busy || performance.now() - t0 > 60000) return m;
    await new Promise((r) => setTimeout(r, 20));
  }
}

// A streaming OpenAI chat request over raw fetch. Records when each body
// chunk arrived, the SSE comments, and the concatenated content. Returns
// { status, text, usage, comments, firstByte, firstContent, firstToken,
// gaps, timings } where times are seconds from the request (firstToken: the
// first delta of content or reasoning_content), gaps are the silences
// between consecutive chunks before the first content, and timings is
// llama.cpp's server's last timings object (null from kvtier).
export async function streamChat(base, body, { signal, headers = {} } = {}) {
  const t0 = performance.now();
  const res = await fetch(`${base}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  const out = { status: res.status, text: '', usage: null, comments: [], firstByte: null, firstContent: null,
    firstToken: null, gaps: [], finish: null, timings: null };
  if (res.status !== 200) { out.error = await res.text(); return out; }
  const dec = new TextDecoder();
  let pending = '', last = t0;
  for await (const chunk of res.body) {
    const now = performance.now();
    if (out.firstByte === null) out.firstByte = (now - t0) / 1000;
    if (out.firstContent === null) out.gaps.push((now - last) / 1000);
    last = now;
    pending += dec.decode(chunk, { stream: true });
    let k;
    while ((k = pending.indexOf('\n\n')) >= 0) {
      const ev = pending.slice(0, k);
      pending = pending.slice(k + 2);
      for (const line of ev.split('\n')) {
        if (line.startsWith(':')) { out.comments.push({ at: (now - t0) / 1000, text: line }); continue; }
        if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
        const d = JSON.parse(line.slice(6));
        if (d.error) throw new Error(`stream error: ${JSON.stringify(d.error)}`);
        if (d.usage) out.usage = d.usage;
        if (d.timings) out.timings = d.timings; /* llama.cpp's server: cache_n, prompt_n, ... */
        const c = d.choices && d.choices[0];
        // the first generated token, reasoning or answer
        if (out.firstToken === null && c && c.delta &&
            ((typeof c.delta.content === 'string' && c.delta.content.length) ||
             (typeof c.delta.reasoning_content === 'string' && c.delta.reasoning_content.length)))
          out.firstToken = (now - t0) / 1000;
        if (c && c.delta && typeof c.delta.content === 'string' && c.delta.content.length) {
          if (out.firstContent === null) out.firstContent = (now - t0) / 1000;
          out.text += c.delta.content;
        }
        if (c && c.finish_reason) out.finish = c.finish_reason;
      }
    }
  }
  return out;
}

export function sleep(ms) { return new Promise((r) => setTimeout(r, ms)); }

// Poll /metrics (with headers: a key's own figures) until pred(figures)
// holds and return them: a test waits for the server's state, never for a
// fixed time. Fails after ms (a bound on a hang, not a speed).
export async function waitMetrics(base, headers, pred, what, ms = 120000) {
  const end = performance.now() + ms;
  for (;;) {
    const m = await metrics(base, headers);
    if (pred(m)) return m;
    if (performance.now() > end) check(false, `the server reaches: ${what} (within ${ms / 1000} s)`, m);
    await sleep(10);
  }
}
