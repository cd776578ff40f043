"""Per-tenant bounded queues: past `--max-pending` unfinished requests a tenant gets HTTP 429 (other tenants
are unaffected), and the real SDK, which retries 429 with back-off, still completes every call."""

from __future__ import annotations

import httpx
import numpy as np
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.service.http_server import KEYS, running_server, service_client, write_keys


def _datum(i):
    tokens = [(3 + i + j) % 60 for j in range(65)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(64, np.float32)})


def test_queue_bound_gives_429_per_tenant_and_the_sdk_rides_it_out(tmp_path):
    with running_server(tmp_path / "store", write_keys(tmp_path / "keys"), args=("--max-pending", "2")) as srv, \
            service_client(srv, "alice") as alice, service_client(srv, "bob") as bob:
        tc = alice.create_lora_training_client(base_model="tiny", rank=4).result()
        req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=[_datum(i) for i in range(16)], loss_fn="cross_entropy"), model_id=tc.model_id, seq_id=1)
        body = forward_backward_request_to_proto(req).SerializeToString()
        post = lambda: httpx.post(f"{srv.url}/api/v1/forward_backward", content=body, timeout=30,  # noqa: E731
                                  headers={"X-API-Key": KEYS["alice"], "Content-Type": "application/x-protobuf"})
        codes = [post().status_code for _ in range(3)]
        assert codes == [200, 200, 429], codes
        refused = post()
        assert refused.status_code == 429 and "unfinished requests" in refused.json()["detail"]
        # refused before its body is decoded: a flood of refusals costs the server a read, not a parse
        junk = httpx.post(f"{srv.url}/api/v1/forward_backward", content=b"not protobuf", timeout=30,
                          headers={"X-API-Key": KEYS["alice"], "Content-Type": "application/x-protobuf"})
        assert junk.status_code == 429, junk.text
        # bob's queue is his own
        assert bob.create_lora_training_client(base_model="tiny", rank=4).result().model_id
        # the SDK retries 429 with back-off until alice's queue drains
        futures = [tc.forward_backward([_datum(i)], "cross_entropy") for i in range(4)]
        assert all(np.isfinite(f.result().metrics["loss:sum"]) for f in futures)
