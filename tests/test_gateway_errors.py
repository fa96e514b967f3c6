"""Unit tests of the gateway's error side: OpenAI error bodies, status mapping, 422 → 400.

Runs the real create_app routes (without its lifespan, so no workers) through Starlette's
in-process TestClient: validation answers before any worker is needed.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import Config
from gateway.errors import APIError, error_sse_event, from_grpc_code


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
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert_openai_error(response.json())


def test_unsupported_parameter_message(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": "m", "prompt": "x", "frequency_penalty": 1})
    assert response.status_code == 400
    assert "frequency_penalty is not supported yet" in response.json()["error"]["message"]


def test_unknown_route_is_openai_shaped_404(client: TestClient) -> None:
    response = client.get("/v1/nothing")
    assert response.status_code == 404
    assert_openai_error(response.json(), "not_found_error")


@pytest.mark.parametrize(("code", "status"), [(3, 400), (8, 429), (14, 503), (13, 500), (2, 500)])
def test_grpc_codes_map_to_http(code: int, status: int) -> None:
    assert from_grpc_code(code, "why").status == status


def test_error_sse_event_is_a_data_line() -> None:
    event = error_sse_event(APIError(429, "busy"))
    assert event.startswith("data: ") and event.endswith("\n\n")
    body = json.loads(event.removeprefix("data: "))
    assert body == {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": None}}
