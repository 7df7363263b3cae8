"""How the engine core's inputs and outputs cross a process boundary: msgspec structs encoded as MessagePack
arrays, one zmq message of two frames each (a header: the kind and the replica; the payload). Nothing is pickled:
`SamplingParams` travels as a struct of its fields, and outputs as columns (ids, tokens) with sparse extras.

Needs msgspec (`pip install 'ember[serve]'`); only the multi-process client and the core's process import this."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import msgspec

from ember.engine.core_io import CoreInfo, CoreStats, EngineCoreOutputs, EngineCoreRequest, PromptLogprobData
from ember.sampling_params import SamplingParams, StructuredOutputsParams

# message kinds, the first byte of a message's header
ADD, ABORT, FINISH, CALL, SHUTDOWN, HOLD, RELEASE = 1, 2, 3, 4, 5, 6, 7   # front end -> core
OUTPUTS, READY, CALL_RESULT, FATAL = 11, 12, 13, 14               # core -> front end


class WireStructuredOutputs(msgspec.Struct, array_like=True, frozen=True):
    """`StructuredOutputsParams`' fields, in its order."""
    json: dict | None
    regex: str | None
    choice: tuple[str, ...] | None
    grammar: str | None
    json_object: bool | None
    disable_any_whitespace: bool
    disable_additional_properties: bool
    whitespace_pattern: str | None
    disable_fallback: bool


class WireSamplingParams(msgspec.Struct, array_like=True, frozen=True):
    """`SamplingParams`' fields, in its order, with the types its validation leaves them in."""
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    max_tokens: int | None
    min_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    structured_outputs: WireStructuredOutputs | None


_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_STRUCTURED_FIELDS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams))
for _wire, _fields, _name in ((WireSamplingParams, _PARAM_FIELDS, "SamplingParams"),
                              (WireStructuredOutputs, _STRUCTURED_FIELDS, "StructuredOutputsParams")):
    if _fields != _wire.__struct_fields__:
        raise ImportError(f"{_wire.__name__} {_wire.__struct_fields__} must list {_name}' fields {_fields} in order")


class WireRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: WireSamplingParams
    sampling_seeds: tuple[int, ...]
    arrival_time: float


class WireOutputs(msgspec.Struct, array_like=True, gc=False):
    req_ids: list[str]
    new_token_ids: list[int]
    finished: dict[str, tuple[str, int | None, int]]
    logprobs: dict[str, list[tuple[list[int], list[float], int]]]
    num_cached_tokens: dict[str, int]
    failed_ids: list[str]
    failure: str | None
    stats: CoreStats


class WireCall(msgspec.Struct, array_like=True):
    """A call of one of the core's methods (`CALLS`) that answers with one value."""
    call_id: int
    method: str
    args: tuple[list[int], int]


class WireCallResult(msgspec.Struct, array_like=True):
    call_id: int
    error: str | None
    value: msgspec.Raw


# the core's methods a front end may call, and the types of their answers
CALLS = {"prompt_logprobs": PromptLogprobData}


def params_to_wire(params: SamplingParams) -> WireSamplingParams:
    values = [getattr(params, name) for name in _PARAM_FIELDS]
    structured = params.structured_outputs
    if structured is not None:
        values[_PARAM_FIELDS.index("structured_outputs")] = WireStructuredOutputs(*[getattr(structured, name) for name in _STRUCTURED_FIELDS])
    return WireSamplingParams(*values)


def params_from_wire(wire: WireSamplingParams) -> SamplingParams:
    """The `SamplingParams` again, without validating them twice (the front end made them; a grammar's params are
    made again, for their cache key)."""
    params = object.__new__(SamplingParams)
    for name in _PARAM_FIELDS:
        object.__setattr__(params, name, getattr(wire, name))
    structured = wire.structured_outputs
    if structured is not None:
        object.__setattr__(params, "structured_outputs", StructuredOutputsParams(
            **{name: getattr(structured, name) for name in _STRUCTURED_FIELDS}))
    return params


class Header(NamedTuple):
    kind: int
    replica: int


def header(kind: int, replica: int = 0) -> bytes:
    return bytes((kind, replica & 0xFF, replica >> 8))


def read_header(frame: bytes) -> Header:
    return Header(frame[0], frame[1] | frame[2] << 8)


class Codec:
    """The encoders and decoders of every message, made once (msgspec's are reusable and fast)."""

    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder()
        self.encode = self._encoder.encode
        self._request = msgspec.msgpack.Decoder(WireRequest)
        self._outputs = msgspec.msgpack.Decoder(WireOutputs)
        self._ids = msgspec.msgpack.Decoder(list[str])
        self._call = msgspec.msgpack.Decoder(WireCall)
        self._call_result = msgspec.msgpack.Decoder(WireCallResult)
        self._info = msgspec.msgpack.Decoder(CoreInfo)
        self._text = msgspec.msgpack.Decoder(str)

    # front end -> core
    def encode_request(self, request: EngineCoreRequest) -> bytes:
        return self.encode(WireRequest(request.request_id, request.prompt_token_ids,
                                       params_to_wire(request.sampling_params), request.sampling_seeds,
                                       request.arrival_time))

    def decode_request(self, payload: bytes) -> EngineCoreRequest:
        w = self._request.decode(payload)
        return EngineCoreRequest(w.request_id, w.prompt_token_ids, params_from_wire(w.sampling_params),
                                 w.sampling_seeds, w.arrival_time)

    def decode_ids(self, payload: bytes) -> list[str]:
        return self._ids.decode(payload)

    def decode_call(self, payload: bytes) -> WireCall:
        return self._call.decode(payload)

    # core -> front end
    def encode_outputs(self, out: EngineCoreOutputs) -> bytes:
        return self.encode(WireOutputs(out.req_ids, out.new_token_ids, out.finished, out.logprobs,
                                       out.num_cached_tokens, out.failed_ids, out.failure, out.stats))

    def decode_outputs(self, payload: bytes) -> EngineCoreOutputs:
        w = self._outputs.decode(payload)
        return EngineCoreOutputs(w.req_ids, w.new_token_ids, w.finished, w.logprobs, w.num_cached_tokens,
                                 w.failed_ids, w.failure, w.stats)

    def encode_call_result(self, call_id: int, value=None, error: str | None = None) -> bytes:
        return self.encode(WireCallResult(call_id, error, msgspec.Raw(self.encode(value))))

    def decode_call_result(self, payload: bytes) -> WireCallResult:
        return self._call_result.decode(payload)

    def decode_value(self, method: str, raw: msgspec.Raw):
        return msgspec.msgpack.decode(raw, type=CALLS[method])

    def decode_info(self, payload: bytes) -> CoreInfo:
        return self._info.decode(payload)

    def decode_text(self, payload: bytes) -> str:
        return self._text.decode(payload)
