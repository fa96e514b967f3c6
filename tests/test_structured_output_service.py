"""Structured output through the real processes (tiny random model, SmolLM2 tokenizer): the model
worker's gRPC Generate with AddRequest.structured_output, and the gateway's REST API with OpenAI's
response_format and vLLM's guided_* fields, streamed and not; a schema that does not compile is a
clear INVALID_ARGUMENT / HTTP 400."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest

from tests.conftest import tiny_model_worker
from tests.test_structured_output_engine import SCHEMA
from tokenwire.grpc_server import CHANNEL_OPTIONS
from tokenwire.packing import unpack_int32_list
from tokenwire.stack import Stack, start_stack
from tokenwire.v1 import model_worker_pb2 as pb
from tokenwire.v1 import model_worker_pb2_grpc

pytestmark = pytest.mark.slow

UNSUPPORTED = {"type": "array", "uniqueItems": True}
REGEX = r"[a-z]{2,6}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]


@pytest.fixture(scope="module")
def stub(tiny_model_dir) -> Iterator[model_worker_pb2_grpc.ModelWorkerStub]:
    with tiny_model_worker(tiny_model_dir, "--max-num-seqs", "8", "--max-model-len", "256") as address, \
            grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        yield model_worker_pb2_grpc.ModelWorkerStub(channel)


def add(request_id: str, structured_output: pb.StructuredOutput | None, n: int = 1) -> pb.AddRequest:
    return pb.AddRequest(request_id=request_id, prompt_token_ids=[1, 4093, 198, 19556], max_tokens=100, n=n,
                         sampling=pb.SamplingParams(temperature=1.0, seed=11), structured_output=structured_output)


def test_grpc_constraints_share_one_stream(stub, smollm2):
    frame = pb.RequestFrame(adds=[
        add("schema", pb.StructuredOutput(json_schema=json.dumps(SCHEMA)), n=2),
        add("regex", pb.StructuredOutput(regex=REGEX)),
        add("choice", pb.StructuredOutput(choice=pb.StructuredOutput.Choice(choices=CHOICES))),
        add("object", pb.StructuredOutput(json_object=True)),
        add("free", None),
        add("bad", pb.StructuredOutput(json_schema=json.dumps(UNSUPPORTED))),
    ])
    tokens: dict[tuple[str, int], list[int]] = {}
    finals: dict[tuple[str, int], pb.SequenceTokens] = {}
    for reply in stub.Generate(iter([frame]), timeout=120):
        for seq in reply.sequences:
            key = (seq.request_id, seq.index)
            tokens.setdefault(key, []).extend(unpack_int32_list(seq.token_ids))
            if seq.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finals[key] = seq

    def text(key: tuple[str, int]) -> str:
        return smollm2.decode([t for t in tokens[key] if t != 2])

    for index in (0, 1):
        jsonschema.validate(json.loads(text(("schema", index))), SCHEMA)
        assert finals[("schema", index)].finish_reason == pb.FINISH_REASON_STOP
    assert re.fullmatch(REGEX, text(("regex", 0)))
    assert text(("choice", 0)) in CHOICES
    # The tiny model rambles, so a free-form object may hit max_tokens; what came must be an object's start.
    assert text(("object", 0)).startswith("{")
    assert finals[("free", 0)].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    bad = finals[("bad", 0)]
    assert bad.finish_reason == pb.FINISH_REASON_ERROR
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "uniqueItems" in bad.error.message


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[openai.OpenAI]:
    stack: Stack
    with start_stack(["--model", str(tiny_model_dir), "--load-format", "dummy", "--max-num-seqs", "8",
                      "--max-model-len", "256", "--device", "cpu"], timeout_s=180) as stack:
        yield openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=60)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}


def chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=100, temperature=1.0,
                                          messages=[{"role": "user", "content": "Describe a thing as JSON."}],
                                          **kwargs)


def test_rest_response_format_json_schema(client):
    reply = chat(client, response_format=schema_format(SCHEMA), seed=3, n=2)
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"


def test_rest_streamed_json_schema_and_guided_fields(client):
    chunks = chat(client, response_format=schema_format(SCHEMA), seed=4, stream=True)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), SCHEMA)
    assert chat(client, extra_body={"guided_choice": CHOICES}, seed=5).choices[0].message.content in CHOICES
    assert re.fullmatch(REGEX, chat(client, extra_body={"guided_regex": REGEX}, seed=6).choices[0].message.content)


def test_rest_stop_string_cuts_a_constrained_output(client):
    full = chat(client, response_format=schema_format(SCHEMA), seed=7).choices[0].message.content
    cut = chat(client, response_format=schema_format(SCHEMA), seed=7, stop=['"count"']).choices[0]
    assert cut.finish_reason == "stop"
    assert full.startswith(cut.message.content) and '"count"' not in cut.message.content


def test_rest_uncompilable_schema_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, response_format=schema_format(UNSUPPORTED))
    assert "uniqueItems" in str(caught.value) and caught.value.param == "response_format"
    # The 400 names whichever field held the constraint.
    for fields, param in (({"guided_regex": "(unclosed"}, "guided_regex"),
                          ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs")):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, extra_body=fields)
        assert caught.value.param == param, caught.value
