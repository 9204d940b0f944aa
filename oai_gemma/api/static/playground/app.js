// The playground page: a conversation with this server's model, streamed token by token, with the timing of
// every answer. State is the `history` array (the messages an SDK call would send, system prompt aside).

import { ApiError, apiKey, listModels, streamChat } from "./api.js";
import { escapeHtml, renderMarkdown } from "./markdown.js";
import { Timing, drawTiming, timingPanel } from "./timing.js";

const $ = (id) => document.getElementById(id);
const MAX_IMAGE_BYTES = 20 * 1024 * 1024;
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "seed", "format", "schema", "extra", "compare"];

const history = []; // {role, content}: content a string, or text and image_url parts
let model = null;
let attachments = []; // data: URLs of the images for the next message
let running = null; // {controller} while an answer streams
let retry = null; // what to do once the user has given an API key
let keyNeeded = false; // the server answered 401 without a key (a server without keys answers 200)

// ---- settings -> request ----------------------------------------------------------------------------------

function number(id) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

function parseJson(id, what) {
  const raw = $(id).value.trim();
  if (!raw) return undefined;
  try { return JSON.parse(raw); } catch (e) { throw new Error(`${what} is not valid JSON: ${e.message}`); }
}

/** The parameters of the request (everything but the messages and the streaming switches). */
function parameters() {
  const params = { model, temperature: number("temperature"), top_p: number("top_p"), max_tokens: number("max_tokens"), seed: number("seed") };
  const format = $("format").value;
  if (format === "json_object") params.response_format = { type: "json_object" };
  if (format === "json_schema") {
    const schema = parseJson("schema", "The JSON schema");
    if (!schema) throw new Error("Write a JSON schema, or choose another response format.");
    params.response_format = { type: "json_schema", json_schema: { name: "playground", schema, strict: true } };
  }
  const extra = parseJson("extra", "More parameters");
  if (extra !== undefined && (typeof extra !== "object" || Array.isArray(extra) || extra === null)) {
    throw new Error("More parameters must be a JSON object.");
  }
  for (const key of Object.keys(params)) if (params[key] === undefined || Number.isNaN(params[key])) delete params[key];
  return { ...params, ...extra };
}

/** Settings B of the compare mode: merged over the parameters for the second answer. */
function compareParameters() {
  const b = parseJson("compare", "Compare settings B");
  if (typeof b !== "object" || Array.isArray(b) || b === null) throw new Error("Compare settings B must be a JSON object.");
  return b;
}

const comparing = () => $("compare-mode").getAttribute("aria-pressed") === "true";

function messages() {
  const system = $("system").value.trim();
  return system ? [{ role: "system", content: system }, ...history] : [...history];
}

/** What the export writes: a request body an SDK call (or curl) can send as it is. */
function exported() {
  let params = {};
  try { params = parameters(); } catch { /* an invalid schema field is left out */ }
  return { ...params, model, messages: messages() };
}

// ---- rendering --------------------------------------------------------------------------------------------

function textOf(content) {
  return typeof content === "string" ? content : content.filter((p) => p.type === "text").map((p) => p.text).join("\n");
}

function addMessage(role, content, parent = $("messages")) {
  const item = document.createElement("article");
  item.className = `msg ${role}`;
  item.setAttribute("aria-label", role === "user" ? "You" : "Assistant");
  const body = document.createElement("div");
  body.className = "content";
  if (role === "user") {
    body.innerHTML = `<p class="plain">${escapeHtml(textOf(content))}</p>`;
    for (const part of typeof content === "string" ? [] : content) {
      if (part.type !== "image_url") continue;
      const img = document.createElement("img");
      img.src = part.image_url.url;
      img.alt = "attached image";
      img.className = "thumb";
      body.append(img);
    }
  }
  item.append(body);
  parent.append(item);
  item.scrollIntoView({ block: "end" });
  return item;
}

function addAnswerTools(item, getText) {
  const bar = document.createElement("div");
  bar.className = "tools";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", "Copy answer");
  copy.addEventListener("click", () => copyText(getText(), copy));
  const status = document.createElement("span");
  status.className = "finish muted";
  bar.append(copy, status);
  item.append(bar);
  return status;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = Object.assign(document.createElement("textarea"), { value: text });
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const label = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = label; }, 1200);
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

