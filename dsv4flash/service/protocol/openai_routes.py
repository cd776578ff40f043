"""OpenAI-compatible routes of `dsv4flash serve`: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

A front end over the same core as the Tinker routes: the caller's tenant from the same keys (`tenant_of`, which
reads `Authorization: Bearer <key>` as OpenAI clients send it), the model name resolved with the Tinker routes'
tenant rules (`plane/served_models.py`), and every prompt sampled as one `SamplingClient.sample` call admitted to
the tenant's bounded queue (`PolicyServer.submit`), so the decode loop, the scheduler turns and the per-call
deadline are the Tinker `asample`'s. A streamed answer is sent as the decode loop draws each token
(`SamplingClient.sample(on_tokens=…)`), in OpenAI's chunk format, ending with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dsv4flash.service.plane import served_models
from dsv4flash.service.plane.operations import QueueFull
from dsv4flash.service.plane.policy_server import NotFound
from dsv4flash.service.protocol import openai_wire as ow
from dsv4flash.service.protocol.http import answer_of, plane_of, read_body, retry_after_of, tenant_of


def openai_route(handler):
    """Wrap a route so every error is answered in OpenAI's error shape, with the status the Tinker routes give."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except ow.OpenAIError as exc:
            return ow.error_response(exc)
        except Exception as exc:
            answer = answer_of(exc)
            if answer is None:
                raise
            status, message, field, retry = answer
            return ow.error_response(ow.OpenAIError(status, message, field, retry=retry,
                                                    retry_after_s=retry_after_of(exc)))

    route.__name__ = handler.__name__
    return route


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "tagged-union"}


async def parse(request: Request, model):
    """The JSON body as an `openai_wire` request model (400 naming the first bad field)."""
    from pydantic import ValidationError

    raw = await read_body(request)
    try:
        data = json.loads(raw or b"{}")
    except ValueError as exc:
        raise ow.OpenAIError(400, f"body: not JSON ({exc})", "body") from exc
    if not isinstance(data, dict):
        raise ow.OpenAIError(400, f"body: expected a JSON object, got {type(data).__name__}", "body")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        # a union member's tag (`list[int]`, `str`) in the path is no field of the request
        loc = [str(p) for p in first.get("loc", ()) if not ("[" in str(p) or str(p) in _UNION_TAGS)]
        where = ".".join(loc) or "body"
        raise ow.OpenAIError(400, f"{where}: {first.get('msg')}", loc[0] if loc else None) from exc
    bad = ow.unsupported_field(req)
    if bad is not None:
        raise ow.OpenAIError(400, f"{bad}: not supported by this server (leave it out)", bad)
    return req


def tokenizer_of(request: Request):
    """The served Hugging Face tokenizer (its directory's, which Tinker clients load too), loaded once."""
    state = request.app.state
    if getattr(state, "openai_tokenizer", None) is None:
        plane = plane_of(request)
        if plane.tokenizer_dir is not None:
            from transformers import AutoTokenizer

            state.openai_tokenizer = AutoTokenizer.from_pretrained(plane.tokenizer_dir)
        else:  # an in-process PolicyServer with no directory: the same tokenizer, built in memory
            from transformers import PreTrainedTokenizerFast

            from dsv4flash.tasks.text_tokenizer import SETTINGS, build_text_tokenizer

            state.openai_tokenizer = PreTrainedTokenizerFast(
                tokenizer_object=build_text_tokenizer(plane.service.get_tokenizer()), **SETTINGS)
    return state.openai_tokenizer


@dataclass
class Job:
    """One request, checked and bound: its prompts, the sampling client of its model, and how answers read."""

    name: str
    client: object
    prompts: list[list[int]]
    params: object  # core SamplingParams
    n: int
    topk: int | None  # None: no log-probs asked
    spell: ow.TokenText
    stops: list[tuple[int, ...]]
    usage: object = None  # streamed answers: (prompt tokens, completion tokens, adapter loads) -> the usage chunk


def _field_error(exc: ValueError, prompt_field: str, max_tokens_field: str) -> ow.OpenAIError:
    """A core check's ValueError as a 400 naming the request's field."""
    msg = str(exc)
    if msg.startswith("SamplingParams.max_tokens"):
        return ow.OpenAIError(400, max_tokens_field + msg[len("SamplingParams.max_tokens"):], max_tokens_field)
    if msg.startswith("sample: "):  # the prompt's own ids: empty, or one out of the vocabulary
        return ow.OpenAIError(400, f"{prompt_field}: {msg[len('sample: '):]}", prompt_field)
    if msg.startswith("prompt:"):  # prompt plus max_tokens past the context
        return ow.OpenAIError(400, msg if prompt_field == "prompt" else f"{prompt_field}: {msg}", prompt_field)
    if msg.startswith("SamplingParams."):
        field = msg[len("SamplingParams."):].split(":", 1)[0]
        return ow.OpenAIError(400, msg[len("SamplingParams."):], field)
    return ow.OpenAIError(400, msg, None)


