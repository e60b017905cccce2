// A recording HTTP proxy between an agent client and kvtier serve.
//
// Every request is forwarded unchanged (method, path and query, headers,
// body) and its response is streamed back unchanged. Requests are forwarded
// one at a time, in arrival order (kvtier runs one job at a time anyway), so
// that /metrics read just before and just after a request tells which cache
// tier served it: the proxy reads kvtier_reused_tokens_total{tier} and
// kvtier_prompt_tokens_total around every POST, with the request's own
// credentials.
//
// Each exchange becomes one record:
//   { n, method, url, headers (the request's, lower-case names), body (the
//     parsed JSON request body, or its text), status, contentType,
//     stream (an SSE response), events (SSE event names in order, repeats
//     collapsed), usage (the last usage object the response carried: OpenAI
//     chat, Responses or Anthropic shape, Anthropic's message_start and
//     message_delta merged), error (a non-2xx body, or an SSE error event),
//     tier: { ram, disk, prompt } (metric deltas over the request), ms }
//
// Used as a module (startProxy) by run.mjs, or alone for a manual session:
//   node proxy.mjs TARGET_URL LOG.jsonl [PORT]
// prints "listening on http://127.0.0.1:PORT" and appends records to LOG.
import http from 'node:http';
import { appendFileSync } from 'node:fs';

// Prometheus text to { 'name{labels}': value }.
function parseMetrics(text) {
  const out = {};
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const i = line.lastIndexOf(' ');
    out[line.slice(0, i)] = Number(line.slice(i + 1));
  }
  return out;
}

async function readMetrics(target, headers) {
  const h = {};
  if (headers.authorization) h.authorization = headers.authorization;
  if (headers['x-api-key']) h['x-api-key'] = headers['x-api-key'];
  try {
    const res = await fetch(`${target}/metrics`, { headers: h });
    if (res.status !== 200) return null;
    const m = parseMetrics(await res.text());
    return {
      ram: m['kvtier_reused_tokens_total{tier="ram"}'] ?? 0,
      disk: m['kvtier_reused_tokens_total{tier="disk"}'] ?? 0,
      prompt: m.kvtier_prompt_tokens_total ?? 0,
    };
  } catch {
    return null;
  }
}

// Merge the usage objects an SSE stream carries into one.
function takeUsage(rec, data) {
  const u = data.usage ?? data.response?.usage ?? data.message?.usage;
  if (u && typeof u === 'object') rec.usage = { ...(rec.usage ?? {}), ...u };
}

// Parse a complete SSE body into the record (events, usage, error).
function readSSE(rec, text) {
  rec.events = [];
  for (const block of text.split(/\r?\n\r?\n/)) {
    let name = null;
    const data = [];
    for (const line of block.split(/\r?\n/)) {
      if (line.startsWith('event:')) name = line.slice(6).trim();
      else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
    }
    if (!name && !data.length) continue;
    const raw = data.join('\n');
    let d = null;
    if (raw && raw !== '[DONE]') {
      try { d = JSON.parse(raw); } catch { d = null; }
    }
    const ev = name ?? (raw === '[DONE]' ? '[DONE]' : d?.object ?? 'data');
    if (rec.events[rec.events.length - 1] !== ev) rec.events.push(ev);
    if (!d) continue;
    takeUsage(rec, d);
    if (ev === 'error' || (d.error && !name)) rec.error = d.error ?? d;
    if (ev === 'response.failed') rec.error = d.response?.error ?? d;
  }
}

export function startProxy(target, { log, port = 0 } = {}) {
  const records = [];
  let chain = Promise.resolve();
  let n = 0;

  async function forward(req, res, body) {
    const t0 = performance.now();
    const headers = { ...req.headers };
    delete headers.host;
    delete headers.connection;
    delete headers['keep-alive'];
    delete headers['transfer-encoding'];
    delete headers['content-length'];
    let parsed = null;
    const text = body.toString('utf8');
    if (text) {
      try { parsed = JSON.parse(text); } catch { parsed = text; }
    }
    const rec = { n: ++n, method: req.method, url: req.url, headers: req.headers, body: parsed };
    const post = req.method === 'POST';
    const before = post ? await readMetrics(target, req.headers) : null;
    let up;
    try {
      up = await fetch(target + req.url, {
        method: req.method,
        headers,
        body: ['GET', 'HEAD'].includes(req.method) ? undefined : body,
        redirect: 'manual',
      });
    } catch (e) {
      rec.status = 502;
      rec.error = String(e);
      res.writeHead(502, { 'content-type': 'application/json' });
      res.end(JSON.stringify({ error: { message: `proxy: ${e}` } }));
      finish(rec, t0);
      return;
    }
    rec.status = up.status;
    rec.contentType = up.headers.get('content-type') ?? '';
    rec.stream = rec.contentType.startsWith('text/event-stream');
    const h = {};
    up.headers.forEach((v, k) => { if (!['content-length', 'transfer-encoding', 'connection', 'content-encoding'].includes(k)) h[k] = v; });
    if (up.headers.get('x-kvtier-cache')) rec.cacheHeader = up.headers.get('x-kvtier-cache');
    res.writeHead(up.status, h);
    const chunks = [];
    let gone = false;
    res.on('close', () => { if (!res.writableFinished) gone = true; });
    try {
      if (up.body) {
        for await (const c of up.body) {
          chunks.push(Buffer.from(c));
          if (!gone) res.write(c);
        }
      }
    } catch (e) {
      rec.error = `proxy: reading the response: ${e}`;
    }
    res.end();
    if (gone) rec.clientWentAway = true;
    const out = Buffer.concat(chunks).toString('utf8');
    if (rec.stream) {
      readSSE(rec, out);
    } else {
      let j = null;
      try { j = JSON.parse(out); } catch { j = null; }
      if (j && typeof j === 'object') takeUsage(rec, j);
      if (up.status >= 300) rec.error = j ?? out.slice(0, 2000);
      if (j && rec.url.startsWith('/v1/messages/count_tokens')) rec.countTokens = j;
    }
    if (post) {
      const after = await readMetrics(target, req.headers);
      if (before && after) {
        rec.tier = { ram: after.ram - before.ram, disk: after.disk - before.disk, prompt: after.prompt - before.prompt };
      }
    }
    finish(rec, t0);
  }

  function finish(rec, t0) {
    rec.ms = Math.round(performance.now() - t0);
    records.push(rec);
    if (log) appendFileSync(log, JSON.stringify(rec) + '\n');
  }

  const server = http.createServer((req, res) => {
    const parts = [];
    req.on('data', (c) => parts.push(c));
    req.on('end', () => {
      const body = Buffer.concat(parts);
      // one exchange at a time, in arrival order
      chain = chain.then(() => forward(req, res, body)).catch((e) => {
        try { res.writeHead(502); res.end(String(e)); } catch { /* gone */ }
      });
    });
  });
  server.keepAliveTimeout = 1000;
  return new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, '127.0.0.1', () => {
      const p = server.address().port;
      resolve({
        port: p,
        url: `http://127.0.0.1:${p}`,
        records,
        // wait for exchanges in flight, then stop listening
        close: async () => {
          await chain;
          server.closeAllConnections?.();
          await new Promise((r) => server.close(() => r()));
        },
      });
    });
  });
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const [target, log, port] = process.argv.slice(2);
  if (!target || !log) {
    console.error('usage: node proxy.mjs TARGET_URL LOG.jsonl [PORT]');
    process.exit(2);
  }
  const p = await startProxy(target, { log, port: Number(port ?? 0) });
  console.log(`listening on ${p.url}`);
}
