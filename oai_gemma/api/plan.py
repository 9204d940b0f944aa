"""One generation plan for every wire format, and the one function that turns it into the engine's request.

    chat / completions / Responses Struct --the endpoint fills--> GenerationPlan --generation_request--> GenerationRequest

Chat completions, text completions and the Responses API ask the engine for the same things in three shapes. Each
endpoint fills a `GenerationPlan` from its own Struct, naming its own fields as it goes (`prompt_field`,
`OutputFormat.field`; the tools and the messages carry theirs), so an error names the field the client sent.
Everything after that (the completion budget, the sampling parameters, `n`, the grammar) is decided here, once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..chat import Prompt
from ..chat.tools import ToolPlan
from ..engine.engine import Engine
from ..engine.types import GenerationRequest
from .errors import over_limit
from .protocol import SamplingFields
from .response_format import OutputFormat, request_grammar
from .sampling import choice_count, completion_budget, sampling_params


@dataclass(frozen=True)
class GenerationPlan:
    """What one request asks of the engine, whatever wire format it came in."""

    request_id: str
    prompt: Prompt
    """Token ids, and the images' pixels and cache keys."""
    sampling: SamplingFields
    """The request's own Struct: its sampling fields are declared once for every wire format."""
    arrival: float
    max_tokens: int | None
    """The completion budget asked for (None: `default_max_tokens`, cut to the room left)."""
    default_max_tokens: int
    prompt_field: str
    """The request field that holds the prompt (`messages`, `prompt`, `input`): named when it cannot fit."""
    tools: ToolPlan | None = None
    output_format: OutputFormat | None = None
    logprobs: int | None = None
    """None: no logprobs; k: the chosen token's and the k most likely ones'."""
    prompt_logprobs: int | None = None
    n: int | None = None
    cache_scope: str = ""
    """The tenant whose cached prefixes the request may share (`engine.prefix_cache_scope`): empty, everyone's."""
    adapter: str | None = None
    """The LoRA adapter the request's `model` names, None for the base model."""
    prediction: str = ""
    """Predicted Outputs' text (chat's `prediction.content`), drafted from by speculative decoding."""


async def generation_request(plan: GenerationPlan, engine: Engine, max_model_len: int) -> GenerationRequest:
    """The engine request of a plan (a 400 naming the field at fault otherwise): the same for every endpoint."""
    max_tokens = completion_budget(
        len(plan.prompt.token_ids), plan.max_tokens, plan.default_max_tokens, max_model_len, plan.prompt_field
    )
    sampling = sampling_params(plan.sampling, max_tokens, plan.logprobs, engine.vocab_limit, plan.prompt_logprobs)
    n = choice_count(plan.n, engine.num_slots)
    grammar = await request_grammar(engine, plan.tools, plan.output_format)
    prompt = plan.prompt
    return GenerationRequest(
        plan.request_id, prompt.token_ids, sampling, plan.arrival, pixel_values=prompt.pixel_values,
        crop_keys=prompt.cache_keys, grammar=grammar, n=n, cache_scope=plan.cache_scope,
        cache_salt=plan.sampling.cache_salt or "", adapter=plan.adapter,
        prediction=predicted_tokens(plan.prediction, engine, max_model_len), speculative=plan.sampling.speculative is not False,
    )


def predicted_tokens(text: str, engine: Engine, max_model_len: int) -> tuple[int, ...]:
    """The prediction's token ids; one longer than the context could never be an output (a 400)."""
    if not text:
        return ()
    if len(text) > 8 * max_model_len:  # before tokenizing: no token is more than 8 characters here, nearly
        raise over_limit("prediction", "max_tokens", max_model_len, note=" (`max_model_len`)")
    if len(ids := engine.encode(text)) > max_model_len:
        raise over_limit("prediction", "max_tokens", max_model_len, len(ids), note=" (`max_model_len`)")
    return tuple(ids)
