"""A stand-in tritonserver for adapter tests that need time to pass on a real gRPC stream (deadlines, shutdown):
it answers readiness and streams `count` one-token responses of the `llm` model, `interval_s` apart, then a final
one (finish_reason "length"); with `stall_after` it goes silent after that many tokens. The prompt (`text_input`)
is that script as JSON; with return_model_instance, a first response names the script's engine instance (none while
the request waits in Triton's queue), and a request sent again (the same id) runs on `again_by` without stalling; a
tokenize_only probe gets the prompt back. Like the model, it answers a `cancel_request_id` request by ending that request with an error. It
records how each request ended: "completed", "cancelled" (by a cancel request), or "stream cancelled" (the client
cancelled its gRPC call, which the adapter must not do: tritonllm/interface/tensors.py, CANCEL_INPUT)."""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from stack_helpers import free_ports


@dataclass(frozen=True)
class Script:
    count: int = 3
    interval_s: float = 0.0
    stall_after: int | None = None
    instance: str | None = "llm_0_0"  # the engine instance that takes the request; None: not yet taken
    again_by: str | None = None  # the instance that runs it when it is sent again

    def prompt(self) -> str:
        return json.dumps({"count": self.count, "interval_s": self.interval_s, "stall_after": self.stall_after,
                           "instance": self.instance, "again_by": self.again_by})


def _tensor(name: str, datatype: str, value) -> tuple[service_pb2.ModelInferResponse.InferOutputTensor, bytes]:
    if datatype == "BYTES":
        raw = serialize_byte_tensor(np.array([value.encode()], dtype=np.object_)).item()
    elif datatype == "BOOL":
        raw = np.array([value], dtype=np.bool_).tobytes()
    else:
        raw = np.array([value], dtype=np.uint32).tobytes()
    return service_pb2.ModelInferResponse.InferOutputTensor(name=name, datatype=datatype, shape=[1]), raw


def _response(request_id: str, text: str, finish_reason: str, tokens: int) -> service_pb2.ModelStreamInferResponse:
    return _outputs(request_id, [
        _tensor("text_output", "BYTES", text), _tensor("finish_reason", "BYTES", finish_reason),
        _tensor("num_output_tokens", "UINT32", tokens), _tensor("num_input_tokens", "UINT32", 1)])


def _outputs(request_id: str, tensors: list) -> service_pb2.ModelStreamInferResponse:
    return service_pb2.ModelStreamInferResponse(infer_response=service_pb2.ModelInferResponse(
        model_name="llm", id=request_id, outputs=[tensor for tensor, _ in tensors],
        raw_output_contents=[raw for _, raw in tensors]))


class _Service(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}  # request id → how it ended
        self.cancelled: dict[str, threading.Event] = {}  # request id → set by a cancel request
        self.sent: set[str] = set()  # every generation request's id
        self.lock = threading.Lock()

    def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=True)

    def ModelStreamInfer(self, request_iterator, context):
        for request in request_iterator:
            inputs = {tensor.name: deserialize_bytes_tensor(raw)[0].decode()
                      for tensor, raw in zip(request.inputs, request.raw_input_contents) if tensor.datatype == "BYTES"}
            if "cancel_request_id" in inputs:
                with self.lock:
                    target = self.cancelled.get(inputs["cancel_request_id"])
                if target is not None:
                    target.set()
                yield _outputs(request.id, [_tensor("cancelled", "BOOL", target is not None)])
                return
            if any(tensor.name == "tokenize_only" for tensor in request.inputs):  # the adapter's probe
                yield _outputs(request.id, [_tensor("text_output", "BYTES", inputs["text_input"]),
                                            _tensor("max_model_len", "UINT32", 2048)])
                return
            script = Script(**json.loads(inputs["text_input"]))
            cancelled = threading.Event()
            with self.lock:
                if script.again_by is not None and request.id in self.sent:
                    script = Script(script.count, script.interval_s, instance=script.again_by)
                self.sent.add(request.id)
                self.cancelled[request.id] = cancelled
            # A call cancelled while this generator waits at a `yield` is never resumed: its outcome is
            # recorded when the call ends, whatever ends it.
            context.add_callback(lambda request_id=request.id: self._record_first(request_id, "stream cancelled"))
            if script.instance is not None and any(tensor.name == "return_model_instance" for tensor in request.inputs):
                yield _outputs(request.id, [_tensor("model_instance", "BYTES", script.instance)])
            for index in range(script.count):
                if script.stall_after is not None and index >= script.stall_after:
                    break
                if not self._sleep(script.interval_s, context, cancelled):
                    break
                yield _response(request.id, f" t{index}", "None", 1)
            else:
                self._record_first(request.id, "completed")
                yield _response(request.id, "", "length", 0)
                return
            while context.is_active() and not cancelled.is_set():  # stalled: silent until cancelled
                time.sleep(0.02)
            if cancelled.is_set():  # the model's answer: an error, its final response
                self._record_first(request.id, "cancelled")
                yield service_pb2.ModelStreamInferResponse(error_message="the request was cancelled")
            return

    @staticmethod
    def _sleep(seconds: float, context, cancelled: threading.Event) -> bool:
        """Sleep; False as soon as the client has cancelled the call or the request."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not context.is_active() or cancelled.is_set():
                return False
            time.sleep(min(0.02, deadline - time.monotonic()))
        return context.is_active() and not cancelled.is_set()

    def _record_first(self, request_id: str, outcome: str) -> None:
        with self.lock:
            self.outcomes.setdefault(request_id, outcome)


class FakeTriton:
    """The stand-in on a free loopback port, until stop()."""

    def __init__(self) -> None:
        self.service = _Service()
        [port] = free_ports(1)
        self.url = f"127.0.0.1:{port}"
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self.service, self._server)
        self._server.add_insecure_port(self.url)
        self._server.start()

    def outcomes(self) -> list[str]:
        with self.service.lock:
            return list(self.service.outcomes.values())

    def wait_for_outcomes(self, count: int, timeout: float = 10.0) -> list[str]:
        """The calls' outcomes once `count` calls have ended."""
        deadline = time.monotonic() + timeout
        while len(self.outcomes()) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.outcomes()

    def stop(self) -> None:
        self._server.stop(grace=None)
