// The dashboard's only script: draws the server-built Plotly figures, refreshes the overview
// from the JSON API without reloading the page, and follows running retrain jobs.
"use strict";

function readFigure(div) {
  return JSON.parse(document.getElementById(div.dataset.figure).textContent);
}

function drawFigures() {
  if (!window.Plotly) return;
  for (const div of document.querySelectorAll("[data-figure]")) {
    const fig = readFigure(div);
    Plotly.newPlot(div, fig.data, fig.layout, { responsive: true, displaylogo: false });
  }
}

function autosubmitPickers() {
  for (const select of document.querySelectorAll("select[data-autosubmit]")) {
    select.addEventListener("change", () => select.form.submit());
  }
}

function fmt(value, digits) {
  if (value === null || value === undefined) return "–";
  return value.toLocaleString("en-US", {
    minimumFractionDigits: digits, maximumFractionDigits: digits,
  });
}

function utc(seconds) {
  return new Date(seconds * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
}

// Overview: every few seconds fetch /api/overview for the chosen range and redraw in place.
function liveOverview() {
  const section = document.getElementById("overview");
  if (!section || !window.Plotly) return;
  const figureDiv = section.querySelector("[data-figure]");
  const state = { range: section.dataset.range, busy: false, refreshes: 0 };
  const field = (name) => section.querySelector(`[data-summary="${name}"]`);

  function show(data) {
    Plotly.react(figureDiv, data.figure.data, data.figure.layout);
    const latest = data.latest || {};
    const res = data.resolution;
    field("goodput").textContent = `${fmt(data.summary.goodput, 0)} tok/s`;
    field("accept_len").textContent = fmt(data.summary.accept_len, 2);
    field("num_steps").textContent = String(data.summary.num_steps);
    field("shape").textContent = latest.shape || "–";
    field("decision_source").textContent = latest.decision_source || "–";
    field("active_policy_version").textContent =
      data.active_policy_version === null ? "none (analytic fallback, or the step-time profile)" : data.active_policy_version;
    field("active_pins").textContent = String(data.active_pins);
    const buckets = res.bucket_s ? `${res.bucket_s} s buckets` : "one per step";
    const rolled = res.rolled_up ? ", with per-minute roll-ups" : "";
    field("resolution").textContent = `${res.points} points, ${buckets} (${res.tier}${rolled}), ` +
      `${utc(data.range.start)} – ${utc(data.range.end)}`;
    state.refreshes += 1;
    section.dataset.refreshes = String(state.refreshes);
    field("updated").textContent = `(updated ${new Date().toLocaleTimeString()})`;
  }

  async function refresh() {
    if (state.busy) return;
    state.busy = true;
    try {
      const url = `${section.dataset.api}&range=${encodeURIComponent(state.range)}&figure=1`;
      const response = await fetch(url, { headers: { Accept: "application/json" } });
      if (response.status === 401) {
        window.location.reload();  // the session ended: the page redirects to the login form
        return;
      }
      if (response.ok) show(await response.json());
    } finally {
      state.busy = false;
    }
  }

  for (const link of section.querySelectorAll(".ranges a[data-range]")) {
    link.addEventListener("click", (event) => {
      event.preventDefault();
      state.range = link.dataset.range;
      for (const other of section.querySelectorAll(".ranges a")) other.removeAttribute("aria-current");
      link.setAttribute("aria-current", "true");
      history.replaceState(null, "", link.href);
      refresh();
    });
  }
  setInterval(() => { if (!document.hidden) refresh(); }, Number(section.dataset.refreshMs));
  // The range links now refresh in place; before this point a click loads the page anew.
  section.dataset.live = "on";
}

// Retrain: while a job is queued or running, follow it; reload once it has finished so the
// new policy version shows.
function followJobs() {
  const table = document.getElementById("jobs");
  if (!table || !table.querySelector('tr[data-finished="no"]')) return;
  const timer = setInterval(async () => {
    const response = await fetch(table.dataset.api, { headers: { Accept: "application/json" } });
    if (!response.ok) return;
    const { jobs } = await response.json();
    for (const job of jobs) {
      const row = table.querySelector(`tr[data-job="${job.id}"]`);
      if (!row || row.dataset.finished === "yes") continue;
      if (job.finished) {
        clearInterval(timer);
        window.location.reload();
        return;
      }
      row.querySelector(".status").textContent = job.status;
      row.querySelector("progress").value = job.progress;
    }
  }, 1000);
}

drawFigures();
autosubmitPickers();
liveOverview();
followJobs();