function setRunning(state) {
  running = state;
  $("send").hidden = !!state;
  $("stop").hidden = !state;
  $("regenerate").disabled = !!state || !history.some((m) => m.role === "assistant");
  if (!state) $("prompt").focus();
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  attachments.forEach((image, i) => {
    const wrap = document.createElement("span");
    wrap.className = "attachment";
    const img = Object.assign(document.createElement("img"), { src: image.url, alt: image.name, className: "thumb" });
    const remove = Object.assign(document.createElement("button"), { type: "button", textContent: "×" });
    remove.setAttribute("aria-label", `Remove image ${image.name}`);
    remove.addEventListener("click", () => { attachments.splice(i, 1); renderAttachments(); });
    wrap.append(img, remove);
    box.append(wrap);
  });
}

// ---- one answer -------------------------------------------------------------------------------------------

/** Streams the answer to `body` into a new assistant message in `parent`; resolves to {item, text, error}. */
async function streamInto(body, signal, parent, label) {
  const item = addMessage("assistant", "", parent);
  if (label) item.prepend(Object.assign(document.createElement("div"), { className: "variant muted", textContent: label }));
  const content = item.querySelector(".content");
  const panel = timingPanel();
  item.append(panel);
  let text = "";
  const status = addAnswerTools(item, () => text);
  const timing = new Timing();
  let dirty = false;
  let finish = null;
  let error = null;
  const draw = () => {
    if (!dirty) return;
    dirty = false;
    const box = $("messages");
    const following = box.scrollHeight - box.scrollTop - box.clientHeight < 80; // the reader is at the bottom
    content.innerHTML = renderMarkdown(text);
    drawTiming(panel, timing);
    if (following) box.scrollTop = box.scrollHeight;
  };
  const schedule = () => { if (!dirty) { dirty = true; requestAnimationFrame(draw); } };
  try {
    await streamChat(body, signal, (chunk) => {
      if (chunk.usage) timing.usage = chunk.usage;
      const choice = chunk.choices[0];
      if (choice) {
        const piece = choice.delta?.content || "";
        const tokens = choice.logprobs?.content?.map((t) => t.token) ?? (piece ? [piece] : []);
        if (tokens.length) timing.add(tokens);
        text += piece;
        finish = choice.finish_reason || finish;
      }
      schedule();
    });
    status.textContent = finish === "length" ? "stopped: max tokens reached" : "";
  } catch (e) {
    if (e.name === "AbortError") status.textContent = "stopped";
    else error = e;
  }
  dirty = true;
  draw();
  return { item, text, error };
}

/** Answers the current history: one answer, or in compare mode two side by side (A: the settings, B: them with
 * settings B merged over), each with its own timing. The conversation goes on with A's answer. */
async function answer() {
  let bodies;
  try {
    const body = { ...parameters(), messages: messages(), stream: true, stream_options: { include_usage: true }, logprobs: true };
    bodies = comparing() ? [body, { ...body, ...compareParameters() }] : [body];
  } catch (e) {
    showError(e.message);
    return false;
  }
  showError("");
  let parent = $("messages");
  const labels = [null];
  if (bodies.length > 1) {
    parent = Object.assign(document.createElement("div"), { className: "pair" });
    $("messages").append(parent);
    labels.splice(0, 1, "A: the settings", `B: ${$("compare").value.trim()}`);
  }
  const controller = new AbortController();
  setRunning({ controller });
  let results;
  try {
    results = await Promise.all(bodies.map((body, i) => streamInto(body, controller.signal, parent, labels[i])));
  } finally {
    setRunning(null);
  }
  results.forEach((r) => { r.item.dataset.done = "true"; });
  const [first, ...others] = results;
  others.forEach((r) => { if (r.error) r.item.querySelector(".finish").textContent = `failed: ${r.error.message}`; });
  if (first.error) {
    failed(first.error, (first.text || parent === $("messages")) ? first.item : parent, first.text);
    return false;
  }
  if (!first.item.isConnected) return false; // "New chat" ended it: the answer belongs to no conversation
  history.push({ role: "assistant", content: first.text });
  $("regenerate").disabled = false;
  return true;
}

