"""TLS and mTLS on the gRPC hops (tokenwire.grpc_tls): flag validation in the three Configs, and
real handshakes against an in-process server on loopback (health service only, so no model).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import detok_worker.config
import gateway.config
import model_worker.config
from tests.tls_certs import Certs, make_certs
from tokenwire import grpc_server
from tokenwire.grpc_tls import ClientTLS, add_port, aio_channel, client_tls, server_tls
from tokenwire.stack import free_port


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


async def health_check(address: str, tls: ClientTLS | None) -> int:
    async with aio_channel(address, tls, grpc_server.CHANNEL_OPTIONS) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def start_server(certs: Certs, mutual: bool) -> tuple[grpc.aio.Server, str]:
    server = grpc_server.new_server()
    health = grpc_server.add_health_and_reflection(server, [])
    await grpc_server.mark_serving(health, [])
    address = f"127.0.0.1:{free_port()}"
    tls = server_tls(str(certs.server_cert), str(certs.server_key), str(certs.ca) if mutual else "")
    add_port(server, address, tls)
    await server.start()
    return server, address


def test_server_flags_come_in_pairs_and_must_be_readable(certs: Certs, tmp_path: Path) -> None:
    for config_cls in (model_worker.config.Config, detok_worker.config.Config):
        assert config_cls().tls is None
        with pytest.raises(ValueError, match="--tls-cert-file and --tls-key-file go together"):
            config_cls(tls_cert_file=str(certs.server_cert))
        with pytest.raises(ValueError, match="go together"):
            config_cls(tls_client_ca_file=str(certs.ca))
        with pytest.raises(ValueError, match="--tls-key-file: cannot read"):
            config_cls(tls_cert_file=str(certs.server_cert), tls_key_file=str(tmp_path / "missing.key"))
        config = config_cls(tls_cert_file=str(certs.server_cert), tls_key_file=str(certs.server_key),
                            tls_client_ca_file=str(certs.ca))
        assert config.tls is not None and config.tls.client_ca_file == str(certs.ca)


def test_a_key_of_another_certificate_or_a_ca_file_of_no_certificate_is_a_start_up_error(certs: Certs) -> None:
    # grpc took them and failed every handshake later: the gateway said only DEADLINE_EXCEEDED,
    # after its whole --startup-timeout-s.
    with pytest.raises(ValueError, match="--worker-tls-key-file .* does not load as the private key of --worker-tls-cert-file"):
        gateway.config.Config(worker_tls_ca_file=str(certs.ca), worker_tls_cert_file=str(certs.client_cert),
                              worker_tls_key_file=str(certs.server_key))
    with pytest.raises(ValueError, match="--worker-tls-ca-file .* holds no PEM certificate"):
        gateway.config.Config(worker_tls_ca_file=str(certs.server_key))
    with pytest.raises(ValueError, match="--tls-key-file .* does not load as the private key of --tls-cert-file"):
        model_worker.config.Config(tls_cert_file=str(certs.server_cert), tls_key_file=str(certs.client_key))
    with pytest.raises(ValueError, match="--tls-client-ca-file .* holds no PEM certificate"):
        detok_worker.config.Config(tls_cert_file=str(certs.server_cert), tls_key_file=str(certs.server_key),
                                   tls_client_ca_file=str(certs.client_key))


def test_an_encrypted_key_is_a_start_up_error_not_a_passphrase_prompt(tmp_path: Path) -> None:
    from tests.tls_certs import _openssl

    cert, key = tmp_path / "enc.pem", tmp_path / "enc.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-passout", "pass:secret",
             "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=enc")
    with pytest.raises(ValueError, match="--tls-key-file .* it is encrypted"):
        model_worker.config.Config(tls_cert_file=str(cert), tls_key_file=str(key))


def test_gateway_flags_need_a_ca_and_a_whole_client_pair(certs: Certs) -> None:
    assert gateway.config.Config().worker_tls is None
    with pytest.raises(ValueError, match="--worker-tls-ca-file is needed"):
        gateway.config.Config(worker_tls_cert_file=str(certs.client_cert), worker_tls_key_file=str(certs.client_key))
    with pytest.raises(ValueError, match="go together"):
        gateway.config.Config(worker_tls_ca_file=str(certs.ca), worker_tls_cert_file=str(certs.client_cert))
    with pytest.raises(ValueError, match="needs --worker-tls-ca-file"):
        gateway.config.Config(worker_tls_server_name="localhost")
    with pytest.raises(ValueError, match="--tls-cert-file and --tls-key-file go together"):
        gateway.config.Config(tls_key_file=str(certs.server_key))
    config = gateway.config.Config(worker_tls_ca_file=str(certs.ca), worker_tls_cert_file=str(certs.client_cert),
                                   worker_tls_key_file=str(certs.client_key), worker_tls_server_name="localhost")
    assert config.worker_tls == ClientTLS(str(certs.ca), str(certs.client_cert), str(certs.client_key), "localhost")


async def test_tls_server_takes_tls_clients_and_refuses_plaintext(certs: Certs) -> None:
    server, address = await start_server(certs, mutual=False)
    try:
        assert await health_check(address, client_tls(str(certs.ca), "", "", "")) == \
            health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as plaintext:
            await health_check(address, None)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
        # A client that trusts another CA must not accept the worker's certificate.
        with pytest.raises(grpc.aio.AioRpcError) as untrusted:
            await health_check(address, client_tls(str(certs.rogue_cert), "", "", ""))
        assert untrusted.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


async def test_mtls_server_needs_a_client_certificate_from_its_ca(certs: Certs) -> None:
    server, address = await start_server(certs, mutual=True)
    try:
        good = client_tls(str(certs.ca), str(certs.client_cert), str(certs.client_key), "")
        assert await health_check(address, good) == health_pb2.HealthCheckResponse.SERVING
        for who, tls in [("no client certificate", client_tls(str(certs.ca), "", "", "")),
                         ("a certificate from another CA",
                          client_tls(str(certs.ca), str(certs.rogue_cert), str(certs.rogue_key), ""))]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_check(address, tls)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, who
    finally:
        await server.stop(None)


async def test_server_name_override_verifies_an_ip_address_by_name(certs: Certs) -> None:
    server, address = await start_server(certs, mutual=False)
    try:
        # The cert names localhost and 127.0.0.1; asking for "localhost" at 127.0.0.1 passes,
        # asking for a name the cert lacks fails verification.
        assert await health_check(address, client_tls(str(certs.ca), "", "", "localhost")) == \
            health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError):
            await health_check(address, client_tls(str(certs.ca), "", "", "model-worker.example"))
    finally:
        await server.stop(None)


async def test_a_replica_resolved_from_a_dns_name_is_verified_by_that_name(certs: Certs) -> None:
    # A dns:/// entry resolves to pod IPs, and a pod's certificate names the Service: the channel
    # to each address checks the name it came from (the cert here names localhost, not the other).
    from gateway.replica_set import replica_channel

    server, address = await start_server(certs, mutual=False)
    tls = client_tls(str(certs.ca), "", "", "")
    try:
        for tls_name, verified in (("localhost", True), ("model-worker.example", False), ("", True)):
            async with replica_channel(address, tls, grpc_server.CHANNEL_OPTIONS, tls_name) as channel:
                check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                if verified:
                    assert (await check).status == health_pb2.HealthCheckResponse.SERVING
                else:
                    with pytest.raises(grpc.aio.AioRpcError):
                        await check
    finally:
        await server.stop(None)
