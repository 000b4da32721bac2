// carpool fleet page: polls /api/fleet about once a second and draws the fleet; the
// worker control POSTs /api/workers with the token carpool up printed (in the URL's
// #token=..., kept in sessionStorage, never sent but in the Authorization header).
"use strict";

const POLL_MS = 1000;
const MAX_QUEUE_DOTS = 120;
const MAX_PARTICLES_PER_S = 40;
const $ = (id) => document.getElementById(id);

let token = sessionStorage.getItem("carpool-token") || "";
let fleet = null;
let edited = false; // the operator is typing a count: do not overwrite it

function takeTokenFromUrl() {
  const m = location.hash.match(/token=([^&]+)/);
  if (m) {
    token = decodeURIComponent(m[1]);
    sessionStorage.setItem("carpool-token", token);
    history.replaceState(null, "", location.pathname + location.search);
  }
  $("token-row").hidden = token !== "";
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (token) h["Authorization"] = "Bearer " + token;
  return h;
}

function fmt(v, digits) {
  return v === null || v === undefined ? "–" : Number(v).toFixed(digits);
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

async function poll() {
  try {
    const r = await fetch("/api/fleet", { headers: headers(), cache: "no-store" });
    if (r.status === 401 || r.status === 403) {
      $("broker-state").textContent = "token needed";
      $("token-row").hidden = false;
      return;
    }
    fleet = await r.json();
    render(fleet);
  } catch (e) {
    $("broker-state").textContent = "page server gone";
    $("broker-state").className = "pill down";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function render(f) {
  const state = $("broker-state");
  state.textContent = f.stopping ? "stopping" : f.broker.up ? "broker up" : "broker not answering";
  state.className = "pill " + (f.broker.up && !f.stopping ? "up" : "down");
  $("window").textContent = "figures over the last " + f.window_s + " s";
  $("qps").textContent = fmt(f.qps, 1);
  $("p50").textContent = fmt(f.latency_ms.p50, 1);
  $("p95").textContent = fmt(f.latency_ms.p95, 1);
  $("p99").textContent = fmt(f.latency_ms.p99, 1);
  $("mean-batch").textContent = fmt(f.mean_batch, 2);
  $("live-workers").textContent = String(f.live_workers);
  $("desired").textContent = String(f.desired);
  $("max-workers").textContent = String(f.max_workers);
  $("workers-input").max = String(f.max_workers);
  if (!edited) $("workers-input").value = String(f.desired);
  renderClients(f.traffic);
  renderBroker(f.broker);
  renderWorkers(f.workers);
  renderHistogram(f.batch_sizes);
}

function renderClients(traffic) {
  const box = $("clients");
  box.replaceChildren();
  const n = traffic ? Math.max(1, Math.min(8, Math.round(traffic.rate_rps / 25))) : 1;
  for (let i = 0; i < n; i++) box.appendChild(el("div", "client", "C" + (i + 1)));
  $("traffic").textContent = traffic
    ? `built-in traffic ${traffic.rate_rps} req/s to ${traffic.model}: ${traffic.ok} ok, ` +
      `${Object.values(traffic.errors).reduce((a, b) => a + b, 0)} errors`
    : "any client of the frontend";
}

function renderBroker(b) {
  $("queued").textContent = String(b.queued);
  $("inflight").textContent = String(b.inflight_batches);
  const q = $("queue");
  q.replaceChildren();
  for (let i = 0; i < Math.min(b.queued, MAX_QUEUE_DOTS); i++) q.appendChild(el("i"));
  const errors = Object.entries(b.errors || {}).map(([k, v]) => `${k} ${v}`).join(", ");
  $("errors").textContent = (errors ? "errors: " + errors : "no errors") + ` · shed ${b.shed}`;
}

function renderWorkers(workers) {
  const box = $("workers");
  box.replaceChildren();
  for (const w of workers) {
    const state = w.registered ? (w.state === "running" || w.state === "outside" ? "" : w.state) : "pending";
    const card = el("div", "worker " + state);
    card.dataset.worker = w.name;
    card.dataset.registered = String(w.registered);
    card.appendChild(el("div", "name", w.name));
    const bmax = Object.entries(w.b_max).map(([m, b]) => `${b} (${m})`).join(", ");
    card.appendChild(el("div", "meta", w.registered ? `ρ ${fmt(w.rho, 2)} · B_max ${bmax || "–"}` : w.state));
    const rho = el("div", "rho");
    const fill = el("div");
    fill.style.width = Math.round(100 * Math.min(1, w.rho)) + "%";
    rho.appendChild(fill);
    card.appendChild(rho);
    const slots = el("div", "slots");
    for (let i = 0; i < w.slots; i++) slots.appendChild(el("i", i < w.outstanding ? "busy" : ""));
    card.appendChild(slots);
    const pid = w.pid ? `pid ${w.pid}` : w.state === "outside" ? "not started here" : "no process";
    card.appendChild(el("div", "meta", pid + (w.restarts ? ` · restarted ${w.restarts}×` : "")));
    box.appendChild(card);
  }
}

function renderHistogram(sizes) {
  const box = $("histogram");
  box.replaceChildren();
  const entries = Object.entries(sizes).map(([s, n]) => [Number(s), n]).sort((a, b) => a[0] - b[0]);
  const top = Math.max(1, ...entries.map((e) => e[1]));
  $("batch-window").textContent = entries.length ? "" : "(no batches yet)";
  for (const [size, n] of entries) {
    const bar = el("div", "bar");
    bar.title = `${n} batches of ${size}`;
    bar.appendChild(el("span", "", String(n)));
    const fill = el("div");
    fill.style.height = Math.round(100 * n / top) + "%";
    bar.appendChild(fill);
    bar.appendChild(el("span", "", "B=" + size));
    box.appendChild(bar);
  }
}

// ------------------------------------------------------------------ control

async function applyWorkers(n) {
  const msg = $("control-message");
  if (!token) {
    msg.textContent = "the token is needed: open the URL carpool up printed, or paste it";
    $("token-row").hidden = false;
    return;
  }
  $("workers-apply").disabled = true;
  try {
    const r = await fetch("/api/workers", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ workers: n }),
    });
    const body = await r.json();
    msg.textContent = r.ok ? `asked for ${body.workers} workers` : `refused: ${body.error}`;
    if (r.status === 401 || r.status === 403) $("token-row").hidden = false;
  } finally {
    $("workers-apply").disabled = false;
    edited = false;
  }
}

