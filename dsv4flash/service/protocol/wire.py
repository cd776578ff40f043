"""The SDK's binary bodies: protobuf `ForwardBackwardRequest` in (optionally zstd), protobuf results out.

Message classes come from the `tinker` package (`tinker.proto.tinker_public_pb2`); this module only moves
bytes between those messages and the service core's types.
"""

from __future__ import annotations

import numpy as np

from dsv4flash.service import types as core

PROTO_CONTENT_TYPE = "application/x-protobuf"
_NP = {"float32": np.float32, "int64": np.int64}


class WireError(ValueError):
    """A body that does not decode; the message names the field."""


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


class BodyTooLarge(ValueError):
    """A body that decompresses past the request limit (HTTP 413)."""


def decompress(body: bytes, content_encoding: str | None, *, limit: int) -> bytes:
    """Undo `Content-Encoding: zstd`, streaming: stops with `BodyTooLarge` once more than `limit` bytes come out, so a
    small compressed body cannot make the server hold its whole (arbitrarily large) decompressed form."""
    if not content_encoding or content_encoding == "identity":
        return body
    if content_encoding != "zstd":
        raise WireError(f"Content-Encoding: {content_encoding!r} is not supported (zstd or none)")
    import io

    import zstandard

    out, size = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            while chunk := reader.read(min(1 << 20, limit + 1 - size)):
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"request body decompresses to more than the {limit}-byte request limit")
                out.append(chunk)
    except zstandard.ZstdError as exc:
        raise WireError(f"body: not valid zstd ({exc})") from exc
    return b"".join(out)


def _tensor(msg, where: str) -> core.TensorData:
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_INT64: "int64"}
    if msg.dtype not in dtypes:
        raise WireError(f"{where}: dtype {msg.dtype} is not float32 or int64")
    dtype = dtypes[msg.dtype]
    if msg.HasField("sparse_csr"):
        raise WireError(f"{where}: sparse CSR tensors are not supported by this server (send dense)")
    if len(msg.dense) % np.dtype(_NP[dtype]).itemsize:
        raise WireError(f"{where}: {len(msg.dense)} bytes is not a whole number of {dtype} values")
    arr = np.frombuffer(msg.dense, dtype=_NP[dtype])
    shape = list(msg.shape) or [arr.size]
    if int(np.prod(shape)) != arr.size:
        raise WireError(f"{where}: shape {shape} does not hold {arr.size} values")
    return core.TensorData(arr, dtype, shape)


def _spans(msgs, where: str) -> list[core.ProvenanceSpan] | None:
    """Repeated ProvenanceSpan -> core spans (None when the datum carries none)."""
    if not len(msgs):
        return None
    out: list[core.ProvenanceSpan] = []
    for j, m in enumerate(msgs):
        arm = m.WhichOneof("span")
        if arm is None:
            raise WireError(f"{where}[{j}]: neither prompt_tokens nor sampled_tokens is set")
        a = getattr(m, arm)
        if not a.sequence_id:
            raise WireError(f"{where}[{j}].sequence_id: required (a SampledSequence.sequence_id)")
        kind = core.SampledProvenanceSpan if arm == "sampled_tokens" else core.PromptProvenanceSpan
        out.append(kind(sequence_id=a.sequence_id, offset=int(a.offset), length=int(a.length)))
    return out


def decode_forward_backward(body: bytes) -> tuple[str, int, bool, str, dict, list[core.Datum]]:
    """Protobuf body -> (model_id, seq_id, forward_only, loss_fn, loss_fn_config, core data)."""
    from google.protobuf.message import DecodeError

    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise WireError(f"forward_backward body: not a tinker ForwardBackwardRequest protobuf ({exc})") from exc
    if not msg.model_id:
        raise WireError("forward_backward: model_id is empty")
    config: dict = {k: v for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else v.number
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for j, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"data[{i}].model_input[{j}]: {kind} chunks are not supported (text only on this "
                                f"engine)")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {k: _tensor(t, f"data[{i}].loss_fn_inputs[{k!r}]") for k, t in d.loss_fn_inputs.items()}
        spans = [_spans(d.model_input_spans, f"data[{i}].model_input_spans"),
                 _spans(d.loss_fn_input_spans, f"data[{i}].loss_fn_input_spans")]
        if (spans[0] is None) != (spans[1] is None):
            raise WireError(f"data[{i}]: provenance comes as a pair (model_input_spans and loss_fn_input_spans)")
        data.append(core.Datum(core.ModelInput.from_ints(tokens), inputs, *spans))
    return msg.model_id, int(msg.seq_id), bool(msg.forward_only), msg.loss_fn, config, data


def _json_tensor(value, where: str) -> core.TensorData:
    if not isinstance(value, dict) or "data" not in value:
        raise WireError(f"{where}: expected a TensorData object {{data, dtype, shape}}")
    if value.get("sparse_crow_indices") is not None:
        raise WireError(f"{where}: sparse CSR tensors are not supported by this server (send dense)")
    dtype = value.get("dtype", "float32")
    if dtype not in _NP:
        raise WireError(f"{where}.dtype: {dtype!r} is not float32 or int64")
    try:
        arr = np.asarray(value["data"], dtype=_NP[dtype]).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise WireError(f"{where}.data: not a list of numbers ({exc})") from exc
    shape = list(value.get("shape") or [arr.size])
    if int(np.prod(shape)) != arr.size:
        raise WireError(f"{where}.shape: {shape} does not hold {arr.size} values")
    return core.TensorData(arr, dtype, shape)


