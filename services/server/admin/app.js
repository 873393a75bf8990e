// Engram's admin page: Preact + htm (vendored, no build step). The admin key stays in this
// tab's sessionStorage and goes out as a Bearer header; the page reads only the admin API.
import { html, render, useState, useEffect, useRef } from "./vendor/htm-preact-standalone.module.js";

const KEY = "engram-admin-key";
const HISTORY = 90;

async function api(path, method = "GET") {
  const key = sessionStorage.getItem(KEY) || "";
  const res = await fetch(path, { method, headers: { authorization: `Bearer ${key}` } });
  const text = await res.text();
  let body = text;
  try { body = JSON.parse(text); } catch (_) { /* not JSON */ }
  if (!res.ok) {
    const why = body && body.code ? `${body.code}: ${body.message}` : text;
    const err = new Error(`${res.status} ${why}`);
    err.status = res.status;
    throw err;
  }
  return body;
}

// Polls `path` every `ms` while mounted.
function usePoll(path, ms, deps = []) {
  const [state, setState] = useState({ data: null, error: null });
  useEffect(() => {
    let live = true;
    const tick = async () => {
      try {
        const data = await api(path);
        if (live) setState({ data, error: null });
      } catch (e) {
        if (live) setState((s) => ({ data: s.data, error: e.message }));
      }
    };
    tick();
    const t = setInterval(tick, ms);
    return () => { live = false; clearInterval(t); };
  }, [path, ms, ...deps]);
  return state;
}

const LAYER_COLOURS = {
  axioms: "#1f4e9c", identity: "#2f6fd1", rules: "#4f8fe6", capabilities: "#7aaef0", soul: "#a9c9f5",
  partner: "#7b4fb0", neurons: "#a57ad6", memories: "#2e8b57", affect: "#d98c1f",
  user_turn: "#c0392b", assistant_turn: "#e67e73", system_state: "#7f8c8d", current_time: "#95a5a6",
  awareness: "#b7950b",
};
const colour = (source) => LAYER_COLOURS[source] || "#555";

function Login({ onIn }) {
  const [key, setKey] = useState("");
  const [error, setError] = useState(null);
  const submit = async (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, key);
    try {
      await api("/v1/admin/tenants");
      onIn();
    } catch (err) {
      sessionStorage.removeItem(KEY);
      setError(err.message);
    }
  };
  return html`<section class="login">
    <h2>Engram admin</h2>
    <form class="inline" onSubmit=${submit}>
      <input id="admin-key" type="password" placeholder="admin key (auth.admin_key)" value=${key}
        onInput=${(e) => setKey(e.target.value)} autocomplete="off" size="32" />
      <button id="sign-in" type="submit">Sign in</button>
    </form>
    <p class="muted">The key stays in this tab (sessionStorage) and is sent as a Bearer header.</p>
    ${error && html`<p class="error" id="login-error">${error}</p>`}
  </section>`;
}