/** An answer that failed: nothing of it is kept; the user's last message goes back to the composer. */
function failed(error, item, partial) {
  if (partial) {
    item.querySelector(".finish").textContent = "failed";
    history.push({ role: "assistant", content: partial });
  } else {
    item.remove();
  }
  const last = history[history.length - 1];
  if (!partial && last?.role === "user") {
    history.pop();
    $("messages").lastElementChild?.remove();
    $("prompt").value = textOf(last.content);
    if (typeof last.content !== "string") {
      attachments = last.content.filter((p) => p.type === "image_url").map((p, i) => ({ url: p.image_url.url, name: `image ${i + 1}` }));
      renderAttachments();
    }
  }
  if (error instanceof ApiError && error.status === 401) {
    askForKey(error, () => send());
    return;
  }
  const where = error instanceof ApiError ? `The server answered ${error.status}${error.code ? ` (${error.code})` : ""}: ` : "";
  showError(`${where}${error.message}`);
}

// ---- actions ----------------------------------------------------------------------------------------------

async function send() {
  if (running) return;
  const text = $("prompt").value;
  if (!text.trim() && !attachments.length) return;
  if (!model) await loadModel();
  if (!model) return;
  const content = attachments.length
    ? [...(text.trim() ? [{ type: "text", text }] : []), ...attachments.map((a) => ({ type: "image_url", image_url: { url: a.url } }))]
    : text;
  history.push({ role: "user", content });
  addMessage("user", content);
  $("prompt").value = "";
  attachments = [];
  renderAttachments();
  await answer();
}

async function regenerate() {
  if (running || history[history.length - 1]?.role !== "assistant") return;
  history.pop();
  $("messages").lastElementChild.remove();
  await answer();
}

function askForKey(error, then) {
  retry = then;
  $("key-message").textContent =
    `This server needs an API key (${error.status}: ${error.message}). ` +
    "Enter it below; it is kept in this browser's local storage and sent with every request.";
  $("key-form").hidden = false;
  $("api-key").focus();
}

/** The key notice only where keys matter: a key is stored, or the server asked for one. */
function showKeyState() {
  $("key-state").textContent = apiKey.get() ? "API key stored in this browser" : "No API key stored";
  $("forget-key").hidden = !apiKey.get();
  $("key-row").hidden = !apiKey.get() && !keyNeeded;
}

async function loadModel() {
  try {
    const models = await listModels();
    model = models[0].id;
    $("model").textContent = model;
    showModelPicker(models);
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) {
      keyNeeded = true;
      showKeyState();
      askForKey(e, loadModel);
    }
    else showError(`Could not read the model list: ${e.message}`);
  }
}

/** A picker when the server serves LoRA adapters beside its model (each card with a `parent`). */
function showModelPicker(models) {
  const picker = $("model-picker");
  picker.hidden = models.length < 2;
  if (picker.hidden) return;
  picker.replaceChildren(...models.map((m) => new Option(m.parent ? `${m.id} (adapter of ${m.parent})` : m.id, m.id)));
  picker.value = model;
  picker.onchange = () => { model = picker.value; $("model").textContent = model; };
}

function addImages(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) { showError(`${file.name || "That file"} is not an image.`); continue; }
    if (file.size > MAX_IMAGE_BYTES) { showError(`${file.name} is larger than 20 MB.`); continue; }
    const reader = new FileReader();
    reader.onload = () => { attachments.push({ url: reader.result, name: file.name || "pasted image" }); renderAttachments(); };
    reader.readAsDataURL(file);
  }
}

