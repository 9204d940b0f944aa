// Talks to this server's own OpenAI-compatible API: the model list, and a chat completion read as a stream
// of Server-Sent Events (one `data:` JSON chunk per event, `data: [DONE]` at the end).

const KEY = "oai-gemma.api-key";

export const apiKey = {
  get: () => localStorage.getItem(KEY) || "",
  set: (key) => localStorage.setItem(KEY, key),
  forget: () => localStorage.removeItem(KEY),
};

export class ApiError extends Error {
  constructor(status, error) {
    super(error?.message || `HTTP ${status}`);
    this.status = status;
    this.code = error?.code || null;
    this.param = error?.param || null;
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey.get()) h.Authorization = `Bearer ${apiKey.get()}`;
  return h;
}

async function failure(response) {
  let error = null;
  try { error = (await response.json()).error; } catch { /* not the JSON envelope */ }
  return new ApiError(response.status, error);
}

export async function listModels() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) throw await failure(response);
  return (await response.json()).data;
}

/**
 * POST /v1/chat/completions with `stream: true`; calls `onChunk(chunk)` for every chunk as it arrives.
 * Aborting `signal` closes the connection, which cancels the request on the server.
 */
export async function streamChat(body, signal, onChunk) {
  const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(500, chunk.error);
      onChunk(chunk);
    }
  }
}
