"""What crosses the engine's boundary: a request in, a stream of token events out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error", "timeout", "aborted", "invalid_grammar"]
"""`cancelled`: the consumer went away; `timeout`: the request ran past its total or idle limit;
`aborted`: the server ended it (shutting down); `error`: it failed (the event's `error` says why);
`invalid_grammar`: the request's grammar failed on its own part way (llguidance's error: a `$ref` that only
refers to itself, a parser limit), so no valid document could follow."""


def completion_room(max_model_len: int, tokens: int) -> int:
    """How many more tokens fit after `tokens` (a prompt, or a prompt and its output so far): the one rule
    prompt + completion <= max_model_len, read by the API's budget, the engine's admission, a grammar's budget
    and the length stop alike."""
    return max_model_len - tokens


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 means no top-k cut."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends before them and they never appear in the output."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """vLLM's: divides positive logits (multiplies negative ones) of every token seen in prompt or output."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    """Stop tokens are banned until this many tokens were generated."""
    ignore_eos: bool = False
    """Stop tokens do not end the request (max_tokens or a stop string does)."""
    logprobs: int | None = None
    """None: no logprobs; n >= 0: the chosen token's logprob and the n most likely alternatives."""
    prompt_logprobs: int | None = None
    """None: none; n >= 0: each prompt token's logprob given the tokens before it (the model's own
    distribution: no temperature, penalties or bias) and the n most likely alternatives (`echo` with logprobs).
    The prompt is then computed in full (no prefix-cache reuse): its logits are needed at every position."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to generate from, built once (`api/plan.py` for the API) and never changed after."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    """time.perf_counter() when the HTTP request arrived; left 0, `Engine.admit` takes the time of admission."""
    pixel_values: object | None = None
    """[crops, 3, H, W] tensor for the image soft-token blocks of the prompt, in order (multimodal models)."""
    crop_keys: tuple[int, ...] = ()
    """A content hash per crop, so the prefix cache never takes one image's KV for another's."""
    grammar: object | None = None
    """A compiled `engine.grammar.Grammar` the output must follow (structured output), else None."""
    n: int = 1
    """Choices to generate from the one prompt: its prefill runs once, then each choice samples on its own."""
    cache_scope: str = ""
    """The tenant whose cached prompt prefixes the request may share (`engine.prefix_cache_scope`): empty, everyone's."""
    cache_salt: str = ""
    """Within its scope, requests share cached prompt prefixes only with requests of the same salt (vLLM's
    `cache_salt`). Scope, salt and adapter stay separate fields of the cache's key (engine/cache/prefix_hash.py)."""
    adapter: str | None = None
    """The LoRA adapter to run under (its name, a request's `model`), else None: the base model."""
    prediction: tuple[int, ...] = ()
    """Predicted Outputs: the token ids of the text the output is expected to resemble, drafted from as it aligns
    (engine/speculative/prediction.py)."""
    speculative: bool = True
    """False: this request never carries drafts (the `"speculative": false` extension)."""


@dataclass
class TokenEvent:
    """One step of one request: a new token (and the text it completes), and/or the end.

    `text` is already incremental, UTF-8 whole and stop-string safe: concatenating every event's
    text gives the final output exactly.
    """

    request_id: str
    token_id: int | None
    text: str
    timestamp: float
    """time.perf_counter() when the engine produced the token."""
    finish_reason: FinishReason | None = None
    """Set on the last event of a choice (a request with n choices has n last events)."""
    index: int = 0
    """Which of the request's n choices this event belongs to."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    logprob: float | None = None
    """The token's log-probability under the distribution it was sampled from (if asked for)."""
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    """On a choice's first event, when asked for: one entry per prompt token, None for the first (nothing
    precedes it), else (its logprob, [(id, logprob)] of the most likely tokens at that position)."""
    error: str | None = None
    drafted: bool = False
    """The token was a draft the model accepted (speculative decoding): it came without a step of its own."""
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    """Predicted Outputs, on a finishing event: the prediction's tokens that appear in the output, and the rest
    (OpenAI's meaning; engine/speculative/prediction.py `prediction_counts`)."""
    scheduled_time: float | None = field(default=None)
    """On the first event: when the request got a batch slot (queue time = scheduled - arrival)."""
