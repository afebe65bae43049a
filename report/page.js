// gpuwatch report page: draws the model (the JSON in #report-data) into views. Lines and histograms are uPlot's;
// the heatmap and the stacked and grouped bars are drawn on a canvas here (uPlot has neither). Every chart records
// how many marks it drew in data-marks, and a view that names a rank or stage says so in data attributes: the
// browser test reads them. A finding's link highlights its ranks and steps in its view and scrolls to it.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const root = document.getElementById("report");
  const ranks = data.ranks.map((r) => r.rank);
  const labels = data.ranks.map((r) => (r.dp === null ? "r" + r.rank : `r${r.rank} dp${r.dp} pp${r.pp} tp${r.tp}`));
  const state = { ranks: new Set(), steps: [] };
  const redraws = [];
  const PHASE_COLOURS = ["#8e6cbf", "#3b7dd8", "#e0a32e", "#7aa95c", "#d0463c"];
  const WIDTH = () => Math.max(480, Math.min(1200, root.clientWidth - 24));

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "text") node.textContent = value;
      else if (key.startsWith("data-")) node.setAttribute(key, value);
      else node[key] = value;
    }
    for (const child of children) if (child !== null && child !== undefined) node.append(child);
    return node;
  }
  function fmt(value, unit) {
    if (value === null || value === undefined) return "–";
    if (unit === "bytes") return (value / 2 ** 30).toFixed(2) + " GiB";
    if (unit === "s") return value >= 1 ? value.toFixed(3) + " s" : (value * 1e3).toPrecision(3) + " ms";
    if (unit === "%") return (value * 100).toFixed(1) + " %";
    return Math.abs(value) >= 1e4 || (value !== 0 && Math.abs(value) < 1e-3) ? value.toExponential(3) : String(+value.toPrecision(4));
  }
  function median(values) {
    const v = values.filter((x) => x !== null && Number.isFinite(x)).sort((a, b) => a - b);
    if (!v.length) return null;
    const mid = v.length >> 1;
    return v.length % 2 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
  }
  function argmax(values) {
    let best = -1;
    values.forEach((v, i) => { if (v !== null && (best < 0 || v > values[best])) best = i; });
    return best;
  }
  function section(id, title, note) {
    const body = el("div", { className: "body" });
    const node = el("section", { id: "view-" + id, className: "view" }, el("h2", { text: title }),
      note ? el("p", { className: "note", text: note }) : null, body);
    root.append(node);
    return body;
  }
  function canvas(width, height) {
    const c = el("canvas", { className: "chart" });
    const ratio = window.devicePixelRatio || 1;
    c.width = width * ratio; c.height = height * ratio;
    c.style.width = width + "px"; c.style.height = height + "px";
    const ctx = c.getContext("2d");
    ctx.scale(ratio, ratio);
    return [c, ctx];
  }
  function marks(node, count) { node.setAttribute("data-marks", String(count)); }

  // -- summary, findings, what is missing ------------------------------------------------------------------------
  const bySeverity = {};
  for (const f of data.findings) bySeverity[f.severity] = (bySeverity[f.severity] || 0) + 1;
  document.getElementById("summary").textContent = `${data.ranks.length} rank(s), ` +
    `${data.findings.length} finding(s) (${Object.entries(bySeverity).map(([s, n]) => n + " " + s).join(", ") || "none"})` +
    ` from ${data.sources.join(", ")}; generated ${new Date(data.generated_at * 1000).toISOString()}`;

  const findings = section("findings", "Findings", data.findings.length ? null : "No findings.");
  for (const f of data.findings) {
    const link = el("a", { className: "evidence-link", href: "#view-" + f.view, text: "show the evidence",
      "data-view": f.view, "data-ranks": f.ranks.join(","), "data-steps": f.steps.join(",") });
    link.addEventListener("click", (event) => {
      event.preventDefault();
      state.ranks = new Set(f.ranks);
      state.steps = f.steps;
      for (const redraw of redraws) redraw();
      const target = document.getElementById("view-" + f.view) || document.getElementById("view-ranks");
      target.classList.add("focus");
      target.scrollIntoView();
      history.replaceState(null, "", "#view-" + f.view);
    });
    findings.append(el("article", { className: "finding " + f.severity, "data-code": f.code },
      el("h3", {}, el("span", { className: "code", text: f.code }), " ", el("span", { text: f.title })),
      el("ul", {}, ...f.evidence.map((e) => el("li", { text: e.text }))),
      el("p", {}, el("b", { text: "fix " }), f.fix), el("details", {}, el("summary", { text: "why" }), f.reason),
      el("p", {}, link, f.ranks.length ? ` ranks ${f.ranks.join(", ")}` : "", f.steps.length ? `, steps ${f.steps.join(", ")}` : "")));
  }
  if (data.missing.length || data.notes.length || data.not_run.length) {
    const missing = section("missing", "What this page cannot show");
    missing.append(el("ul", {}, ...data.missing.map((m) => el("li", { text: m }))));
    if (data.notes.length) missing.append(el("details", {}, el("summary", { text: `notes (${data.notes.length})` }),
      el("ul", {}, ...data.notes.map((m) => el("li", { text: m })))));
    if (data.not_run.length) missing.append(el("details", {}, el("summary", { text: `rules not run (${data.not_run.length})` }),
      el("ul", {}, ...data.not_run.map((m) => el("li", { text: m })))));
  }

  // -- hang ------------------------------------------------------------------------------------------------------
  if (data.hang) {
    const body = section("hang", "Hang: who waits for whom",
      "Each stalled rank, the collective it waits in, and the members of its group that are not in that collective.");
    const culprits = new Set(data.hang.culprits);
    const rows = data.hang.waits.map((w) => el("tr", { className: culprits.has(w.rank) ? "culprit" : "", "data-rank": String(w.rank) },
      el("td", { text: "r" + w.rank }), el("td", { text: String(w.step) }), el("td", { text: w.phase }),
      el("td", { text: w.op ? `${w.op} on ${w.group} #${w.seq}` : "–" }),
      el("td", { text: w.waits_for.length ? w.waits_for.map((r) => "r" + r).join(", ") : "–" }),
      el("td", { text: fmt(w.stalled_seconds, "s") }), el("td", { text: w.error || w.stack_top || "–" })));
    const chain = data.hang.waits.filter((w) => w.waits_for.length).map((w) =>
      `r${w.rank} waits in ${w.op} (${w.group} #${w.seq}) for ${w.waits_for.map((r) => "r" + r).join(", ")}`);
    body.append(el("p", { className: "chain", "data-culprits": data.hang.culprits.join(","),
      text: (data.hang.culprits.length ? `named by the findings: ${data.hang.culprits.map((r) => "r" + r).join(", ")}. ` : "") + chain.join("; ") }));
    const table = el("table", { className: "hang" }, el("tr", {}, ...["rank", "last step", "phase", "in collective", "waits for",
      "stalled", "where (stack top or error)"].map((h) => el("th", { text: h }))), ...rows);
    marks(table, rows.length);
    body.append(table);
  }

  // -- heatmap ---------------------------------------------------------------------------------------------------
  if (data.heatmap) {
    const h = data.heatmap;
    const body = section("heatmap", "Step time per rank",
      `Ranks by layout (dp, pp, tp), ${h.of === "steps" ? `steps in columns${h.bin > 1 ? ` of ${h.bin} (the slowest of each kept)` : ""}` : "one column: the window's median"}. ` +
      "Busy time is the step's phases summed: a straggler's is high, its peers' steps are as long as its, waiting.");
    const pick = el("select", { className: "metric" }, el("option", { value: "busy_seconds", text: "busy time" }),
      el("option", { value: "step_seconds", text: "step time" }));
    const holder = el("div");
    body.append(el("label", {}, "show ", pick), holder);
    const draw = () => {
      const values = h[pick.value];
      const width = WIDTH(), rowH = Math.max(1, Math.min(14, Math.floor(640 / values.length)));
      const left = rowH >= 9 ? 140 : 0, top = 18, cols = h.steps.length;
      const cellW = (width - left) / Math.max(1, cols);
      const legendY = top + rowH * values.length + 10;  // the colour scale, under the cells
      const [c, ctx] = canvas(width, legendY + 30);
      const typical = median(values.flat()) || 1;
      let count = 0;
      ctx.font = "10px sans-serif"; ctx.fillStyle = "#333";
      ctx.fillText(`step ${h.steps[0]}`, left, 12);
      if (cols > 1) ctx.fillText(`step ${h.steps[cols - 1]}`, width - 60, 12);
      values.forEach((row, i) => {
        if (left) { ctx.fillStyle = "#333"; ctx.fillText(labels[i], 2, top + i * rowH + rowH - 2); }
        row.forEach((v, j) => {
          if (v === null) return;
          const t = Math.max(0, Math.min(1, (Math.log2(v / typical) + 1) / 3));  // ½x .. 4x the typical cell
          ctx.fillStyle = `hsl(${220 - 220 * t}, 75%, ${35 + 25 * t}%)`;
          ctx.fillRect(left + j * cellW, top + i * rowH, Math.max(1, cellW), rowH);
          count++;
        });
      });
      ctx.lineWidth = 2; ctx.strokeStyle = "#000";
      values.forEach((_, i) => { if (state.ranks.has(ranks[i])) ctx.strokeRect(left + 1, top + i * rowH, width - left - 2, rowH); });
      for (const step of state.steps) {
        const j = h.steps.findIndex((s, k) => step >= s && (k === cols - 1 || step < h.steps[k + 1]));
        if (j >= 0) ctx.strokeRect(left + j * cellW, top, Math.max(2, cellW), rowH * values.length);
      }
      // the legend: the colour of ½x, 1x, 2x and 4x the typical (median) cell, as the cells are coloured
      const legendW = 240, legendX = left;
      for (let x = 0; x < legendW; x++) {
        const t = x / (legendW - 1);
        ctx.fillStyle = `hsl(${220 - 220 * t}, 75%, ${35 + 25 * t}%)`;
        ctx.fillRect(legendX + x, legendY, 1, 10);
      }
      const ticks = ["½×", "1×", "2×", "4×"];
      ctx.fillStyle = "#333";
      ticks.forEach((tick, k) => ctx.fillText(tick, legendX + (legendW - 12) * k / 3, legendY + 22));
      const scale = `× the typical cell, ${fmt(typical, "s")} (the median), on a log scale`;
      ctx.fillText(scale, legendX + legendW + 10, legendY + 9);
      c.setAttribute("data-legend", ticks.join(" ") + " " + scale);
      const top1 = argmax(values.map(median));
      c.setAttribute("data-top-rank", top1 >= 0 ? String(ranks[top1]) : "");
      c.setAttribute("data-highlighted", [...state.ranks].join(","));
      c.addEventListener("mousemove", (e) => {
        const i = Math.floor((e.offsetY - top) / rowH), j = Math.floor((e.offsetX - left) / cellW);
        c.title = i >= 0 && i < values.length && j >= 0 && j < cols ? `${labels[i]}, step ${h.steps[j]}: ${fmt(values[i][j], "s")}` : "";
      });
      marks(c, count);
      holder.replaceChildren(c);
    };
    pick.addEventListener("change", draw);
    redraws.push(draw);
    draw();
  }

  // -- stacked and grouped bars ----------------------------------------------------------------------------------
  function bars(holder, groups, stacks, colours, names, unit, highlighted) {
    // groups: x labels; stacks[k][g]: the k-th segment of group g, stacked.
    const width = WIDTH(), height = 260, left = 64, bottom = 30, top = 24;
    const [c, ctx] = canvas(width, height);
    const totals = groups.map((_, g) => stacks.reduce((sum, s) => sum + (s[g] || 0), 0));
    const peak = Math.max(...totals, 1e-12);
    const slot = (width - left) / groups.length, barW = Math.max(1, slot * 0.8);
    const y = (v) => height - bottom - (v / peak) * (height - bottom - top);
    ctx.font = "10px sans-serif"; ctx.fillStyle = "#333";
    ctx.fillText(fmt(peak, unit), 2, top + 4); ctx.fillText(fmt(0, unit), 2, height - bottom);
    let count = 0;
    groups.forEach((label, g) => {
      let base = 0;
      stacks.forEach((s, k) => {
        const v = s[g];
        if (v === null || v === undefined || v <= 0) return;
        ctx.fillStyle = colours[k];
        ctx.fillRect(left + g * slot, y(base + v), barW, y(base) - y(base + v));
        base += v; count++;
      });
      if (highlighted(g)) { ctx.fillStyle = "#000"; ctx.fillRect(left + g * slot, top - 10, Math.max(2, barW), 6); }
      if (slot >= 28) { ctx.fillStyle = "#333"; ctx.fillText(label, left + g * slot, height - bottom + 12); }
    });
    names.forEach((name, k) => { ctx.fillStyle = colours[k]; ctx.fillRect(left + k * 130, height - 12, 10, 10);
      ctx.fillStyle = "#333"; ctx.fillText(name, left + k * 130 + 14, height - 3); });
    marks(c, count);
    holder.replaceChildren(c);
    return c;
  }

  if (data.phases) {
    const p = data.phases;
    const body = section("phases", "Phases of each rank's step",
      "Median seconds per phase over the steps, stacked, one bar a rank in layout order; the mark above a bar is a finding's rank.");
    const holder = el("div");
    body.append(holder);
    const draw = () => {
      const c = bars(holder, labels, p.values, PHASE_COLOURS, p.phases, "s", (g) => state.ranks.has(ranks[g]));
      const compute = p.values[p.phases.indexOf("compute")] || [];
      const busy = ranks.map((_, g) => p.values.slice(0, -1).reduce((sum, s) => sum + (s[g] || 0), 0));
      c.setAttribute("data-top-rank", String(ranks[argmax(busy)]));
      c.setAttribute("data-top-compute-rank", compute.length ? String(ranks[argmax(compute)]) : "");
    };
    redraws.push(draw);
    draw();
  }

  if (data.bubble) {
    const b = data.bubble;
    const body = section("bubble", "Pipeline bubble per stage",
      "The idle share of each stage's step, measured (median over its ranks' steps) against its schedule's theory" +
      (b.planned !== null ? " and the plan's prediction." : "."));
    const holder = el("div");
    body.append(holder);
    const stageRanks = b.stages.map((s) => data.ranks.filter((r) => r.pp === s).map((r) => r.rank));
    const draw = () => {
      const series = [b.measured, b.theoretical], names = ["measured", "theory"];
      if (b.planned !== null) { series.push(b.stages.map(() => b.planned)); names.push("plan"); }
      // grouped, not stacked: one group per stage and series, each its own bar
      const groups = [], stacks = series.map(() => []);
      b.stages.forEach((s, i) => series.forEach((values, k) => {
        groups.push(k === 0 ? "stage " + s : "");
        stacks.forEach((stack, m) => stack.push(m === k ? values[i] : null));
      }));
      const c = bars(holder, groups, stacks, ["#d0463c", "#3b7dd8", "#7aa95c"], names, "%",
        (g) => stageRanks[Math.floor(g / series.length)].some((r) => state.ranks.has(r)));
      const worst = argmax(b.measured);
      c.setAttribute("data-worst-stage", worst >= 0 ? String(b.stages[worst]) : "");
      c.setAttribute("data-worst-ranks", worst >= 0 ? stageRanks[worst].join(",") : "");
    };
    redraws.push(draw);
    draw();
  }

  // -- uPlot: collectives and curves -----------------------------------------------------------------------------
  function plot(holder, title, xs, series, opts) {
    const drawn = series.reduce((n, s) => n + s.values.filter((v) => v !== null).length, 0);
    if (!drawn) { holder.append(el("p", { className: "note", text: `${title}: nothing reported` })); return; }
    const wrap = el("div", { className: "plot", "data-title": title });
    holder.append(wrap);
    const stepLines = (u) => {
      const ctx = u.ctx;
      ctx.save(); ctx.strokeStyle = "#000"; ctx.lineWidth = 2;
      for (const step of state.steps) {
        const x = u.valToPos(step, "x", true);
        ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
      }
      ctx.restore();
      marks(wrap, drawn);
    };
    const u = new uPlot({
      title, width: WIDTH(), height: 220,
      scales: { x: { time: false }, y: opts.yFromZero ? { range: (u, min, max) => [0, max * 1.1 || 1] } : {} },
      series: [{ label: opts.xLabel || "step" }, ...series.map((s) => ({ label: s.label, stroke: s.colour,
        width: s.dash ? 1 : 1.5, dash: s.dash, points: { show: xs.length <= 60 }, paths: s.paths,
        fill: s.fill, value: (_, v) => fmt(v, opts.unit) }))],
      axes: [{ values: opts.xValues, ...opts.xAxis }, { values: (_, ticks) => ticks.map((t) => fmt(t, opts.unit)), size: 70 }],
      hooks: { draw: [stepLines] },
    }, [xs, ...series.map((s) => s.values)], wrap);
    redraws.push(() => u.redraw());
  }

  const bucketPlot = (body, title, bounds, buckets, label) => {
    const names = bounds.map((b) => (b === null ? "+Inf" : fmt(b, "s")));
    plot(body, title, buckets.map((_, i) => i),
      [{ label, values: buckets.map((n) => (n ? n : null)), colour: "#3b7dd8", fill: "#3b7dd855",
        paths: uPlot.paths.bars({ size: [0.8, 40] }) }],
      // whole buckets only, at least 72 px apart: a bucket's bound ("250 µs", "+Inf") is wider than the default spacing
      { xLabel: "≤ seconds", xValues: (_, ticks) => ticks.map((t) => (Number.isInteger(t) ? names[t] || "" : "")),
        xAxis: { space: 72, incrs: [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32] }, yFromZero: true });
  };
  if (data.collectives.length || data.groups.length) {
    const body = section("collectives", "Collectives: waits per process group, latency per op",
      "Per process group (the hello's names): the seconds each rank waited on the group's calls in a step, counted per bucket " +
      "over every rank's steps; skew is the most-waiting rank's median over the median rank's, and the rank that waits least " +
      "is the one the others wait for. Per op: calls per latency bucket, summed over the ranks; skew is the slowest rank's " +
      "mean latency over the median rank's.");
    for (const g of data.groups) {
      body.append(el("p", { className: "skew", "data-group": g.group, text: `group ${g.group}: skew ${g.skew === null ? "–" : g.skew.toFixed(2) + "x"}` +
        (g.most_waiting_rank !== null ? `, most waiting r${g.most_waiting_rank}, least waiting r${g.least_waiting_rank}` : "") }));
      bucketPlot(body, `group ${g.group}: rank-steps per waited time`, g.bucket_bounds, g.buckets, "rank-steps");
    }
    for (const op of data.collectives) {
      body.append(el("p", { className: "skew", "data-op": op.op, text: `${op.op}: skew ${op.skew === null ? "–" : op.skew.toFixed(2) + "x"}` +
        (op.slowest_rank !== null ? `, slowest rank r${op.slowest_rank}` : "") }));
      bucketPlot(body, `${op.op}: calls per latency bucket`, op.bucket_bounds, op.buckets, "calls");
    }
  }

  if (data.curves.length) {
    const body = section("curves", "Over the steps",
      "Across the ranks that report each value: the median rank (line) between the lowest and highest; a dashed line is the plan's prediction.");
    for (const cv of data.curves) {
      const series = [{ label: "median", values: cv.median, colour: "#3b7dd8" },
        { label: "lowest", values: cv.low, colour: "#99a", dash: [2, 3] },
        { label: "highest", values: cv.high, colour: "#c66", dash: [2, 3] }];
      if (cv.planned !== null) series.push({ label: "plan", values: cv.steps.map(() => cv.planned), colour: "#2a2", dash: [8, 4] });
      plot(cv.name === "memory peak" ? memoryBody() : body, cv.name, cv.steps, series, { unit: cv.unit });
    }
  }
  function memoryBody() {
    return document.querySelector("#view-memory .body") || section("memory", "Memory", "Each step's peak memory reading, across the ranks.");
  }

  // -- every rank ------------------------------------------------------------------------------------------------
  const table = el("table", { className: "ranks" }, el("tr", {}, ...["rank", "dp", "pp", "tp", "node"].map((h) => el("th", { text: h }))),
    ...data.ranks.map((r) => el("tr", { "data-rank": String(r.rank) }, ...[r.rank, r.dp, r.pp, r.tp, r.node].map((v) => el("td", { text: v === null ? "–" : String(v) })))));
  marks(table, data.ranks.length);
  section("ranks", "Ranks", `Every rank of job ${data.job}, in layout order.`).append(table);
  redraws.push(() => table.querySelectorAll("tr[data-rank]").forEach((tr) => tr.classList.toggle("hit", state.ranks.has(+tr.dataset.rank))));
  document.body.setAttribute("data-ready", "1");
})();