function step(delta) {
  const input = $("workers-input");
  const max = Number(input.max) || 1;
  input.value = String(Math.max(1, Math.min(max, Number(input.value) + delta)));
  edited = true;
}

function wire() {
  $("workers-minus").addEventListener("click", () => step(-1));
  $("workers-plus").addEventListener("click", () => step(1));
  $("workers-input").addEventListener("input", () => { edited = true; });
  $("workers-apply").addEventListener("click", () => applyWorkers(Number($("workers-input").value)));
  $("token-save").addEventListener("click", () => {
    token = $("token-input").value.trim();
    sessionStorage.setItem("carpool-token", token);
    $("token-row").hidden = token !== "";
  });
}

// ------------------------------------------------------------------ requests in motion

const particles = [];
let lastFrame = 0;
let owed = 0;

function centre(node, stage) {
  const r = node.getBoundingClientRect();
  return { x: r.left - stage.left + r.width / 2, y: r.top - stage.top + r.height / 2 };
}

function frame(t) {
  const canvas = $("flow");
  const stageBox = $("stage").getBoundingClientRect();
  if (canvas.width !== Math.round(stageBox.width)) canvas.width = Math.round(stageBox.width);
  if (canvas.height !== Math.round(stageBox.height)) canvas.height = Math.round(stageBox.height);
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const dt = lastFrame ? Math.min(0.1, (t - lastFrame) / 1000) : 0;
  lastFrame = t;
  const clients = [...document.querySelectorAll(".client")];
  const workers = [...document.querySelectorAll('.worker[data-registered="true"]')];
  const broker = $("broker");
  if (fleet && clients.length && workers.length) {
    owed += dt * Math.min(MAX_PARTICLES_PER_S, fleet.qps);
    while (owed >= 1) {
      owed -= 1;
      const c = centre(clients[Math.floor(Math.random() * clients.length)], stageBox);
      const b = centre(broker, stageBox);
      const w = centre(workers[Math.floor(Math.random() * workers.length)], stageBox);
      particles.push({ path: [c, b, w], p: 0 });
    }
  }
  ctx.strokeStyle = "rgba(79,179,255,0.12)";
  ctx.lineWidth = 1;
  if (clients.length && broker) {
    const b = centre(broker, stageBox);
    for (const n of [...clients, ...workers]) {
      const p = centre(n, stageBox);
      ctx.beginPath(); ctx.moveTo(p.x, p.y); ctx.lineTo(b.x, b.y); ctx.stroke();
    }
  }
  for (let i = particles.length - 1; i >= 0; i--) {
    const q = particles[i];
    q.p += dt * 1.2;
    if (q.p >= 2) { particles.splice(i, 1); continue; }
    const leg = Math.floor(q.p);
    const f = q.p - leg;
    const a = q.path[leg], z = q.path[leg + 1];
    ctx.fillStyle = leg === 0 ? "#4fb3ff" : "#4cd08a";
    ctx.beginPath();
    ctx.arc(a.x + (z.x - a.x) * f, a.y + (z.y - a.y) * f, 3, 0, 2 * Math.PI);
    ctx.fill();
  }
  requestAnimationFrame(frame);
}

takeTokenFromUrl();
wire();
poll();
requestAnimationFrame(frame);