function download(name, text) {
  const link = Object.assign(document.createElement("a"), {
    href: URL.createObjectURL(new Blob([text], { type: "application/json" })), download: name,
  });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

/** Loads an exported conversation (the Export JSON file): its system prompt, parameters and messages. */
function importConversation(data) {
  if (!Array.isArray(data?.messages)) throw new Error("This file has no `messages` array: not an exported conversation.");
  const { messages: all, model: _model, temperature, top_p, max_tokens, seed, response_format, ...extra } = data;
  if (running) running.controller.abort();
  $("system").value = all.filter((m) => m.role === "system").map((m) => textOf(m.content)).join("\n\n");
  for (const [id, value] of Object.entries({ temperature, top_p, max_tokens, seed })) $(id).value = value ?? "";
  $("format").value = response_format?.type ?? "text";
  if (response_format?.type === "json_schema") $("schema").value = JSON.stringify(response_format.json_schema.schema);
  $("schema-box").hidden = $("format").value !== "json_schema";
  $("extra").value = Object.keys(extra).length ? JSON.stringify(extra) : "";
  saveSettings();
  history.length = 0;
  $("messages").replaceChildren();
  for (const message of all.filter((m) => m.role !== "system")) {
    history.push(message);
    const item = addMessage(message.role, message.content ?? "");
    if (message.role !== "user") item.querySelector(".content").innerHTML = renderMarkdown(textOf(message.content ?? ""));
  }
  showError("");
  setRunning(null);
}

// ---- wiring -----------------------------------------------------------------------------------------------

function saveSettings() {
  localStorage.setItem("oai-gemma.settings", JSON.stringify(Object.fromEntries(SETTINGS.map((id) => [id, $(id).value]))));
}

function restoreSettings() {
  const saved = JSON.parse(localStorage.getItem("oai-gemma.settings") || "{}");
  for (const id of SETTINGS) if (id in saved) $(id).value = saved[id];
  $("schema-box").hidden = $("format").value !== "json_schema";
  for (const id of SETTINGS) $(id).addEventListener("change", saveSettings);
  if (matchMedia("(max-width: 760px)").matches) $("settings-panel").open = false;
}

$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
$("prompt").addEventListener("paste", (e) => {
  const files = [...(e.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
  if (files.length) { e.preventDefault(); addImages(files); }
});
$("composer").addEventListener("dragover", (e) => e.preventDefault());
$("composer").addEventListener("drop", (e) => { e.preventDefault(); addImages(e.dataTransfer.files); });
$("attach").addEventListener("click", () => $("image").click());
$("image").addEventListener("change", (e) => { addImages(e.target.files); e.target.value = ""; });
$("stop").addEventListener("click", () => running?.controller.abort());
document.addEventListener("keydown", (e) => { if (e.key === "Escape" && running) running.controller.abort(); });
$("regenerate").addEventListener("click", regenerate);
$("format").addEventListener("change", () => { $("schema-box").hidden = $("format").value !== "json_schema"; });
$("export").addEventListener("click", () => download("conversation.json", JSON.stringify(exported(), null, 2)));
$("import").addEventListener("click", () => $("import-file").click());
$("import-file").addEventListener("change", async (e) => {
  const [file] = e.target.files;
  e.target.value = "";
  if (!file) return;
  try { importConversation(JSON.parse(await file.text())); } catch (err) { showError(`Could not import ${file.name}: ${err.message}`); }
});
$("compare-mode").addEventListener("click", () => {
  const on = !comparing();
  $("compare-mode").setAttribute("aria-pressed", String(on));
  $("compare-box").hidden = !on;
  if (on) $("settings-panel").open = true;
});
$("clear").addEventListener("click", () => {
  if (running) running.controller.abort();
  history.length = 0;
  $("messages").replaceChildren();
  showError("");
  setRunning(null);
});
$("messages").addEventListener("click", (e) => {
  const button = e.target.closest(".copy-code");
  if (button) copyText(button.parentElement.querySelector("code").textContent, button);
});
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  apiKey.set($("api-key").value.trim());
  $("api-key").value = "";
  $("key-form").hidden = true;
  showKeyState();
  const then = retry;
  retry = null;
  if (!model) loadModel().then(() => model && then !== loadModel && then?.());
  else then?.();
});
$("forget-key").addEventListener("click", () => { apiKey.forget(); showKeyState(); });

restoreSettings();
showKeyState();
loadModel();
$("prompt").focus();
