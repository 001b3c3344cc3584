// The review page's keyboard and selection: plain JavaScript, served by the page (no CDN, no build step).
// Every decision is a JSON POST naming where the page saw each image; a refusal comes back as {"error": "..."}.
(() => {
  "use strict";
  const data = JSON.parse(document.getElementById("review-data").textContent);
  const grid = document.getElementById("grid");
  const message = document.getElementById("message");
  const keyOf = {};
  for (const c of data.classes) if (c.key) keyOf[c.key] = c.name;
  const selected = new Set();
  let focus = 0;
  let anchor = 0;

  const cards = () => Array.from(grid.querySelectorAll(".card"));

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = text;
    if (cls) node.className = cls;
    return node;
  }

  function say(text, ok) {
    message.textContent = text;
    message.className = ok ? "ok" : "error";
  }

  async function post(url, body) {
    const response = await fetch(url, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body || {}),
    });
    let answer;
    try {
      answer = await response.json();
    } catch (err) {
      answer = { error: `${response.status} ${response.statusText}` };
    }
    if (!response.ok) throw new Error(answer.error || `${response.status}`);
    return answer;
  }

  // After a reload (undo, fix, new class, take-in) the page says what happened and keeps its place.
  function reloadWith(flash) {
    sessionStorage.setItem("review-flash", JSON.stringify(flash));
    const list = cards();
    if (list[focus]) sessionStorage.setItem("review-focus", list[focus].dataset.id);
    location.reload();
  }

  function render() {
    cards().forEach((card, i) => {
      card.classList.toggle("focused", i === focus);
      card.classList.toggle("selected", selected.has(card));
    });
  }

  function setFocus(i, extend) {
    const list = cards();
    if (!list.length) return;
    focus = Math.max(0, Math.min(list.length - 1, i));
    selected.clear();
    if (extend) {
      const [lo, hi] = [Math.min(anchor, focus), Math.max(anchor, focus)];
      for (let j = lo; j <= hi; j++) selected.add(list[j]);
    } else {
      anchor = focus;
      selected.add(list[focus]);
    }
    list[focus].scrollIntoView({ block: "nearest" });
    render();
  }

  function targets() {
    const list = cards();
    const chosen = list.filter((card) => selected.has(card));
    return chosen.length ? chosen : list[focus] ? [list[focus]] : [];
  }

  const refs = (chosen) => chosen.map((card) => ({ id: card.dataset.id, folder: card.dataset.folder }));

  function columns() {
    const list = cards();
    if (!list.length) return 1;
    let n = 0;
    for (const card of list) {
      if (card.offsetTop !== list[0].offsetTop) break;
      n++;
    }
    return Math.max(n, 1);
  }

  function advance(chosen) {
    const list = cards();
    const last = Math.max(...chosen.map((card) => list.indexOf(card)));
    setFocus(last + 1 < list.length ? last + 1 : last, false);
  }

  async function label(to) {
    const chosen = targets();
    if (!chosen.length) return say("no image to label", false);
    try {
      const answer = await post("api/label", { items: refs(chosen), to });
      answer.entries.forEach((entry, i) => {
        const card = chosen[i];
        card.dataset.folder = entry.to;
        card.querySelector(".folder-name").textContent = entry.to;
        card.querySelector(".decided-by").textContent = `✓ ${entry.who}`;
        card.classList.add("decided");
      });
      const where = to === null ? "the model's guess" : to;
      say(`${answer.entries.length} image(s) filed under ${where}`, true);
      advance(chosen);
    } catch (err) {
      say(err.message, false);
    }
  }

  async function discard() {
    const chosen = targets();
    if (!chosen.length) return say("no image to discard", false);
    try {
      const answer = await post("api/discard", { items: refs(chosen) });
      const first = cards().indexOf(chosen[0]);
      chosen.forEach((card) => card.remove());
      say(`${answer.entries.length} image(s) discarded (kept in ${answer.entries[0].to}/; u undoes)`, true);
      setFocus(first, false);
    } catch (err) {
      say(err.message, false);
    }
  }

  async function undo() {
    try {
      const answer = await post("api/undo", {});
      const first = answer.entries[0];
      const back = [...new Set(answer.entries.map((e) => e.to))].join(", ");  // a range can come from several
      reloadWith({ text: `undone: ${first.undid} of ${answer.entries.length} image(s), back in ${back}`, ok: true });
    } catch (err) {
      say(err.message, false);
    }
  }

  async function fix() {
    const chosen = targets();
    if (!chosen.length) return say("no candidate selected", false);
    try {
      const answer = await post("api/fix", { items: refs(chosen) });
      reloadWith({ text: `fixed in place: ${answer.moved} file(s) moved in ${answer.dataset}; keep it: ${answer.keep}`, ok: true });
    } catch (err) {
      say(err.message, false);
    }
  }

  function showTakeIn(result) {
    const box = document.getElementById("take-in-result");
    box.replaceChildren();
    box.append(el("p", `Taken in to ${result.dataset}: ${result.added} added, ${result.skipped} skipped`, "status-ok"));
    const splits = el("table");
    for (const [split, n] of Object.entries(result.splits)) {
      const row = el("tr");
      row.append(el("th", split), el("td", n));
      splits.append(row);
    }
    const classes = el("table");
    const head = el("tr");
    head.append(el("th", "class"), el("th", "added"), el("th", "skipped"));
    classes.append(head);
    for (const [name, counts] of Object.entries(result.classes)) {
      const row = el("tr");
      row.append(el("td", name), el("td", counts.added), el("td", counts.skipped));
      classes.append(row);
    }
    box.append(el("h3", "per split"), splits, el("h3", "per class"), classes);
    if (result.classes_new.length) box.append(el("p", `new classes: ${result.classes_new.join(", ")}`, "status-bad"));
    box.append(el("pre", result.said.join("\n")), el("p", "To keep it:"), el("pre", result.keep, "keep"));
    box.scrollIntoView();
  }

  async function takeIn() {
    try {
      const result = await post("api/take-in", {});
      sessionStorage.setItem("review-take-in", JSON.stringify(result));
      reloadWith({ text: `taken in: ${result.added} added, ${result.skipped} skipped`, ok: true });
    } catch (err) {
      say(err.message, false);
      document.getElementById("take-in-result").replaceChildren(el("p", err.message, "status-bad"));
    }
  }

  async function accept(event) {
    event.preventDefault();
    const box = document.getElementById("accept-result");
    box.replaceChildren(el("p", "running promote --accept (it runs the gate again) ..."));
    try {
      const result = await post("api/accept", { reason: document.getElementById("accept-reason").value });
      box.replaceChildren();
      for (const step of result.steps) {
        box.append(el("p", `${step.command}: exit status ${step.status}`, step.status === 0 ? "status-ok" : "status-bad"));
        box.append(el("pre", step.output));
      }
      say(result.ok ? "accepted: the baseline is promoted and the gate ran again" : "accept failed: see below", result.ok);
    } catch (err) {
      box.replaceChildren(el("p", err.message, "status-bad"));
      say(err.message, false);
    }
  }

  async function newClass(event) {
    event.preventDefault();
    const input = document.getElementById("new-class-name");
    try {
      const answer = await post("api/classes", { name: input.value });
      const found = answer.classes.find((c) => c.name === answer.name);
      reloadWith({ text: `class ${answer.name} added${found && found.key ? `: key ${found.key}` : ""}`, ok: true });
    } catch (err) {
      say(err.message, false);
    }
  }

  grid.addEventListener("click", (event) => {
    const card = event.target.closest(".card");
    if (!card) return;
    const list = cards();
    const i = list.indexOf(card);
    if (event.shiftKey) {
      setFocus(i, true);
    } else if (event.ctrlKey || event.metaKey) {
      focus = i;
      anchor = i;
      if (selected.has(card)) selected.delete(card);
      else selected.add(card);
      render();
    } else {
      setFocus(i, false);
    }
  });

  document.addEventListener("keydown", (event) => {
    if (event.target.closest("input, textarea, select")) {
      if (event.key === "Escape") event.target.blur();
      return;
    }
    // Enter or Space on a focused button or link is that control's (Tab to "Take in", Enter): not the guess
    if ((event.key === "Enter" || event.key === " ") && event.target.closest("button, a")) return;
    const moves = { ArrowRight: 1, ArrowLeft: -1, ArrowDown: columns(), ArrowUp: -columns() };
    if (event.key in moves) {
      event.preventDefault();
      setFocus(focus + moves[event.key], event.shiftKey);
    } else if ((event.ctrlKey || event.metaKey) && event.key === "a") {
      event.preventDefault();
      cards().forEach((card) => selected.add(card));
      render();
    } else if (event.ctrlKey || event.metaKey || event.altKey) {
      return;
    } else if (event.key === "Enter") {
      event.preventDefault();
      label(null);
    } else if (event.key === "x") {
      discard();
    } else if (event.key === "u") {
      undo();
    } else if (event.key === "f") {
      fix();
    } else if (event.key === "n") {
      event.preventDefault();
      document.getElementById("new-class-name").focus();
    } else if (event.key === "Escape") {
      setFocus(focus, false);
    } else if (keyOf[event.key] !== undefined) {
      label(keyOf[event.key]);
    }
  });

  for (const button of document.querySelectorAll(".class-key")) {
    button.addEventListener("click", () => label(button.dataset.class));
  }
  document.getElementById("new-class").addEventListener("submit", newClass);
  document.getElementById("take-in-button").addEventListener("click", takeIn);
  document.getElementById("accept-form").addEventListener("submit", accept);

  // Tiny images are drawn with square pixels, not blurred, when scaled up to 256 px.
  function pixelate(img) {
    if (img.naturalWidth && img.naturalWidth < 256 && img.naturalHeight < 256) img.classList.add("small");
  }
  for (const img of grid.querySelectorAll("img")) {
    if (img.complete) pixelate(img);
    else img.addEventListener("load", () => pixelate(img));
  }

  const flash = sessionStorage.getItem("review-flash");
  sessionStorage.removeItem("review-flash");
  if (flash) {
    const { text, ok } = JSON.parse(flash);
    say(text, ok);
  }
  const kept = sessionStorage.getItem("review-focus");
  sessionStorage.removeItem("review-focus");
  const start = cards().findIndex((card) => card.dataset.id === kept);
  if (cards().length) setFocus(start >= 0 ? start : 0, false);
  const taken = sessionStorage.getItem("review-take-in");
  sessionStorage.removeItem("review-take-in");
  if (taken) showTakeIn(JSON.parse(taken));
})();