// Tier occupancy over time: used blocks as a share of each tier's capacity.
function Occupancy() {
  const { data, error } = usePoll("/v1/admin/cache", 2000);
  const history = useRef([]);
  if (data && data.occupancy) {
    const o = data.occupancy;
    const share = (u, c) => (c > 0 ? u / c : 0);
    const h = history.current;
    if (!h.length || h[h.length - 1].raw !== data) {
      h.push({ raw: data, hot: share(o.hot_used, o.hot_capacity), cold: share(o.cold_used, o.cold_capacity),
               reduced: share(o.reduced_used, o.reduced_capacity) });
      if (h.length > HISTORY) h.shift();
    }
  }
  const h = history.current;
  const W = 520, H = 120;
  // The scale follows the busiest tier seen (at least 1 %), so a nearly empty cache still shows.
  const top = Math.min(1, Math.max(0.01, ...h.map((p) => Math.max(p.hot, p.cold, p.reduced))) * 1.2);
  const line = (k) => h.map((p, i) => `${(i / Math.max(1, HISTORY - 1)) * W},${H - (p[k] / top) * H}`).join(" ");
  const o = data && data.occupancy;
  return html`<section id="occupancy" class="wide">
    <h2>Tier occupancy</h2>
    ${error && html`<p class="error">${error}</p>`}
    <svg width=${W + 40} height=${H + 20} viewBox="0 0 ${W + 40} ${H + 20}" role="img" aria-label="tier occupancy over time">
      <line x1="0" y1=${H} x2=${W} y2=${H} stroke="#d5dae0" />
      <line x1="0" y1="0" x2=${W} y2="0" stroke="#eef0f3" />
      <text x=${W + 4} y="10">${(100 * top).toFixed(top < 0.1 ? 1 : 0)} %</text><text x=${W + 4} y=${H}>0 %</text>
      <polyline fill="none" stroke="#c0392b" stroke-width="2" points=${line("hot")} />
      <polyline fill="none" stroke="#2456a6" stroke-width="2" points=${line("cold")} />
      <polyline fill="none" stroke="#7b4fb0" stroke-width="2" points=${line("reduced")} />
    </svg>
    <div class="legend">
      <span><span class="swatch" style=${{ background: "#c0392b" }}></span>hot</span>
      <span><span class="swatch" style=${{ background: "#2456a6" }}></span>cold</span>
      <span><span class="swatch" style=${{ background: "#7b4fb0" }}></span>reduced</span>
    </div>
    ${o && html`<table><tr><th>tier</th><th>used</th><th>capacity</th></tr>
      <tr><td>hot</td><td id="hot-used">${o.hot_used}</td><td>${o.hot_capacity}</td></tr>
      <tr><td>cold</td><td>${o.cold_used}</td><td>${o.cold_capacity}</td></tr>
      <tr><td>reduced</td><td>${o.reduced_used}</td><td>${o.reduced_capacity}</td></tr>
      <tr><td>running / queued</td><td>${o.running}</td><td>${data.queued}</td></tr></table>`}
  </section>`;
}