async def prepare(request: Request, tenant: str, req, prompts: list[list[int]], *, max_tokens: int | None,
                  max_tokens_field: str, prompt_field: str, topk: int | None, topk_field: str) -> Job:
    """Check a request's values against the model and bind the sampling client of its `model`."""
    from dsv4flash.service.compute.sampling import check_sample_request
    from dsv4flash.service.types import SamplingParams

    plane = plane_of(request)
    if not 1 <= req.n <= ow.MAX_N:
        raise ow.OpenAIError(400, f"n: expected an integer in [1, {ow.MAX_N}], got {req.n}", "n")
    if topk is not None and not 0 <= topk <= ow.MAX_TOP_LOGPROBS:
        raise ow.OpenAIError(400, f"{topk_field}: expected an integer in [0, {ow.MAX_TOP_LOGPROBS}], got {topk}",
                             topk_field)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(max_tokens=max_tokens, seed=req.seed, stop=[*stop, *(req.stop_token_ids or [])],
                            temperature=1.0 if req.temperature is None else float(req.temperature),
                            top_k=-1 if req.top_k is None else int(req.top_k),
                            top_p=1.0 if req.top_p is None else float(req.top_p))
    text = plane.service.base.cfg.text
    try:
        for p in prompts:
            check_sample_request(p, req.n, params, text.vocab_size, text.max_position_embeddings)
        stops = plane.service.stop_sequences(params.stop)
    except ValueError as exc:
        err = _field_error(exc, prompt_field, max_tokens_field)
        if err.param == "stop" and req.stop is None:
            err.param = "stop_token_ids"
        raise err from exc
    try:
        served = await asyncio.to_thread(served_models.resolve, plane, tenant, req.model)
    except NotFound as exc:
        raise ow.OpenAIError(404, str(exc), "model") from exc
    if served.revision is None:
        client = await asyncio.to_thread(plane.path_sampler, tenant, None)
    else:
        client = await asyncio.to_thread(plane.revision_sampler, tenant, served.revision, req.model)
    return Job(req.model, client, prompts, params, req.n, topk,
               ow.TokenText(tokenizer_of(request), req.return_tokens_as_token_ids), stops)


def submit(request: Request, tenant: str, job: Job, on_tokens=None) -> list[str]:
    """Admit one core `sample` call per prompt to the tenant's queue -> their request ids (429 when full: the ones
    already admitted are cancelled, so a refused request leaves nothing running)."""
    from dsv4flash.service.types import ModelInput

    plane = plane_of(request)
    rids: list[str] = []
    try:
        for i, prompt in enumerate(job.prompts):
            sink = None if on_tokens is None else (
                lambda rows, toks, lps, tops, i=i: on_tokens(i, rows, toks, lps, tops))
            rids.append(plane.submit(tenant, "sample", lambda p=prompt, s=sink: job.client.sample(
                ModelInput.from_ints(p), job.n, job.params, topk_sample_logprobs=job.topk or 0, owner=tenant,
                on_tokens=s), lambda result, proto: result))
    except QueueFull as exc:
        for rid in rids:
            plane.ops.cancel(rid, tenant)
            plane.ops.forget(rid, tenant)
        raise ow.OpenAIError(429, str(exc), None) from exc
    return rids


async def results(request: Request, tenant: str, rids: list[str]) -> list:
    """The core SampleResponses of admitted calls, in order (each dropped from the operation table once read)."""
    plane = plane_of(request)
    futures = [asyncio.wrap_future(plane.ops.get(rid, tenant).future) for rid in rids]
    try:
        return list(await asyncio.gather(*futures))
    finally:
        for rid in rids:
            plane.ops.cancel(rid, tenant)  # a no-op once finished; stops the others when one failed
            plane.ops.forget(rid, tenant)


def adapter_loads(responses: list) -> list[dict | None]:
    """Per prompt, how its adapter was had (`{"tier", "wait_ms", "load_ms"}`: resident, cpu, disk or loading, and
    the milliseconds the request waited for it; None for the bare base): the answer's `adapter_load`."""
    from dsv4flash.service.types import load_of

    return [load_of(r) for r in responses]


