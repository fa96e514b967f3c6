"""Unit tests of the gateway's error side: OpenAI error bodies, status mapping, 422 → 400.

Runs the real create_app routes (without its lifespan, so no workers) through Starlette's
in-process TestClient: validation answers before any worker is needed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest
from fastapi import Request
from fastapi.testclient import TestClient

from gateway.app import _respond, create_app
from gateway.config import Config
from gateway.errors import APIError, error_sse_event, from_grpc_code
from gateway.request_mapping import GenerationParams


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(Config()))  # not entered: the lifespan (worker connect) never runs


def assert_openai_error(body: dict, status_type: str = "invalid_request_error") -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == status_type and error["message"]
    return error


def test_validation_errors_are_400_not_422(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                         "temperature": 5})
    assert response.status_code == 400
    error = assert_openai_error(response.json())
    assert error["param"] == "temperature" and "temperature" in error["message"]


def test_missing_field_and_bad_json_are_400(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": "m"})
    assert response.status_code == 400 and assert_openai_error(response.json())["param"] == "prompt"
    for body in (b"{not json", b'{"model": "m", "messages": ['):
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400
        error = assert_openai_error(response.json())
        # OpenAI names no param for a body that is not JSON (pydantic's loc is a byte offset there).
        assert error["param"] is None and "could not parse the JSON body" in error["message"], error


def test_unsupported_parameter_message(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": "m", "prompt": "x", "suffix": "y"})
    assert response.status_code == 400
    assert "suffix (fill-in-the-middle) is not supported" in response.json()["error"]["message"]


CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(("path", "body", "param"), [
    # JSON escapes of lone UTF-16 surrogates: no tokenizer or protobuf string takes them, and one
    # in a stop string used to fail the whole TokenFrame it rode in (every concurrent request's).
    ("/v1/completions", '{"model": "m", "prompt": "x", "stop": ["a", "\\udc00"]}', None),
    ("/v1/completions", '{"model": "m", "prompt": "\\ud800"}', None),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "\\ud83d"}]}', None),
    ("/tokenize", '{"prompt": "\\ud800"}', None),
    # Numbers the int32 wire fields cannot hold, and a digit that int() refuses.
    ("/v1/completions", '{"model": "m", "prompt": "x", "top_k": 1099511627776}', "top_k"),
    ("/v1/completions", '{"model": "m", "prompt": "x", "max_tokens": 1180591620717411303424}', "max_tokens"),
    ("/v1/completions", '{"model": "m", "prompt": [99999999999]}', "prompt"),
    ("/v1/completions", '{"model": "m", "prompt": "x", "allowed_token_ids": [99999999999]}', "allowed_token_ids"),
    ("/v1/completions", '{"model": "m", "prompt": "x", "logit_bias": {"\\u00b2": 1}}', None),
    ("/detokenize", '{"tokens": [99999999999]}', "tokens"),
    # Beam scores divide by length ** length_penalty, which a huge one under- or overflows.
    ("/v1/completions", '{"model": "m", "prompt": "x", "use_beam_search": true, "best_of": 2, "length_penalty": -2000}',
     "length_penalty"),
    # vLLM's rule: prompt logprobs come only in a whole response.
    ("/v1/completions", '{"model": "m", "prompt": "x", "stream": true, "prompt_logprobs": 1}', "prompt_logprobs"),
    # The one float without an upper bound: an overflow to infinity is still refused.
    ("/v1/completions", '{"model": "m", "prompt": "x", "use_beam_search": true, "best_of": 2, '
                        '"diversity_penalty": 1e999}', "diversity_penalty"),
    ("/v1/completions", '{"model": "m", "prompt": "x", "logit_bias": {"99999999999": 1}}', "logit_bias"),
    # Echo's logprobs are the prompt's, which a beam search does not compute (it was refused under
    # prompt_logprobs, a field the body did not have).
    ("/v1/completions", '{"model": "m", "prompt": "x", "use_beam_search": true, "best_of": 2, "echo": true, '
                        '"logprobs": 1}', "echo"),
])
def test_bad_text_and_out_of_range_numbers_are_400(client: TestClient, path: str, body: str, param: str | None) -> None:
    response = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = assert_openai_error(response.json())
    if param is not None:
        assert error["param"] == param


def test_null_takes_the_default_where_a_field_is_not_nullable() -> None:
    from gateway.openai_requests import ChatCompletionRequest, CompletionRequest

    nulls = dict.fromkeys(("n", "stream", "presence_penalty", "frequency_penalty", "echo", "typical_p", "ignore_eos"))
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": None, **nulls})
    assert (completion.n, completion.stream, completion.presence_penalty, completion.echo, completion.typical_p) == (
        1, False, 0.0, False, 1.0)
    # min_p's null is unset, as its absence: the model's default where it has one, else 0.
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "min_p": None}).min_p is None
    assert completion.max_tokens is None  # nullable itself: null keeps meaning "up to the context"
    chat = ChatCompletionRequest.model_validate({**CHAT, "logprobs": None, "stream_options": None, "n": None})
    assert chat.logprobs is False and chat.n == 1 and chat.stream_options is None


async def test_a_stream_still_waiting_for_its_first_token_ends_when_the_client_leaves() -> None:
    # Until the first token the response has not started, so nothing else notices the client
    # leave: a request queued behind busy seats used to stay queued and then run for nobody.
    generator_closed = asyncio.Event()

    class NoFirstToken:
        model_info = SimpleNamespace(max_model_len=64)

        async def generate(self, prompt_ids, params):
            try:
                await asyncio.Event().wait()  # queued for good
                yield
            finally:
                generator_closed.set()  # the pipeline aborts the request here

    messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "app": create_app(Config()), "method": "POST", "path": "/v1/completions",
                       "headers": []}, receive)
    response = await asyncio.wait_for(
        _respond(request, NoFirstToken(), [[1, 2]], GenerationParams(max_tokens=4), True, None, "prompt"), 5)
    assert response.status_code == 499 and generator_closed.is_set()


async def test_scoring_a_prompt_counts_no_completion_token_in_the_context_error() -> None:
    # echo with max_tokens 0 runs one scoring token (CompletionRequest.completion_token_limit) that
    # the client never asked for: the refusal counts the prompt only, at the same boundary.
    class Accepted(Exception):
        pass

    class Pipeline:
        model_info = SimpleNamespace(max_model_len=64)

        def generate(self, prompt_ids, params):
            raise Accepted

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    request = Request({"type": "http", "app": create_app(Config()), "method": "POST", "path": "/v1/completions",
                       "headers": []}, receive)
    scoring = GenerationParams(max_tokens=1)
    with pytest.raises(Accepted):
        await _respond(request, Pipeline(), [[1] * 63], scoring, False, None, "prompt", prompt_only=True)
    with pytest.raises(APIError) as refused:
        await _respond(request, Pipeline(), [[1] * 64], scoring, False, None, "prompt", prompt_only=True)
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"
    assert "your prompt resulted in 64 tokens" in refused.value.message, refused.value.message
    assert "completion" not in refused.value.message, refused.value.message


def test_request_id_is_echoed_or_made(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": "m"}, headers={"X-Request-Id": "abc-123"})
    assert response.status_code == 400 and response.headers["x-request-id"] == "abc-123"
    made = client.post("/v1/completions", json={"model": "m"}).headers["x-request-id"]
    assert len(made) == 32
    # Not printable ASCII, or too long: ours instead (a UTF-8 id came back double-encoded).
    for given in ("café".encode(), b"a\tb", b"x" * 257):
        response = client.post("/v1/completions", json={"model": "m"}, headers=[(b"x-request-id", given)])
        made = response.headers["x-request-id"]
        assert response.status_code == 400 and len(made) == 32 and made.isalnum(), made
    longest = "y" * 256
    assert client.post("/v1/completions", json={"model": "m"},
                       headers={"X-Request-Id": longest}).headers["x-request-id"] == longest


def test_api_keys_guard_the_api_but_not_probes() -> None:
    keyed = TestClient(create_app(Config(api_key=["k1", "k2"])))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}):
        response = keyed.post("/v1/completions", json={"model": "m"}, headers=headers)
        assert response.status_code == 401
        assert assert_openai_error(response.json())["code"] == "invalid_api_key"
    for key in ("k1", "k2"):
        # past the key check: validation answers (no workers needed)
        response = keyed.post("/v1/completions", json={"model": "m"}, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 400
    assert keyed.post("/tokenize", json={}).status_code == 401
    assert keyed.get("/openapi.json").status_code == 200


def test_cors_flag_answers_preflights() -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    cors = TestClient(create_app(Config(cors_allow_origins=["https://app.example"], api_key=["k"])))
    response = cors.options("/v1/chat/completions", headers=preflight)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    plain = TestClient(create_app(Config()))
    assert "access-control-allow-origin" not in plain.options("/v1/chat/completions", headers=preflight).headers


def test_a_bug_is_a_500_with_the_request_id_cors_headers_and_an_access_line(caplog: pytest.LogCaptureFixture) -> None:
    # Answered by Starlette's outermost handler, it had none of the three: a browser could not read
    # it, and nothing tied it to a request.
    app = create_app(Config(cors_allow_origins=["https://app.example"]))

    @app.post("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("simulated bug")

    caplog.set_level(logging.INFO, logger="gateway")
    response = TestClient(app, raise_server_exceptions=False).post(
        "/v1/boom", headers={"Origin": "https://app.example", "X-Request-Id": "r-500"})
    assert response.status_code == 500 and response.headers["x-request-id"] == "r-500"
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    assert "simulated bug" in assert_openai_error(response.json(), "internal_server_error")["message"]
    assert any('"POST /v1/boom" 500' in r.getMessage() and "r-500" in r.getMessage() for r in caplog.records)
    assert any(r.name == "gateway.errors" and r.exc_info for r in caplog.records)  # the traceback


async def test_a_stream_its_client_left_still_gets_an_access_line(caplog: pytest.LogCaptureFixture) -> None:
    """Starlette cancels a stream whose client left; its last body message never goes out, which
    is where the line was written. Now as nginx logs it: 499, with the tokens so far."""
    from gateway.http_middleware import GatewayHTTPMiddleware, access_record

    async def streaming_app(scope, receive, send) -> None:
        access_record(scope).completion_tokens = 7
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        raise asyncio.CancelledError  # the client went away

    async def send(message) -> None:
        pass

    caplog.set_level(logging.INFO, logger="gateway.access")
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "client": ("1.2.3.4", 5)}
    with pytest.raises(asyncio.CancelledError):
        await GatewayHTTPMiddleware(streaming_app)(scope, _no_body, send)
    [line] = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
    assert '"POST /v1/completions" 499' in line


async def _no_body() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


def test_queue_full_is_429_with_retry_after() -> None:
    error = from_grpc_code(8, "1024 requests are already waiting")
    assert error.status == 429 and error.headers == {"Retry-After": "1"} and error.code == "queue_full"


def test_unknown_route_is_openai_shaped_404(client: TestClient) -> None:
    response = client.get("/v1/nothing")
    assert response.status_code == 404
    assert_openai_error(response.json(), "invalid_request_error")  # OpenAI's type for a 404 too


def test_non_finite_numbers_are_refused_as_such(client: TestClient) -> None:
    # Python's json reads NaN and Infinity; NaN failed the bounds as "less than or equal to 2".
    for value in ("NaN", "Infinity", "-Infinity"):
        response = client.post("/v1/completions", content=f'{{"model": "m", "prompt": "x", "temperature": {value}}}',
                               headers={"Content-Type": "application/json"})
        error = assert_openai_error(response.json(), "invalid_request_error")
        assert response.status_code == 400 and error["param"] == "temperature", response.text
        assert "finite number" in error["message"], error


@pytest.mark.parametrize(("extra", "param"), [
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
])
def test_checks_across_fields_name_their_param(client: TestClient, extra: dict, param: str) -> None:
    response = client.post("/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})
    assert response.status_code == 400
    assert assert_openai_error(response.json())["param"] == param


@pytest.mark.parametrize("extra", [
    {"continue_final_message": True},  # with add_generation_prompt's default true
    {"chat_template_kwargs": {"tokenize": True}},
])
def test_tokenize_checks_chat_template_fields_of_messages_only(client: TestClient, extra: dict) -> None:
    # vLLM's TokenizeCompletionRequest has no chat template fields: a prompt ignores them.
    class Tokenizer:
        async def encode_text_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [ord(c) for c in text]

    app = create_app(Config())
    app.state.served_model_name = "m"
    app.state.pipeline = SimpleNamespace(tokenizer=Tokenizer(), model_info=SimpleNamespace(max_model_len=64))
    served = TestClient(app)  # not entered: the stand-in pipeline above is the one served
    response = served.post("/tokenize", json={"prompt": "hi", **extra})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == [ord("h"), ord("i")]
    response = served.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}], **extra})
    assert response.status_code == 400
    assert assert_openai_error(response.json())["param"] == next(iter(extra))


def test_wrong_method_is_a_405_client_error_with_allow(client: TestClient) -> None:
    response = client.get("/v1/chat/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"  # RFC 9110 wants Allow
    assert_openai_error(response.json(), "invalid_request_error")


@pytest.mark.parametrize(("code", "status"), [(3, 400), (8, 429), (14, 503), (13, 500), (2, 500)])
def test_grpc_codes_map_to_http(code: int, status: int) -> None:
    assert from_grpc_code(code, "why").status == status


def test_error_sse_event_is_a_data_line() -> None:
    event = error_sse_event(APIError(429, "busy"))
    assert event.startswith("data: ") and event.endswith("\n\n")
    body = json.loads(event.removeprefix("data: "))
    assert body == {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": None}}


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_sent_as_another_media_type_is_named_as_such(client: TestClient, content_type: str | None) -> None:
    """Plain `curl -d` sends a form type: the body is valid JSON, the media type is what is wrong."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 5})
    headers = {"content-type": content_type} if content_type else {}
    response = client.post("/v1/chat/completions", content=body.encode(), headers=headers)
    assert response.status_code == 400
    error = assert_openai_error(response.json())
    assert error["message"] == "Unsupported Media Type: Only 'application/json' is allowed", error


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"])
def test_json_media_types_get_the_fields_own_errors(client: TestClient, content_type: str) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 5})
    response = client.post("/v1/chat/completions", content=body.encode(), headers={"content-type": content_type})
    assert response.status_code == 400
    assert assert_openai_error(response.json())["param"] == "temperature"


def test_openapi_operation_ids_are_unique() -> None:
    # HEAD /health and /ready once repeated their GET's operationId (FastAPI warned; client
    # generators that key on it break): they stay out of the document.
    document = create_app(Config()).openapi()
    ids = [op["operationId"] for path in document["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)), sorted(ids)
    assert set(document["paths"]["/health"]) == {"get"}
