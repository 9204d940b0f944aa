"""The tutorials' naive OpenAI-compatible server, kept as a baseline for `oai-gemma bench --compare`.

Faithful to the common recipe: each request starts one `threading.Thread` running `model.generate(...,
streamer=TextIteratorStreamer(...))` and the handler iterates the streamer to send SSE chunks. No batching,
no scheduling: concurrent requests are concurrent `generate` calls sharing the cores.

    python benchmarks/tutorial_server.py --model-dir ~/.cache/oai-gemma/gemma-3-270m --port 8001
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))  # run from a checkout
from oai_gemma.engine.model.loader import pick_dtype
from oai_gemma.settings import ModelSettings

app = FastAPI()
state: dict = {}


@app.get("/health")
def health():
    return JSONResponse({"status": "ok"} if "model" in state else {"status": "loading"},
                        status_code=200 if "model" in state else 503)


@app.get("/v1/models")
def models():
    return {"object": "list", "data": [{"id": state["name"], "object": "model", "created": 0, "owned_by": "local"}]}


def chunk(request_id: str, created: int, delta: dict, finish_reason=None, usage=None) -> str:
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": state["name"],
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


@app.post("/v1/chat/completions")
async def chat_completions(request: dict):
    model, tokenizer = state["model"], state["tokenizer"]
    inputs = tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True).to(model.device)
    prompt_len = inputs["input_ids"].shape[-1]
    temperature = float(request.get("temperature", 1.0))
    gen_kwargs = dict(**inputs, max_new_tokens=request.get("max_tokens") or 256, do_sample=temperature > 0)
    if temperature > 0:
        gen_kwargs.update(temperature=temperature, top_p=float(request.get("top_p", 1.0)))
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    if not request.get("stream"):
        from starlette.concurrency import run_in_threadpool

        output = await run_in_threadpool(model.generate, **gen_kwargs)
        new_tokens = output[0, prompt_len:]
        text = tokenizer.decode(new_tokens, skip_special_tokens=True)
        n = int(new_tokens.shape[-1])
        return {"id": request_id, "object": "chat.completion", "created": created, "model": state["name"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "length" if n >= gen_kwargs["max_new_tokens"] else "stop"}],
                "usage": {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}}

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result: dict = {}

    def generate():
        result["output"] = model.generate(**gen_kwargs, streamer=streamer)

    thread = threading.Thread(target=generate)
    thread.start()
    include_usage = bool((request.get("stream_options") or {}).get("include_usage"))

    def event_stream():  # a sync generator: Starlette iterates it in its thread pool
        yield chunk(request_id, created, {"role": "assistant", "content": ""})
        for text in streamer:
            if text:
                yield chunk(request_id, created, {"content": text})
        thread.join()
        n = int(result["output"].shape[-1] - prompt_len)
        finish = "length" if n >= gen_kwargs["max_new_tokens"] else "stop"
        usage = {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
        yield chunk(request_id, created, {}, finish_reason=finish, usage=usage if include_usage else None)
        yield "data: [DONE]\n\n"

    return StreamingResponse(event_stream(), media_type="text/event-stream")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--name", default="gemma-3-270m", help="the model id served")
    parser.add_argument("--dtype", default="auto", help="default: what oai-gemma serve picks (pick_dtype)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = pick_dtype(ModelSettings(dtype=args.dtype), device)  # the same rule as oai-gemma serve
    state["tokenizer"] = AutoTokenizer.from_pretrained(args.model_dir)
    state["model"] = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(device).eval()
    state["name"] = args.name
    print(f"loaded {args.model_dir} ({dtype}, {device}); serving on {args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