def answers(job: Job, responses: list) -> list[tuple[ow.ChoiceText, str, list]]:
    """(choice text, finish reason, sampled tokens) of every choice, prompt-major (OpenAI's choice order)."""
    out = []
    for resp in responses:
        for seq in resp.sequences:
            choice = ow.ChoiceText(job.spell, job.stops)
            tops = seq.topk_logprobs if job.topk else None
            choice.push([(t, lp, tops[j] if tops else None) for j, (t, lp) in enumerate(zip(seq.tokens, seq.logprobs))])
            choice.finish(seq.stop_reason == "stop")
            out.append((choice, seq.stop_reason, seq.tokens))
    return out


async def stream(request: Request, tenant: str, job: Job, chunk, first=None):
    """The SSE body of a streamed answer: `chunk(index, delta text, entries, finish reason)` builds each event,
    `first(index)` an opening one; usage last when asked; `[DONE]` at the end. A failure after the answer began
    is sent as an error event (the status line has gone out)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    choices = [ow.ChoiceText(job.spell, job.stops) for _ in range(len(job.prompts) * job.n)]
    rids = submit(request, tenant, job, lambda i, rows, toks, lps, tops: loop.call_soon_threadsafe(
        queue.put_nowait, ("tokens", i, rows, toks, lps, tops)))
    plane = plane_of(request)
    for i, rid in enumerate(rids):
        plane.ops.get(rid, tenant).future.add_done_callback(
            lambda f, i=i: loop.call_soon_threadsafe(queue.put_nowait, ("done", i, f)))

    async def body():
        try:
            if first is not None:
                for index in range(len(choices)):
                    yield ow.sse(first(index))
            left, completion_tokens, loads = len(rids), 0, [None] * len(rids)
            while left:
                event = await queue.get()
                if event[0] == "tokens":
                    _, i, rows, toks, lps, tops = event
                    for j, (row, tok, lp) in enumerate(zip(rows, toks, lps)):
                        index = i * job.n + row
                        prefix = choices[index].released_ids()
                        delta, entries = choices[index].push([(tok, lp, tops[j] if tops else None)])
                        if delta or entries:
                            yield ow.sse(chunk(index, delta, entries, None, prefix))
                    continue
                _, i, fut = event
                left -= 1
                exc = None if fut.cancelled() else fut.exception()
                if fut.cancelled() or exc is not None:
                    status, message, field, _ = answer_of(exc) or (500, f"sampling failed: {exc}", None, None)
                    yield ow.sse(ow.error_body(status, message if exc else "cancelled", field))
                    break
                loads[i] = adapter_loads([fut.result()])[0]
                for row, seq in enumerate(fut.result().sequences):
                    index = i * job.n + row
                    completion_tokens += len(seq.tokens)
                    prefix = choices[index].released_ids()
                    delta, entries = choices[index].finish(seq.stop_reason == "stop")
                    yield ow.sse(chunk(index, delta, entries, seq.stop_reason, prefix))
            else:
                if job.usage:
                    yield ow.sse(job.usage(sum(len(p) for p in job.prompts), completion_tokens, loads))
            yield ow.sse("[DONE]")
        finally:  # the client went away, or the answer is complete: nothing of it keeps running
            for rid in rids:
                plane.ops.cancel(rid, tenant)
                plane.ops.forget(rid, tenant)

    return StreamingResponse(body(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


# ---- routes ----
MODELS_PAGE_LIMIT = 1000  # `/v1/models` rows per page unless `limit` says otherwise (at most this many)


async def list_models(request: Request) -> Response:
    """`GET /v1/models[?limit=N&after=ID]`: one page of the tenant's models; `has_more` and `last_id` page on."""
    tenant = tenant_of(request)
    plane = plane_of(request)
    limit = _page_limit(request.query_params.get("limit"))
    after = request.query_params.get("after") or None
    entries, more = await asyncio.to_thread(served_models.listing, plane, tenant, after=after, limit=limit)
    base = plane.service.base.base_model
    return JSONResponse({"object": "list", "data": [ow.model_entry(e, base) for e in entries], "has_more": more,
                         "first_id": entries[0]["id"] if entries else None,
                         "last_id": entries[-1]["id"] if entries else None})


def _page_limit(raw: str | None) -> int:
    if raw is None:
        return MODELS_PAGE_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MODELS_PAGE_LIMIT:
        raise ow.OpenAIError(400, f"limit: expected an integer from 1 to {MODELS_PAGE_LIMIT}, got {raw!r}", "limit")
    return limit