def json_tokens(model_input, where: str) -> list[int]:
    """Token ids of a JSON ModelInput {chunks: [{type: encoded_text, tokens}]}."""
    chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
    if not isinstance(chunks, list):
        raise WireError(f"{where}.chunks: expected a list of chunks")
    out: list[int] = []
    for j, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise WireError(f"{where}.chunks.{j}: only encoded_text chunks are supported on this engine")
        if not isinstance(chunk.get("tokens"), list):
            raise WireError(f"{where}.chunks.{j}.tokens: expected a list of token ids")
        out.extend(int(t) for t in chunk["tokens"])
    return out


def decode_forward_backward_json(body: dict, input_key: str) -> tuple[str, int, str, dict, list[core.Datum]]:
    """JSON body of older SDKs (`forward_backward_input` / `forward_input`) -> (model_id, seq_id, loss_fn,
    loss_fn_config, core data)."""
    if not isinstance(body, dict) or not isinstance(body.get("model_id"), str):
        raise WireError("model_id: required (a string)")
    fbi = body.get(input_key)
    if not isinstance(fbi, dict) or not isinstance(fbi.get("data"), list):
        raise WireError(f"{input_key}.data: required (a list of Datum)")
    data = []
    for i, d in enumerate(fbi["data"]):
        where = f"{input_key}.data.{i}"
        if not isinstance(d, dict):
            raise WireError(f"{where}: expected a Datum object")
        inputs = d.get("loss_fn_inputs") or {}
        if not isinstance(inputs, dict):
            raise WireError(f"{where}.loss_fn_inputs: expected an object of TensorData")
        data.append(core.Datum(core.ModelInput.from_ints(json_tokens(d.get("model_input"), f"{where}.model_input")),
                               {k: _json_tensor(v, f"{where}.loss_fn_inputs.{k}") for k, v in inputs.items()}))
    config = fbi.get("loss_fn_config") or {}
    if not isinstance(config, dict):
        raise WireError(f"{input_key}.loss_fn_config: expected an object")
    return body["model_id"], int(body.get("seq_id") or 0), str(fbi.get("loss_fn", "")), config, data


def _batched(arrays: list[np.ndarray], dtype: str):
    pb = _pb()
    bt = pb.BatchedTensor()
    bt.dtype = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}[dtype]
    flat = [np.ascontiguousarray(a, dtype=_NP[dtype]).reshape(-1) for a in arrays]
    offsets = np.cumsum([0] + [a.nbytes for a in flat]).astype(np.int64)
    bt.data = b"".join(a.tobytes() for a in flat)
    bt.offsets = offsets.tobytes()
    return bt


def encode_forward_backward_output(out: core.ForwardBackwardOutput) -> bytes:
    """Core ForwardBackwardOutput -> the SDK's protobuf (one ArrayRecord, one batched tensor per field)."""
    msg = _pb().ForwardBackwardOutput()
    msg.loss_fn_output_type = "ArrayRecord"
    for k, v in out.metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(out.loss_fn_outputs)
    names = list(out.loss_fn_outputs[0]) if out.loss_fn_outputs else []
    for name in names:
        dtype = out.loss_fn_outputs[0][name].dtype
        record.fields[name].CopyFrom(_batched([o[name].to_numpy() for o in out.loss_fn_outputs], dtype))
    return msg.SerializeToString()


def encode_sample_response(resp: core.SampleResponse) -> bytes:
    """Core SampleResponse -> the SDK's protobuf SampleResponse."""
    pb = _pb()
    msg = pb.SampleResponse()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    for seq in resp.sequences:
        s = msg.sequences.add()
        s.stop_reason = reasons[seq.stop_reason]
        s.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        if seq.logprobs is not None:
            s.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.topk_logprobs is not None:
            _topk(s.topk_sampled_logprobs, seq.topk_logprobs)
    if resp.prompt_logprobs is not None:
        # The SDK reads NaN as "no log-prob" (the first prompt token has none).
        msg.prompt_logprobs = np.asarray([np.nan if x is None else x for x in resp.prompt_logprobs],
                                         dtype=np.float32).tobytes()
    if resp.topk_prompt_logprobs is not None:
        _topk(msg.topk_prompt_logprobs, resp.topk_prompt_logprobs)
    return msg.SerializeToString()


TOPK_EMPTY_LOGPROB = -99999.0  # the SDK's empty top-k cell (token 0)


def _topk(msg, rows: list[list[tuple[int, float]] | None]) -> None:
    """Per-position (token, log-prob) lists -> the SDK's dense N×K TopkLogprobs (short or None rows padded)."""
    rows = [r or [] for r in rows]
    k = max((len(r) for r in rows), default=0)
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), TOPK_EMPTY_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate(row):
            ids[i, j], lps[i, j] = tok, lp
    msg.token_ids, msg.logprobs, msg.k, msg.length = ids.tobytes(), lps.tobytes(), k, len(rows)