// A session's blocks as a strip: colour = source layer, faded = cold, dashed = recompute, dot = pinned.
function SessionStrip({ tenants }) {
  const [q, setQ] = useState({ tenant: "", agent: "", session: "" });
  const [page, setPage] = useState(null);
  const [error, setError] = useState(null);
  const show = async (e) => {
    e && e.preventDefault();
    const p = new URLSearchParams({ tenant: q.tenant || (tenants[0] && tenants[0].id) || "", agent: q.agent, session: q.session, limit: "1000" });
    try { setPage(await api(`/v1/admin/blocks?${p}`)); setError(null); } catch (err) { setError(err.message); }
  };
  const set = (k) => (e) => setQ({ ...q, [k]: e.target.value });
  const blocks = page ? page.blocks : [];
  const sources = [...new Set(blocks.map((b) => b.source))];
  // Attention mass as a bar inside each block, scaled to the page's largest.
  const top = Math.max(1e-9, ...blocks.map((b) => b.attention_mass));
  return html`<section id="session" class="wide">
    <h2>A session's blocks</h2>
    <form class="inline" onSubmit=${show}>
      <select id="strip-tenant" value=${q.tenant} onChange=${set("tenant")}>
        ${tenants.map((t) => html`<option value=${t.id}>${t.name} (${t.id})</option>`)}
      </select>
      <input id="strip-agent" placeholder="agent" value=${q.agent} onInput=${set("agent")} />
      <input id="strip-session" placeholder="session" value=${q.session} onInput=${set("session")} />
      <button id="strip-show" type="submit">Show</button>
    </form>
    ${error && html`<p class="error">${error}</p>`}
    ${page && html`<p class="muted" id="strip-count">${page.total} blocks</p>
      <div class="strip" id="strip">
        ${blocks.map((b) => html`<div
          class=${`block ${b.tier}${b.pin === "pinned" ? " pinned" : ""}${b.relocations > 0 ? " relocated" : ""}`}
          data-source=${b.source} data-tier=${b.tier} data-pin=${b.pin}
          data-mass=${b.attention_mass} data-reads=${b.reads} data-relocations=${b.relocations}
          title=${`#${b.id} ${b.source} tokens ${b.tokens[0]}–${b.tokens[1]} ${b.tier} ${b.precision} ${b.pin} priority ${b.priority} · attention mass ${b.attention_mass.toFixed(4)}, ${b.reads} reads, unread for ${b.unread_steps} steps · reused at another position ${b.relocations}×${b.shift ? `, copied here from ${b.shift} positions away` : ""}`}
          style=${{ background: colour(b.source) }}><div class="mass" style=${{ height: `${(100 * b.attention_mass) / top}%` }}></div></div>`)}
      </div>
      <div class="legend">
        ${sources.map((s) => html`<span><span class="swatch" style=${{ background: colour(s) }}></span>${s}</span>`)}
        <span>faded: cold · dashed: recompute · dot: pinned · dark bar: attention mass · outline: reused at another position</span>
      </div>`}
  </section>`;
}

function Reservations() {
  const { data, error } = usePoll("/v1/admin/reservations", 5000);
  return html`<section id="reservations">
    <h2>Reservations</h2>
    ${error && html`<p class="error">${error}</p>`}
    ${data && html`<p class="muted">hit rate ${data.hit_rate == null ? "–" : (100 * data.hit_rate).toFixed(1) + " %"}</p>
      <p class="muted" id="prefetch">prefetch: <span id="prefetch-reserved">${data.prefetch.reserved}</span> reserved, ${data.prefetch.unchanged} unchanged, ${data.prefetch.nothing} nothing, ${data.prefetch.capacity} capacity · turns ${data.prefetch.hits} hits, ${data.prefetch.misses} misses · hit rate ${data.prefetch.hit_rate == null ? "–" : (100 * data.prefetch.hit_rate).toFixed(1) + " %"}</p>
      <table><tr><th>id</th><th>source</th><th>state</th><th>blocks</th><th>held</th></tr>
        ${data.reservations.map((r) => html`<tr><td>${r.id}</td><td>${r.source}</td><td>${typeof r.state === "string" ? r.state : JSON.stringify(r.state)}</td><td>${r.blocks}</td><td>${r.held}</td></tr>`)}
      </table>`}
  </section>`;
}

function Shadow() {
  const [tick, setTick] = useState(0);
  const { data, error } = usePoll("/v1/admin/shadow", 5000, [tick]);
  const [said, setSaid] = useState(null);
  const flush = async () => {
    try {
      const r = await api("/v1/admin/shadow/flush", "POST");
      setSaid(`flushed: ${r.blocks} blocks, ${r.bytes} bytes in ${r.ms.toFixed(1)} ms`);
      setTick(tick + 1);
    } catch (err) { setSaid(err.message); }
  };
  return html`<section id="shadow">
    <h2>Shadow</h2>
    ${error && html`<p class="error">${error}</p>`}
    <button id="flush" onClick=${flush}>Flush the shadow</button> <span id="flush-result" class="muted">${said}</span>
    ${data && html`<table>
      <tr><td>where</td><td>${data.dir}</td></tr>
      <tr><td>sessions / prefixes</td><td>${data.sessions} / ${data.prefixes}</td></tr>
      <tr><td>bytes on disk</td><td>${data.bytes_on_disk}</td></tr>
      <tr><td>archived sessions</td><td>${data.archived_sessions}</td></tr>
      <tr><td>writes (failed)</td><td>${data.writes} (${data.failures})</td></tr>
      <tr><td>recovery</td><td>${Object.entries(data.recovery_counts || {}).map(([k, v]) => `${k} ${v}`).join(", ") || "nothing"} in ${data.recovery_ms.toFixed(1)} ms</td></tr>
    </table>`}
  </section>`;
}

function TierBridge() {
  const [tick, setTick] = useState(0);
  const { data, error } = usePoll("/v1/admin/tiers", 5000, [tick]);
  const [said, setSaid] = useState(null);
  const cycle = async () => {
    try {
      const r = await api("/v1/admin/tiers/cycle", "POST");
      setSaid(`cycle ${r.cycle}: spilled ${r.spilled}, warmed ${r.warmed}, removed ${r.removed}`);
      setTick(tick + 1);
    } catch (err) { setSaid(err.message); }
  };
  const cycles = data ? data.cycles.slice(-8).reverse() : [];
  return html`<section id="tiers">
    <h2>Tier bridge</h2>
    ${error && html`<p class="error">${error}</p>`}
    <button id="run-cycle" onClick=${cycle}>Run a cycle</button> <span id="cycle-result" class="muted">${said}</span>
    ${data && html`<p class="muted">${data.enabled ? `every ${data.interval_ms} ms` : "background cycles off"}
      · ${data.totals.cycles} cycles, ${data.totals.spilled} spilled, ${data.totals.warmed} warmed, ${data.totals.removed} removed</p>
      <table><tr><th>cycle</th><th>spilled</th><th>warmed</th><th>removed</th></tr>
        ${cycles.map((c) => html`<tr><td>${c.report.cycle}</td><td>${c.report.spilled}</td><td>${c.report.warmed}</td><td>${c.report.removed}</td></tr>`)}
      </table>`}
  </section>`;
}

// A memory node and its neighbours, laid out on a circle.
function Neighbourhood({ tenants }) {
  const [q, setQ] = useState({ tenant: "", id: "" });
  const [hood, setHood] = useState(null);
  const [error, setError] = useState(null);
  const show = async (e) => {
    e.preventDefault();
    const tenant = q.tenant || (tenants[0] && tenants[0].id) || "";
    try { setHood(await api(`/v1/admin/tenants/${encodeURIComponent(tenant)}/memory/nodes/${encodeURIComponent(q.id)}`)); setError(null); }
    catch (err) { setError(err.message); }
  };
  const W = 640, R = 110, cx = 260, cy = 150;
  const n = hood ? hood.neighbours.length : 0;
  const angle = (i) => -Math.PI / 2 + (2 * Math.PI * i) / Math.max(1, n);
  const at = (i) => [cx + R * Math.cos(angle(i)), cy + R * Math.sin(angle(i))];
  const pos = new Map(hood ? hood.neighbours.map((m, i) => [m.id, at(i)]) : []);
  if (hood) pos.set(hood.node.id, [cx, cy]);
  const short = (t) => (t.length > 28 ? t.slice(0, 27) + "…" : t);
  return html`<section id="memory" class="wide">
    <h2>A memory node's neighbourhood</h2>
    <form class="inline" onSubmit=${show}>
      <select id="node-tenant" value=${q.tenant} onChange=${(e) => setQ({ ...q, tenant: e.target.value })}>
        ${tenants.map((t) => html`<option value=${t.id}>${t.name} (${t.id})</option>`)}
      </select>
      <input id="node-id" placeholder="node id" value=${q.id} onInput=${(e) => setQ({ ...q, id: e.target.value })} />
      <button type="submit">Show</button>
    </form>
    ${error && html`<p class="error">${error}</p>`}
    ${hood && html`<svg width=${W} height="300" viewBox="0 0 ${W} 300" role="img" aria-label="memory neighbourhood">
      ${hood.edges.map((e) => {
        const a = pos.get(e.from_id), b = pos.get(e.to_id);
        return a && b && html`<line x1=${a[0]} y1=${a[1]} x2=${b[0]} y2=${b[1]} stroke="#b8c0ca" stroke-width=${1 + 2 * e.weight} />`;
      })}
      ${[hood.node, ...hood.neighbours].map((m) => {
        const [x, y] = pos.get(m.id);
        return html`<g><circle cx=${x} cy=${y} r=${m.id === hood.node.id ? 9 : 6} fill=${m.id === hood.node.id ? "#c0392b" : "#2456a6"} />
          <text x=${x + 10} y=${y + 4}>${m.kind}: ${short(m.text)}</text></g>`;
      })}
    </svg>
    <p class="muted">${hood.node.kind} “${hood.node.text}” · ${hood.edges.length} edges · ${n} neighbours</p>`}
  </section>`;
}

function App() {
  const [signedIn, setSignedIn] = useState(!!sessionStorage.getItem(KEY));
  const [tenants, setTenants] = useState([]);
  useEffect(() => {
    if (!signedIn) return;
    api("/v1/admin/tenants").then((t) => setTenants(t.tenants)).catch((e) => {
      if (e.status === 401) { sessionStorage.removeItem(KEY); setSignedIn(false); }
    });
  }, [signedIn]);
  if (!signedIn) return html`<${Login} onIn=${() => setSignedIn(true)} />`;
  const out = () => { sessionStorage.removeItem(KEY); setSignedIn(false); };
  return html`<header><h1>Engram</h1><span class="muted">${tenants.length} tenants</span>
      <span class="spacer"></span><button class="secondary" onClick=${out}>Sign out</button></header>
    <div class="grid">
      <${Occupancy} />
      <${SessionStrip} tenants=${tenants} />
      <${Reservations} />
      <${Shadow} />
      <${TierBridge} />
      <${Neighbourhood} tenants=${tenants} />
    </div>`;
}

const root = document.getElementById("app");
root.textContent = "";
render(html`<${App} />`, root);