def _room(request: Request, tenant: str) -> None:
    """429 at once when the tenant's queue is full, before the body is decoded."""
    try:
        plane_of(request).ops.require_room(tenant)
    except QueueFull as exc:
        raise ow.OpenAIError(429, str(exc), None) from exc


def _include_usage(req) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


async def completions(request: Request) -> Response:
    tenant = tenant_of(request)
    _room(request, tenant)
    req = await parse(request, ow.CompletionRequest)
    tok = tokenizer_of(request)
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [tok(prompt)["input_ids"]]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tok(p)["input_ids"] for p in prompt]
    else:
        prompts = [list(p) for p in prompt]
    if not prompts:
        raise ow.OpenAIError(400, "prompt: empty list", "prompt")
    job = await prepare(request, tenant, req, prompts, max_tokens=req.max_tokens, max_tokens_field="max_tokens",
                        prompt_field="prompt", topk=req.logprobs, topk_field="logprobs")
    cid, created = ow.new_id("cmpl"), ow.now()

    def choice(index, text, entries, finish, prefix):
        lp = None if job.topk is None else ow.completion_logprobs(
            job.spell, entries, prefix)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

    def envelope(choices, **extra):
        return {"id": cid, "object": "text_completion", "created": created, "model": job.name, "choices": choices,
                **extra}

    if req.stream:
        job.usage = ((lambda p, c, loads: envelope([], usage=ow.usage(p, c), adapter_load=loads))
                     if _include_usage(req) else None)
        return await stream(request, tenant, job, lambda *a: envelope([choice(*a)]))
    job.usage = None
    responses = await results(request, tenant, submit(request, tenant, job))
    out = answers(job, responses)
    body = envelope([choice(i, c.text, c.entries[:c.sent], reason, []) for i, (c, reason, _) in enumerate(out)],
                    usage=ow.usage(sum(len(p) for p in prompts), sum(len(t) for _, _, t in out)),
                    adapter_load=adapter_loads(responses))
    return JSONResponse(body)


def _chat_prompt(tok, req) -> list[int]:
    """The messages through the served tokenizer's chat template, with the assistant turn opened."""
    messages = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


async def chat_completions(request: Request) -> Response:
    tenant = tenant_of(request)
    _room(request, tenant)
    req = await parse(request, ow.ChatRequest)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise ow.OpenAIError(400, "max_completion_tokens: give it or max_tokens, not both", "max_completion_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise ow.OpenAIError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    prompt = _chat_prompt(tokenizer_of(request), req)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:  # what the context leaves (vLLM's default), at least one token
        max_tokens = max(1, plane_of(request).service.base.cfg.text.max_position_embeddings - len(prompt))
    topk = (req.top_logprobs or 0) if req.logprobs else None
    job = await prepare(request, tenant, req, [prompt], max_tokens=max_tokens, max_tokens_field=field,
                        prompt_field="messages", topk=topk, topk_field="top_logprobs")
    cid, created = ow.new_id("chatcmpl"), ow.now()

    def logprobs(entries):
        return None if job.topk is None else ow.chat_logprobs(
            job.spell, entries)

    def envelope(choices, obj="chat.completion", **extra):
        return {"id": cid, "object": obj, "created": created, "model": job.name, "choices": choices, **extra}

    if req.stream:
        job.usage = ((lambda p, c, loads: envelope([], "chat.completion.chunk", usage=ow.usage(p, c),
                                                   adapter_load=loads))
                     if _include_usage(req) else None)
        return await stream(request, tenant, job, lambda index, text, entries, finish, prefix: envelope(
            [{"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs(entries),
              "finish_reason": finish}], "chat.completion.chunk"),
            first=lambda index: envelope([{"index": index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}], "chat.completion.chunk"))
    job.usage = None
    responses = await results(request, tenant, submit(request, tenant, job))
    out = answers(job, responses)
    body = envelope([{"index": i, "message": {"role": "assistant", "content": c.text},
                      "logprobs": logprobs(c.entries[:c.sent]), "finish_reason": reason}
                     for i, (c, reason, _) in enumerate(out)],
                    usage=ow.usage(len(prompt), sum(len(t) for _, _, t in out)), adapter_load=adapter_loads(responses))
    return JSONResponse(body)


ROUTES = [
    Route("/v1/models", openai_route(list_models), methods=["GET"]),
    Route("/v1/completions", openai_route(completions), methods=["POST"]),
    Route("/v1/chat/completions", openai_route(chat_completions), methods=["POST"]),
]
